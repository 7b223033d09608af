package reactor

import (
	"context"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/testhook"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// releasingHandler, the first time it sees EventEngineError, records
// whether it runs on the reactor thread and releases READ h, as a handler
// reacting to an error might.
type releasingHandler struct {
	r       atomic.Pointer[Reactor]
	h       atomic.Uint64
	fired   atomic.Bool
	onLoop  atomic.Bool
	entered chan struct{}
	done    chan error
}

func (x *releasingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (x *releasingHandler) WithAttrs([]slog.Attr) slog.Handler       { return x }
func (x *releasingHandler) WithGroup(string) slog.Handler            { return x }
func (x *releasingHandler) Handle(_ context.Context, rec slog.Record) error {
	if rec.Message != EventEngineError || x.fired.Swap(true) {
		return nil
	}
	r := x.r.Load()
	x.onLoop.Store(r.onLoop())
	close(x.entered)
	x.done <- r.Release(x.h.Load())
	return nil
}

// An engine error taken in by a caller stepping in for the reactor (it
// holds the engine token) is logged on the reactor thread, as
// Options.Logger promises, so a handler that calls Release returns. The
// record used to be written on the caller's goroutine, token held:
// Release waited for the loop, the loop for the token, and the reactor
// was wedged for good (Close included).
func TestEventHandlerMayRelease(t *testing.T) {
	leakcheck.Check(t)
	old := runtime.GOMAXPROCS(4) // two READs in flight may be stepped for (helpMax)
	defer runtime.GOMAXPROCS(old)
	x := &releasingHandler{entered: make(chan struct{}), done: make(chan error, 1)}
	prod, prodEng := startLoopback(t, "prod", 16, Options{})
	la, err := loopback.New(uniqueName("cons"))
	require.NoError(t, err)
	r, err := Start(la, Options{Logger: slog.New(x)}, blockSetup(64, 16))
	if err != nil {
		_ = la.Close()
		t.Fatal(err)
	}
	x.r.Store(r)
	md := loopbackMD(t, prod, prodEng)
	pname, err := r.AddPeer(md, prod.loc.Load().descs)
	require.NoError(t, err)

	la.SetDelay(time.Hour)
	h2, err := r.Post(pname, []int{0}, []int{0}, nil) // stays in flight
	require.NoError(t, err)
	x.h.Store(h2)
	require.Eventually(t, func() bool { return r.inflight.Load() == 1 }, 5*time.Second, 100*time.Microsecond)
	la.SetDelay(50 * time.Millisecond)
	la.FailNext(1, nixl.ErrBackend)
	h1, err := r.Post(pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	// Poll h1 as a caller does: it steps in while the thread naps, and
	// the injected failure is most often taken in by its step.
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		for !x.fired.Load() {
			if st, _ := r.State(h1); st != StateProc {
				return
			}
			runtime.Gosched()
		}
	}()
	select {
	case <-x.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the engine error was never logged")
	}
	require.True(t, x.onLoop.Load(), "a record was written off the reactor thread")
	select {
	case err := <-x.done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Release in the handler never returned: the reactor is wedged")
	}
	<-polled
	st, err := r.State(h1)
	require.Equal(t, StateErr, st)
	require.ErrorIs(t, err, ErrEngine)
	require.NoError(t, r.Release(h1))
	require.NoError(t, r.Close())
}

// callingHandler runs, once for each event named in calls, that event's
// calls from the handler of its first record, and sends what they returned.
type callingHandler struct {
	calls map[string]func() []error
	fired sync.Map
	got   chan []error
}

func (x *callingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (x *callingHandler) WithAttrs([]slog.Attr) slog.Handler       { return x }
func (x *callingHandler) WithGroup(string) slog.Handler            { return x }
func (x *callingHandler) Handle(_ context.Context, rec slog.Record) error {
	if fn := x.calls[rec.Message]; fn != nil {
		if _, done := x.fired.LoadOrStore(rec.Message, true); !done {
			x.got <- fn()
		}
	}
	return nil
}

// From a handler (the reactor's own thread), the calls that would wait for
// that thread return ErrReactorThread at once instead of waiting for
// themselves: RemovePeer and AddPeer (control operations), WaitNotifs with
// nothing there, Close, and Wait of a READ in flight. The reactor goes
// on, and Close from another goroutine works. They used to hang the
// reactor for good.
func TestHandlerCallsThatWouldWaitForTheThread(t *testing.T) {
	leakcheck.Check(t)
	prod, prodEng := startLoopback(t, "prod", 16, Options{})
	md := loopbackMD(t, prod, prodEng)
	descs := prod.loc.Load().descs
	var r *Reactor
	var inFlight atomic.Uint64
	x := &callingHandler{got: make(chan []error, 2)}
	x.calls = map[string]func() []error{
		EventPeerAdded: func() []error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, addErr := r.AddPeer(md, descs)
			_, notifErr := r.WaitNotifs(ctx)
			return []error{r.RemovePeer("anyone"), addErr, notifErr, r.Close()}
		},
		EventEngineError: func() []error {
			return []error{r.Wait(context.Background(), inFlight.Load())}
		},
	}
	la, err := loopback.New(uniqueName("cons"))
	require.NoError(t, err)
	r, err = Start(la, Options{Logger: slog.New(x)}, blockSetup(64, 16))
	if err != nil {
		_ = la.Close()
		t.Fatal(err)
	}
	pname, err := r.AddPeer(md, descs)
	require.NoError(t, err)
	expect := func(n int) {
		t.Helper()
		select {
		case errs := <-x.got:
			require.Len(t, errs, n)
			for i, err := range errs {
				require.ErrorIs(t, err, ErrReactorThread, "call %d", i)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the handler's calls never returned: the reactor waits for itself")
		}
	}
	expect(4)

	la.SetDelay(time.Hour)
	h, err := r.Post(pname, []int{0}, []int{0}, nil)
	require.NoError(t, err)
	inFlight.Store(h)
	require.Eventually(t, func() bool { return r.inflight.Load() == 1 }, 5*time.Second, 100*time.Microsecond)
	la.SetDelay(50 * time.Millisecond)
	la.FailNext(1, nixl.ErrBackend)
	h2, err := r.Post(pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	expect(1)
	require.NoError(t, r.Release(h))
	require.NoError(t, r.Release(h2))
	require.NoError(t, r.Close())
}

// namesHandler records the messages of the records it gets.
type namesHandler struct {
	mu    sync.Mutex
	names []string
}

func (x *namesHandler) Enabled(context.Context, slog.Level) bool { return true }
func (x *namesHandler) WithAttrs([]slog.Attr) slog.Handler       { return x }
func (x *namesHandler) WithGroup(string) slog.Handler            { return x }
func (x *namesHandler) Handle(_ context.Context, rec slog.Record) error {
	x.mu.Lock()
	x.names = append(x.names, rec.Message)
	x.mu.Unlock()
	return nil
}

// A record noticed off the reactor thread, handed over just as the thread
// stops (after its last flush of handed-over records): its caller writes
// it. It used to be appended to a list nobody would read again.
func TestRecordHandedOverAsTheThreadStops(t *testing.T) {
	leakcheck.Check(t)
	x := &namesHandler{}
	la, err := loopback.New(uniqueName("late"))
	require.NoError(t, err)
	r, err := Start(la, Options{Logger: slog.New(x)}, noSetup)
	require.NoError(t, err)
	stop := func() { require.NoError(t, r.Close()) } // the thread stops here
	testhook.BeforeDefer.Store(&stop)
	defer testhook.BeforeDefer.Store(nil)
	r.logEvent(slog.LevelWarn, "test.late")
	require.True(t, r.loopEnded())
	x.mu.Lock()
	defer x.mu.Unlock()
	require.Contains(t, x.names, "test.late")
}

// An event handler's Post, with Close begun by another goroutine after the
// Post had checked its request: the READ is queued and the Post returns
// its handle; the READ ends in the loop's turn (the engine takes it) or in
// Close's teardown, which runs on the reactor thread once the handler has
// returned. The Post used to wait for the loop
// to end, on the loop's own thread: the reactor, and Close, hung for good.
func TestHandlerPostDuringClose(t *testing.T) {
	leakcheck.Check(t)
	prod, prodEng := startLoopback(t, "prod", 16, Options{})
	md := loopbackMD(t, prod, prodEng)
	descs := prod.loc.Load().descs
	var r *Reactor
	closed := make(chan error, 1)
	var posted atomic.Uint64
	x := &callingHandler{got: make(chan []error, 1)}
	x.calls = map[string]func() []error{
		EventPeerAdded: func() []error {
			closing := func() {
				go func() { closed <- r.Close() }()
				for !r.closing.Load() {
					runtime.Gosched()
				}
			}
			testhook.PostChecked.Store(&closing)
			defer testhook.PostChecked.Store(nil)
			h, err := r.Post(prodEng.Name(), []int{0}, []int{0}, []byte("n"))
			posted.Store(h)
			return []error{err}
		},
	}
	la, err := loopback.New(uniqueName("cons"))
	require.NoError(t, err)
	r, err = Start(la, Options{Logger: slog.New(x)}, blockSetup(64, 16))
	if err != nil {
		_ = la.Close()
		t.Fatal(err)
	}
	added := make(chan error, 1)
	go func() {
		_, err := r.AddPeer(md, descs)
		added <- err
	}()
	select {
	case errs := <-x.got:
		require.NoError(t, errs[0], "the READ was queued before Close's teardown began")
	case <-time.After(10 * time.Second):
		t.Fatal("the handler's Post never returned: it waits for the reactor thread it runs on")
	}
	for _, ch := range []chan error{added, closed} {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatal("AddPeer or Close never returned")
		}
	}
	require.NotZero(t, posted.Load())
	_, err = r.State(posted.Load())
	require.ErrorIs(t, err, ErrClosed)
	st := r.Stats()
	require.Equal(t, uint64(1), st.ReadsPosted)
	// Ended once: by the engine in the turn that took it, or by teardown.
	require.Equal(t, uint64(1), st.ReadsDone+st.ReadsFailed+st.ReadsCanceled)
}
