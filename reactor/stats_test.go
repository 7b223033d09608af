package reactor

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// droppingAgent is a loopback agent that also claims, through
// nixl.NotifDropper, to have dropped as many notifications as its counter
// says: the reactor must carry that count into Stats.
type droppingAgent struct {
	*loopback.Agent
	dropped atomic.Uint64
}

func (a *droppingAgent) DroppedNotifs() uint64 { return a.dropped.Load() }

func noSetup(nixl.Agent) (descriptors.List, nixl.DlistID, error) { return nil, 0, nil }

func TestStatsNotifsDroppedByEngine(t *testing.T) {
	leakcheck.Check(t)
	la, err := loopback.New("stats-drop")
	require.NoError(t, err)
	a := &droppingAgent{Agent: la}
	r, err := Start(a, Options{}, noSetup)
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()

	require.Zero(t, r.Stats().NotifsDroppedByEngine)
	a.dropped.Store(7)
	deadline := time.Now().Add(5 * time.Second)
	for r.Stats().NotifsDroppedByEngine != 7 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	require.Equal(t, uint64(7), r.Stats().NotifsDroppedByEngine)
}

// undeliveringAgent is a loopback agent that claims, through
// nixl.NotifUndeliverer, to have dropped notifications unsent.
type undeliveringAgent struct {
	*loopback.Agent
	undelivered atomic.Uint64
}

func (a *undeliveringAgent) UndeliveredNotifs() uint64 { return a.undelivered.Load() }

// The engine's undelivered notifications reach Stats while the reactor
// runs, and those it counts as it closes, after.
func TestStatsNotifsUndeliveredByEngine(t *testing.T) {
	leakcheck.Check(t)
	la, err := loopback.New("stats-undelivered")
	require.NoError(t, err)
	a := &undeliveringAgent{Agent: la}
	r, err := Start(a, Options{}, noSetup)
	require.NoError(t, err)
	require.Zero(t, r.Stats().NotifsUndelivered)
	a.undelivered.Store(3)
	deadline := time.Now().Add(5 * time.Second)
	for r.Stats().NotifsUndelivered != 3 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	require.Equal(t, uint64(3), r.Stats().NotifsUndelivered)
	a.undelivered.Store(5) // as if Close had dropped two more
	require.NoError(t, r.Close())
	require.Equal(t, uint64(5), r.Stats().NotifsUndelivered)
}

// An engine that cannot count drops leaves the counter at 0.
func TestStatsNotifsDroppedNoDropper(t *testing.T) {
	leakcheck.Check(t)
	la, err := loopback.New("stats-nodrop")
	require.NoError(t, err)
	r, err := Start(la, Options{}, noSetup)
	require.NoError(t, err)
	require.Nil(t, r.dropper)
	require.Zero(t, r.Stats().NotifsDroppedByEngine)
	require.NoError(t, r.Close())
}

// READs still queued for the loop when their peer is removed are dropped
// with it: they end in ErrCanceled and count as canceled, as the peer's
// READs in flight do, not as failed.
func TestQueuedReadsDroppedWithPeerCountAsCanceled(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	started, posted := make(chan struct{}), make(chan struct{})
	removed := make(chan error, 1)
	go func() {
		// RemovePeer's work, run while the READs wait on the ring.
		removed <- r.do(func() error {
			close(started)
			<-posted
			r.dropPeer(r.peer(p.pname), codeCanceled)
			return nil
		})
	}()
	<-started
	const n = 8
	hs := make([]uint64, n)
	for i := range hs {
		var err error
		hs[i], err = r.Post(p.pname, []int{i}, []int{i}, []byte("n"))
		require.NoError(t, err)
	}
	close(posted)
	require.NoError(t, <-removed)
	for _, h := range hs {
		require.ErrorIs(t, waitEnd(t, r, h), ErrCanceled)
		require.NoError(t, r.Release(h))
	}
	st := r.Stats()
	require.Equal(t, uint64(n), st.ReadsCanceled)
	require.Equal(t, uint64(0), st.ReadsFailed)
	require.Equal(t, uint64(0), st.FailedBy[codeCanceled])
}

// The reactor thread's CPU time (ecxfer_reactor_cpu_seconds_total, a
// counter) never goes down when the loop stops: the figure stored at the
// stop is read the way the live ones are, not cut to microseconds.
func TestThreadCPUMonotonicAtStop(t *testing.T) {
	leakcheck.Check(t)
	for i := range 5 {
		la, err := loopback.New("stats-cpu")
		require.NoError(t, err)
		r, err := Start(la, Options{Idle: IdleSpin}, noSetup)
		require.NoError(t, err)
		time.Sleep(20 * time.Millisecond)
		var last time.Duration
		for range 50 {
			last, err = r.ThreadCPU()
			require.NoError(t, err)
		}
		require.Positive(t, last)
		require.NoError(t, r.Close())
		final, err := r.ThreadCPU()
		require.NoError(t, err)
		require.GreaterOrEqual(t, final, last, "round %d: the counter went down at the stop", i)
	}
}

// A READ released before the loop took its submission was never posted:
// it counts as canceled, as the same READ dropped with its peer does, so
// posted READs all end in exactly one of done, failed and canceled.
func TestReleasedQueuedReadCountsCanceled(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	var h uint64
	// Posted and released inside a control operation: both entries wait
	// on their rings while the loop is busy here.
	require.NoError(t, r.do(func() error {
		var err error
		if h, err = r.Post(p.pname, []int{0}, []int{0}, nil); err != nil {
			return err
		}
		return r.Release(h)
	}))
	require.Eventually(t, func() bool { return r.tab.live.Load() == 0 }, 5*time.Second, time.Millisecond)
	st := r.Stats()
	require.Equal(t, uint64(1), st.ReadsCanceled, "released while queued")
	require.Zero(t, st.ReadsFailed)
	require.Zero(t, st.ReadsDone)

	// Posted, then released after the loop took it to the engine.
	p.consEng.SetDelay(time.Hour)
	h, err := r.Post(p.pname, []int{0}, []int{0}, nil)
	require.NoError(t, err)
	inFlight(t, r, 1)
	require.NoError(t, r.Release(h))
	require.Eventually(t, func() bool { return r.Stats().ReadsCanceled == 2 }, 5*time.Second, time.Millisecond)
	p.consEng.SetDelay(0)
	require.Zero(t, r.Stats().ReadsFailed)
}

// A READ the caller released in flight whose release the loop has not
// seen yet when its peer is replaced counts as canceled, not as failed
// with the peer: the caller stopped it, and it is never published ERR.
func TestReleasedThenReplacedCountsCanceled(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	p.consEng.SetDelay(time.Hour)
	h, err := r.Post(p.pname, []int{0}, []int{0}, nil)
	require.NoError(t, err)
	inFlight(t, r, 1)
	md := loopbackMD(t, p.prod, p.prodEng)
	descs := p.prod.loc.Load().descs[:8] // a new block list replaces the peer
	require.NoError(t, r.do(func() error {
		if err := r.Release(h); err != nil {
			return err
		}
		_, err := r.addPeer(md, descs, nil)
		return err
	}))
	require.Eventually(t, func() bool { return r.tab.live.Load() == 0 }, 5*time.Second, time.Millisecond)
	p.consEng.SetDelay(0)
	st := r.Stats()
	require.Zero(t, st.ReadsFailed, "counted failed by reason %v", st.FailedBy)
	require.Equal(t, uint64(1), st.ReadsCanceled)
}

// A peer replaced under its name (a new block list, or restarted) keeps
// its name's counters, exported as Prometheus counters: they must not go
// back to 0 (they did: each Peer had counters of its own). The replaced
// peer's READs that end after the swap count there too, and the new peer
// is not dead for the old one's sake. Removed and added again, the name
// starts from 0 (a new series).
func TestPeerCountersKeptWhenReplaced(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	for i := range 3 {
		h, err := r.Post(p.pname, []int{i}, []int{i}, nil)
		require.NoError(t, err)
		require.NoError(t, r.Wait(context.Background(), h))
		require.NoError(t, r.Release(h))
	}
	stat := func() PeerStat {
		ps := r.PeerStats(nil)
		require.Len(t, ps, 1)
		return ps[0]
	}
	require.Eventually(t, func() bool { return stat().ReadsDone == 3 }, 5*time.Second, time.Millisecond)
	before := stat()
	// One READ in flight when the peer is replaced: it fails with the
	// old peer, after which the new one serves.
	p.consEng.SetDelay(time.Hour)
	h, err := r.Post(p.pname, []int{5}, []int{5}, nil)
	require.NoError(t, err)
	inFlight(t, r, 1)
	md := loopbackMD(t, p.prod, p.prodEng)
	descs := p.prod.loc.Load().descs[:8]
	require.NoError(t, r.do(func() error {
		_, err := r.addPeer(md, descs, nil)
		return err
	}))
	require.ErrorIs(t, r.Wait(context.Background(), h), ErrRemoteDisconnect)
	require.NoError(t, r.Release(h))
	p.consEng.SetDelay(0)
	h, err = r.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	require.NoError(t, r.Wait(context.Background(), h))
	require.NoError(t, r.Release(h))
	require.Eventually(t, func() bool { return stat().ReadsDone == 4 }, 5*time.Second, time.Millisecond)
	after := stat()
	require.Equal(t, before.ReadsFailed+1, after.ReadsFailed, "the replaced peer's READ counts under its name")
	require.Equal(t, before.BytesRead+before.BytesRead/3, after.BytesRead)
	require.Equal(t, "up", after.State)

	require.NoError(t, r.RemovePeer(p.pname))
	require.Empty(t, r.PeerStats(nil))
	require.NoError(t, r.do(func() error {
		_, err := r.addPeer(md, descs, nil)
		return err
	}))
	require.Equal(t, PeerStat{Name: p.pname, Path: "engine", State: "up"}, stat())
}

// Snapshots taken while READs are posted and end on other goroutines are
// consistent: never more READs ended than posted (the loop may end a READ
// before its Post has counted it), never more latencies than READs done.
func TestStatsConsistentUnderLoad(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 64, Options{})
	r := p.cons
	var stop atomic.Bool
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				h, err := r.Post(p.pname, []int{g}, []int{g}, nil)
				if err != nil {
					continue
				}
				_ = r.Wait(context.Background(), h)
				_ = r.Release(h)
			}
		}()
	}
	var n, badPosted, badLatency int
	var first Stats
	var prev uint64
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); n++ {
		s := r.Stats()
		if s.ReadsDone+s.ReadsFailed+s.ReadsCanceled > s.ReadsPosted {
			if badPosted == 0 {
				first = s
			}
			badPosted++
		}
		if s.Latency.Count() > s.ReadsDone {
			badLatency++
		}
		require.GreaterOrEqual(t, s.ReadsPosted, prev, "ReadsPosted went down")
		prev = s.ReadsPosted
	}
	stop.Store(true)
	wg.Wait()
	require.Greater(t, prev, uint64(100), "too few READs to tell")
	require.Zero(t, badPosted, "%d of %d snapshots with more READs ended than posted; first: posted %d, done %d",
		badPosted, n, first.ReadsPosted, first.ReadsDone)
	require.Zero(t, badLatency, "%d of %d snapshots with more latencies than READs done", badLatency, n)
}

// slowStop is a logging handler that takes its time over the reactor's
// stop event, as a slow sink would.
type slowStop struct{ slog.Handler }

func (h slowStop) Handle(ctx context.Context, rec slog.Record) error {
	if rec.Message == EventReactorStop {
		for t0 := time.Now(); time.Since(t0) < 200*time.Millisecond; {
		}
	}
	return nil
}
func (h slowStop) Enabled(context.Context, slog.Level) bool { return true }
func (h slowStop) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h slowStop) WithGroup(string) slog.Handler            { return h }

// ThreadCPU, exported as a counter, never goes down, also across the
// reactor's exit: the thread runs the logger after it has stopped.
func TestThreadCPUNeverGoesDown(t *testing.T) {
	leakcheck.Check(t)
	r, _ := startLoopback(t, "cpu", 4, Options{Logger: slog.New(slowStop{})})
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	time.Sleep(100 * time.Millisecond) // inside the stop event's handler
	during, err := r.ThreadCPU()
	require.NoError(t, err)
	require.NoError(t, <-closed)
	after, err := r.ThreadCPU()
	require.NoError(t, err)
	require.GreaterOrEqual(t, after, during, "the reactor's CPU time went down after it stopped")
}

// After Close, Stats reports the peers the reactor had, as PeerStats does,
// not an empty table.
func TestStatsPeersAfterClose(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 8, Options{})
	require.Equal(t, 1, p.cons.Stats().Peers)
	require.NoError(t, p.cons.Close())
	require.Equal(t, 1, p.cons.Stats().Peers, "peers after Close")
	require.Len(t, p.cons.PeerStats(nil), 1)
}

// FuzzSchedstat: the schedstat reader takes any text without panicking
// and returns a time only for a leading count of nanoseconds.
func FuzzSchedstat(f *testing.F) {
	if b, err := os.ReadFile("/proc/thread-self/schedstat"); err == nil {
		f.Add(b)
	}
	f.Add([]byte("123 456 7\n"))
	f.Add([]byte("-5 0 0"))
	f.Add([]byte(""))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := parseSchedstat(b)
		if err != nil {
			return
		}
		if d < 0 {
			t.Fatalf("negative time %v", d)
		}
		fs := strings.Fields(string(b))
		if len(fs) == 0 {
			t.Fatalf("%v from blank text", d)
		}
		if n, err := strconv.ParseInt(fs[0], 10, 64); err != nil || time.Duration(n) != d {
			t.Fatalf("%v from %q", d, b)
		}
	})
}

// A producer restarted under its name (new metadata) keeps its counters
// on engines that cannot load it beside the old one (here loopback; the
// nixl engine is another): the old peer is dropped before the new one is
// loaded, and the new one used to start from zero, with the READ the
// restart failed counted on counters nobody showed any more.
func TestPeerCountersKeptWhenRestarted(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	for i := range 3 {
		h, err := r.Post(p.pname, []int{i}, []int{i}, nil)
		require.NoError(t, err)
		require.NoError(t, r.Wait(context.Background(), h))
		require.NoError(t, r.Release(h))
	}
	stat := func() PeerStat {
		ps := r.PeerStats(nil)
		require.Len(t, ps, 1)
		return ps[0]
	}
	require.Eventually(t, func() bool { return stat().ReadsDone == 3 }, 5*time.Second, time.Millisecond)
	before := stat()
	p.consEng.SetDelay(time.Hour)
	h, err := r.Post(p.pname, []int{5}, []int{5}, nil)
	require.NoError(t, err)
	inFlight(t, r, 1)

	require.NoError(t, p.prod.Close())
	a2, err := loopback.New(p.pname)
	require.NoError(t, err)
	prod2, err := Start(a2, Options{}, blockSetup(64, 16))
	if err != nil {
		_ = a2.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = prod2.Close() })
	md := loopbackMD(t, prod2, a2)
	name, err := r.AddPeer(md, prod2.loc.Load().descs)
	require.NoError(t, err)
	require.Equal(t, p.pname, name)
	require.ErrorIs(t, r.Wait(context.Background(), h), ErrRemoteDisconnect)
	require.NoError(t, r.Release(h))
	p.consEng.SetDelay(0)
	h, err = r.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	require.NoError(t, r.Wait(context.Background(), h))
	require.NoError(t, r.Release(h))
	require.Eventually(t, func() bool { return stat().ReadsDone == 4 }, 5*time.Second, time.Millisecond,
		"the restarted peer's counters: %+v", stat())
	after := stat()
	require.Equal(t, before.ReadsFailed+1, after.ReadsFailed, "the READ the restart failed counts under its name")
	require.Equal(t, before.BytesRead+before.BytesRead/3, after.BytesRead)
}

// namingAgent is a loopback agent whose engine hands over, once, the
// notifications in extra under the sender names it gives: what a peer
// that claims any name it likes makes an engine report.
type namingAgent struct {
	*loopback.Agent
	mu    sync.Mutex
	extra map[string][][]byte
}

func (a *namingAgent) GetNotifs(dst map[string][][]byte) int {
	n := a.Agent.GetNotifs(dst)
	a.mu.Lock()
	defer a.mu.Unlock()
	for k, v := range a.extra {
		dst[k] = append(dst[k], v...)
		n += len(v)
	}
	a.extra = nil
	return n
}

// Notifications whose sender the engine names with a name no agent can
// have are dropped on receipt and counted; those of a valid sender in
// the same batch are handed out.
func TestNotifsFromBadSenderNamesDropped(t *testing.T) {
	leakcheck.Check(t)
	la, err := loopback.New("stats-badname")
	require.NoError(t, err)
	a := &namingAgent{Agent: la, extra: map[string][][]byte{
		"":                       {[]byte("a")},
		"has space":              {[]byte("b"), []byte("c")},
		"nul\x00":                {[]byte("d")},
		"caf\xc3\xa9":            {[]byte("e")},
		strings.Repeat("x", 257): {[]byte("f")},
		"prefill-0":              {[]byte("sess:hash")},
	}}
	r, err := Start(a, Options{}, noSetup)
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := r.WaitNotifs(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string][][]byte{"prefill-0": {[]byte("sess:hash")}}, got)
	s := r.Stats()
	require.Equal(t, uint64(6), s.NotifsBadSender)
	require.Equal(t, uint64(1), s.NotifsReceived)
}

// Received notifications nobody takes are held up to MaxHeldNotifBytes of
// messages; the newest beyond it are dropped and counted (NotifsUntaken),
// and once they are taken new ones are held again. They used to pile up
// without bound (62 MiB after 1,000 READs with 64 KiB notifications, a
// review measured). Over the engine and over the direct path's socket.
func TestUntakenNotifsBounded(t *testing.T) {
	leakcheck.Check(t)
	saved := MaxHeldNotifBytes
	MaxHeldNotifBytes = 1000
	t.Cleanup(func() { MaxHeldNotifBytes = saved })
	msg := func(i int) []byte { return []byte(fmt.Sprintf("%-100d", i)) }
	count := func(m map[string][][]byte) (n int) {
		for _, v := range m {
			n += len(v)
		}
		return n
	}

	t.Run("engine", func(t *testing.T) {
		p := newPair(t, 16, Options{})
		post := func(from, to int) {
			for i := from; i < to; i++ {
				h, err := p.cons.Post(p.pname, []int{i % 16}, []int{i % 16}, msg(i))
				require.NoError(t, err)
				st, err := pollDone(t, p.cons, h)
				require.NoError(t, err)
				require.Equal(t, StateDone, st)
				require.NoError(t, p.cons.Release(h))
			}
		}
		post(0, 20)
		require.Eventually(t, func() bool {
			s := p.prod.Stats()
			return s.NotifsReceived+s.NotifsUntaken == 20
		}, 5*time.Second, time.Millisecond)
		s := p.prod.Stats()
		require.Equal(t, uint64(10), s.NotifsReceived, "1000 bytes of 100-byte messages held")
		require.Equal(t, uint64(10), s.NotifsUntaken)
		got := p.prod.Notifs()
		require.Equal(t, 10, count(got))
		require.Equal(t, msg(0), got[p.cons.agent.Name()][0], "the oldest are kept")
		post(20, 25)
		require.Eventually(t, func() bool { return p.prod.Stats().NotifsReceived == 15 }, 5*time.Second, time.Millisecond)
		require.Equal(t, 5, count(p.prod.Notifs()))
	})

	t.Run("socket", func(t *testing.T) {
		ns, err := ListenNotify(-1, 0)
		require.NoError(t, err)
		key, token := ns.Key, ns.Token
		r := directPair(t, DirectOptions{Notify: ns, Name: "cons"}).cons
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		defer unix.Close(fd)
		to := &unix.SockaddrUnix{Name: shmview.NotifyAddr(uint32(unix.Getpid()), token)}
		for i := range 20 {
			b := appendNotifDgram(nil, &key, "someone", msg(i))
			// The kernel queues 10 datagrams: the reactor reads them
			// into what it holds meanwhile.
			deadline := time.Now().Add(5 * time.Second)
			for {
				err := unix.Sendto(fd, b, unix.MSG_DONTWAIT, to)
				if err != unix.EAGAIN || time.Now().After(deadline) {
					require.NoError(t, err)
					break
				}
				time.Sleep(time.Millisecond)
			}
		}
		require.Eventually(t, func() bool {
			r.drainNotifSocket()
			s := r.Stats()
			return s.NotifsReceived+s.NotifsUntaken == 20
		}, 5*time.Second, time.Millisecond)
		s := r.Stats()
		require.Equal(t, uint64(10), s.NotifsReceived)
		require.Equal(t, uint64(10), s.NotifsUntaken)
		require.Equal(t, 10, count(r.Notifs()))
	})
}
