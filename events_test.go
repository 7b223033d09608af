package ecxfer

import (
	"context"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// eventLog is a slog.Handler that keeps every record, with its attributes
// (the logger's own included) flattened into a map.
type eventLog struct {
	mu    *sync.Mutex
	recs  *[]event
	attrs []slog.Attr
}

type event struct {
	name  string
	level slog.Level
	attrs map[string]slog.Value
}

func newEventLog() *eventLog { return &eventLog{mu: &sync.Mutex{}, recs: &[]event{}} }

func (l *eventLog) Enabled(context.Context, slog.Level) bool { return true }

func (l *eventLog) Handle(_ context.Context, r slog.Record) error {
	e := event{name: r.Message, level: r.Level, attrs: map[string]slog.Value{}}
	for _, a := range l.attrs {
		e.attrs[a.Key] = a.Value
	}
	r.Attrs(func(a slog.Attr) bool { e.attrs[a.Key] = a.Value; return true })
	l.mu.Lock()
	*l.recs = append(*l.recs, e)
	l.mu.Unlock()
	return nil
}

func (l *eventLog) WithAttrs(as []slog.Attr) slog.Handler {
	return &eventLog{mu: l.mu, recs: l.recs, attrs: append(append([]slog.Attr(nil), l.attrs...), as...)}
}

func (l *eventLog) WithGroup(string) slog.Handler { return l }

// named returns the records of that event so far.
func (l *eventLog) named(name string) []event {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []event
	for _, e := range *l.recs {
		if e.name == name {
			out = append(out, e)
		}
	}
	return out
}

func (l *eventLog) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(*l.recs)
}

// eventually waits for at least n records of the event.
func (l *eventLog) eventually(t *testing.T, name string, n int) []event {
	t.Helper()
	require.Eventually(t, func() bool { return len(l.named(name)) >= n }, 10*time.Second, time.Millisecond,
		"want %d %s records", n, name)
	return l.named(name)
}

// warmPoller makes the runtime open its network poller (which timers use
// too) before a leak baseline, so that a test run alone does not count it.
func warmPoller() {
	if r, w, err := os.Pipe(); err == nil {
		_ = r.Close()
		_ = w.Close()
	}
}

func TestEvents(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	log := newEventLog()
	e := env{t: t, backend: "loopback"}
	const bs, nb = 512, 16
	pname, cname := uniqueName("prod"), uniqueName("cons")
	p1, err := New(Config{AgentName: pname, Backend: "loopback", BlockSize: bs, NumBlocks: nb})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p1.Deregister() })
	cons := e.transport(cname, bs, nb, func(c *Config) {
		c.Logger = slog.New(log)
		c.XferTimeout = time.Second // ordinary READs must not time out on a loaded machine
	})

	start := log.eventually(t, EventReactorStart, 1)
	require.Equal(t, "hybrid", start[0].attrs["idle"].String())
	require.Equal(t, cname, start[0].attrs["agent"].String(), "records carry the agent name")
	require.False(t, start[0].attrs["pinned"].Bool())

	_, err = cons.AddRemotePeer(p1.AgentMetadata(), p1.MemDescriptor())
	require.NoError(t, err)
	added := log.eventually(t, EventPeerAdded, 1)
	require.Equal(t, pname, added[0].attrs["peer"].String())
	require.Equal(t, int64(nb), added[0].attrs["blocks"].Int64())
	_, err = cons.AddRemotePeer(p1.AgentMetadata(), p1.MemDescriptor())
	require.NoError(t, err)

	read := func(wantErr error) {
		t.Helper()
		h, err := cons.PostRead([]int{0}, pname, []int{1}, []byte("n"))
		require.NoError(t, err)
		_, err = wait(t, cons, h)
		if wantErr == nil {
			require.NoError(t, err)
		} else {
			require.ErrorIs(t, err, wantErr)
		}
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	// Ordinary READs log nothing.
	before := log.count()
	for i := 0; i < 200; i++ {
		read(nil)
	}
	require.Equal(t, before, log.count(), "no record per READ")

	// Three READs that time out together: folded into one or two records.
	engine(t, cons).SetDelay(time.Hour)
	var hs []Handle
	for i := 0; i < 3; i++ {
		h, err := cons.PostRead([]int{i}, pname, []int{i}, nil)
		require.NoError(t, err)
		hs = append(hs, h)
	}
	for _, h := range hs {
		_, err := wait(t, cons, h)
		require.ErrorIs(t, err, ErrTimeout)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	engine(t, cons).SetDelay(0)
	// Folded: those after the first record come when its second is up.
	require.Eventually(t, func() bool {
		total := int64(0)
		for _, ev := range log.named(EventReadTimeout) {
			total += ev.attrs["count"].Int64()
		}
		return total == 3
	}, 10*time.Second, 5*time.Millisecond, "every timed-out READ is counted once")
	for _, ev := range log.named(EventReadTimeout) {
		require.Equal(t, pname, ev.attrs["peer"].String())
		require.Equal(t, slog.LevelWarn, ev.level)
	}

	// An engine failure.
	engine(t, cons).FailNext(1, nixl.ErrBackend)
	read(ErrEngine)
	ee := log.eventually(t, EventEngineError, 1)
	require.Equal(t, "xfer", ee[0].attrs["op"].String())
	require.Equal(t, uint64(1), ee[0].attrs["count"].Uint64())

	// A disconnect declares the peer dead, once.
	engine(t, cons).FailNext(2, nixl.ErrRemoteDisconnect)
	read(ErrRemoteDisconnect)
	read(ErrRemoteDisconnect)
	dead := log.eventually(t, EventPeerDead, 1)
	require.Equal(t, pname, dead[0].attrs["peer"].String())
	require.NotEmpty(t, dead[0].attrs["why"].String())
	require.Len(t, log.named(EventPeerDead), 1, "dead is logged once per peer")

	// The producer restarts under the same name.
	require.NoError(t, p1.Deregister())
	p2 := e.transport(pname, bs, nb)
	_, err = cons.AddRemotePeer(p2.AgentMetadata(), p2.MemDescriptor())
	require.NoError(t, err)
	rep := log.eventually(t, EventPeerReplaced, 1)
	require.Equal(t, "restarted", rep[0].attrs["why"].String())
	require.Equal(t, pname, rep[0].attrs["peer"].String())
	read(nil)

	require.NoError(t, cons.RemoveRemotePeer(pname))
	rm := log.eventually(t, EventPeerRemoved, 1)
	require.Equal(t, int64(0), rm[0].attrs["reads_canceled"].Int64())

	require.Empty(t, log.named(EventReactorStop))
	require.NoError(t, cons.Deregister())
	stop := log.eventually(t, EventReactorStop, 1)
	require.Greater(t, stop[0].attrs["loop_turns"].Uint64(), uint64(0))
	require.GreaterOrEqual(t, stop[0].attrs["reads_done"].Uint64(), uint64(201))
	require.Equal(t, slog.KindDuration, stop[0].attrs["cpu_time"].Kind())
	require.Len(t, log.named(EventReactorStart), 1)
	require.Len(t, log.named(EventPeerAdded), 1, "loading the same peer twice is one peer")
}

// A Reactor.Logger set by the caller is kept; Config.Logger does not
// replace it.
func TestReactorLoggerWins(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	outer, inner := newEventLog(), newEventLog()
	e := env{t: t, backend: "loopback"}
	tr := e.transport(uniqueName("x"), 512, 4, func(c *Config) {
		c.Logger = slog.New(outer)
		c.Reactor.Logger = slog.New(inner)
	})
	inner.eventually(t, EventReactorStart, 1)
	require.NoError(t, tr.Deregister())
	inner.eventually(t, EventReactorStop, 1)
	require.Zero(t, outer.count())
}

// Engine errors folded into the one record a second are logged when their
// second is up, even if no error follows, and each is counted in
// Stats().EngineErrors.
func TestEngineErrorsFolded(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	log := newEventLog()
	_, cons, pname := loopbackPair(t, 512, 8, func(c *Config) { c.Logger = slog.New(log) })
	const fails = 4
	before := cons.Stats().EngineErrors
	engine(t, cons).FailNext(fails, nixl.ErrBackend)
	for i := range fails {
		h, err := cons.PostRead([]int{i}, pname, []int{i}, nil)
		require.NoError(t, err)
		_, err = wait(t, cons, h)
		require.ErrorIs(t, err, ErrEngine)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	require.Equal(t, uint64(fails), cons.Stats().EngineErrors-before, "every failed transfer is an engine error")
	recs := log.eventually(t, EventEngineError, 1)
	first := recs[0].attrs["count"].Uint64()
	require.GreaterOrEqual(t, first, uint64(1))
	if first < fails {
		// The rest were folded: their record comes when the second is up.
		recs = log.eventually(t, EventEngineError, 2)
		require.Equal(t, uint64(fails)-first, recs[1].attrs["count"].Uint64())
		require.Equal(t, "xfer", recs[1].attrs["op"].String())
	}
	var total uint64
	for _, r := range log.named(EventEngineError) {
		total += r.attrs["count"].Uint64()
	}
	require.Equal(t, uint64(fails), total)
}

// READs that time out one after another, each in its own loop turn, are
// folded like engine errors: a producer that hangs does not log a record
// per READ, and every timeout is still counted in some record.
func TestTimeoutsFolded(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	log := newEventLog()
	_, cons, pname := loopbackPair(t, 512, 64, func(c *Config) {
		c.Logger = slog.New(log)
		c.XferTimeout = 20 * time.Millisecond
	})
	engine(t, cons).SetDelay(time.Hour)
	const n = 40
	var hs []Handle
	for i := range n {
		h, err := cons.PostRead([]int{i}, pname, []int{i}, nil)
		require.NoError(t, err)
		hs = append(hs, h)
		time.Sleep(2 * time.Millisecond) // a READ per few loop turns
	}
	for _, h := range hs {
		_, err := wait(t, cons, h)
		require.ErrorIs(t, err, ErrTimeout)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	engine(t, cons).SetDelay(0)
	// At most one record per second while they expired (a slow machine
	// may stretch the posts over a second or two).
	require.LessOrEqual(t, len(log.named(EventReadTimeout)), 3, "a record per READ")
	// The pending ones are written when their second is up.
	require.Eventually(t, func() bool {
		var total int64
		for _, ev := range log.named(EventReadTimeout) {
			total += ev.attrs["count"].Int64()
		}
		return total == n
	}, 10*time.Second, 10*time.Millisecond, "every timed-out READ is counted once")
	for _, ev := range log.named(EventReadTimeout) {
		require.Equal(t, pname, ev.attrs["peer"].String())
	}
}
