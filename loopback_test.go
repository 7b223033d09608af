package ecxfer

import (
	"context"
	"errors"
	"math/rand"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
	"github.com/ecxfer/ecxfer/reactor"
)

// Tests that need the loopback engine's fault injection, or that measure
// the reactor alone.

func engine(t *testing.T, tr *Transport) *loopback.Agent {
	t.Helper()
	a, ok := tr.agent.(*loopback.Agent)
	require.True(t, ok)
	return a
}

func loopbackPair(t *testing.T, bs, nb int, consOpts ...func(*Config)) (prod, cons *Transport, pname string) {
	t.Helper()
	leakcheck.Check(t)
	e := env{t: t, backend: "loopback"}
	pname = uniqueName("prod")
	prod = e.transport(pname, bs, nb)
	rand.New(rand.NewSource(1)).Read(prod.Region())
	cons = e.transport(uniqueName("cons"), bs, nb, consOpts...)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	return prod, cons, pname
}

func TestIdleStrategies(t *testing.T) {
	for _, idle := range []reactor.IdleStrategy{reactor.IdleHybrid, reactor.IdleSpin, reactor.IdleYield, reactor.IdlePark} {
		t.Run(idle.String(), func(t *testing.T) {
			prod, cons, pname := loopbackPair(t, 1024, 64, func(c *Config) {
				c.Reactor = reactor.Options{Idle: idle, SpinFor: 20 * time.Microsecond, YieldFor: 100 * time.Microsecond}
			})
			for i := 0; i < 50; i++ {
				if i%10 == 0 {
					time.Sleep(5 * time.Millisecond) // let the reactor go idle
				}
				h, err := cons.PostRead([]int{i}, pname, []int{63 - i}, nil)
				require.NoError(t, err)
				st, err := wait(t, cons, h)
				require.NoError(t, err)
				require.Equal(t, StateDone, st)
				require.Equal(t, block(prod, 1024, 63-i), block(cons, 1024, i))
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			parks := cons.Stats().Parks
			switch idle {
			case reactor.IdleSpin, reactor.IdleYield:
				require.Zero(t, parks, "%s must never sleep", idle)
			default:
				require.NotZero(t, parks, "%s never slept through 5ms idle gaps", idle)
			}
		})
	}
}

func TestParkedProducerDeliversNotifs(t *testing.T) {
	prod, cons, pname := loopbackPair(t, 512, 8)
	time.Sleep(20 * time.Millisecond) // both reactors park
	parks := prod.Stats().Parks
	require.NotZero(t, parks)
	h, err := cons.PostRead([]int{0}, pname, []int{1}, []byte("wake up"))
	require.NoError(t, err)
	_, err = wait(t, cons, h)
	require.NoError(t, err)
	require.NoError(t, cons.ReleaseXferHandle(h))
	got := notifsUntil(prod, 1, 5*time.Second)
	require.Equal(t, [][]byte{[]byte("wake up")}, got[cons.cfg.AgentName])
}

func TestTimeout(t *testing.T) {
	_, cons, pname := loopbackPair(t, 512, 8, func(c *Config) { c.XferTimeout = 30 * time.Millisecond })
	engine(t, cons).SetDelay(time.Hour)
	h, err := cons.PostRead([]int{0}, pname, []int{0}, []byte("never"))
	require.NoError(t, err)
	// In flight, unless this goroutine was off the CPU for the whole 30 ms.
	st, err := cons.CheckXferState(h)
	if st != StateProc {
		require.ErrorIs(t, err, ErrTimeout)
	}
	start := time.Now()
	st, err = wait(t, cons, h)
	require.Equal(t, StateErr, st)
	require.ErrorIs(t, err, ErrTimeout)
	require.Less(t, time.Since(start), 5*time.Second)
	require.NoError(t, cons.ReleaseXferHandle(h))
	engine(t, cons).SetDelay(0)
	h, err = cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	_, err = wait(t, cons, h)
	require.NoError(t, err)
	require.NoError(t, cons.ReleaseXferHandle(h))
	require.Equal(t, uint64(1), cons.Stats().ReadsFailed)
}

// A READ the engine fails is counted failed under its reason, the engine's
// own cancel of a READ nobody released included (not as a cancel: the
// caller asked for nothing), and an engine error unless its peer is gone.
func TestEngineFailures(t *testing.T) {
	cases := []struct {
		status    nixl.Status
		want      error
		reason    string
		engineErr uint64
	}{
		{nixl.ErrBackend, ErrEngine, "engine", 1},
		{nixl.ErrRemoteDisconnect, ErrRemoteDisconnect, "remote_disconnect", 0},
		{nixl.ErrCanceled, ErrCanceled, "canceled", 1},
	}
	for _, c := range cases {
		t.Run(c.status.String(), func(t *testing.T) {
			_, cons, pname := loopbackPair(t, 512, 8)
			engine(t, cons).FailNext(1, c.status)
			h, err := cons.PostRead([]int{0}, pname, []int{0}, []byte("x"))
			require.NoError(t, err)
			st, err := wait(t, cons, h)
			require.Equal(t, StateErr, st)
			require.ErrorIs(t, err, c.want)
			require.NoError(t, cons.ReleaseXferHandle(h))
			s := cons.Stats()
			require.Equal(t, uint64(1), s.ReadsFailed)
			require.Equal(t, uint64(0), s.ReadsCanceled, "the caller canceled nothing")
			i := slices.Index(reactor.FailReasons[:], c.reason)
			require.GreaterOrEqual(t, i, 0)
			require.Equal(t, uint64(1), s.FailedBy[i], "counted under %q", c.reason)
			require.Equal(t, c.engineErr, s.EngineErrors)
			h, err = cons.PostRead([]int{0}, pname, []int{0}, nil)
			require.NoError(t, err)
			_, err = wait(t, cons, h)
			require.NoError(t, err, "the next read is unaffected")
			require.NoError(t, cons.ReleaseXferHandle(h))
		})
	}
}

func TestDisconnectedPeer(t *testing.T) {
	prod, cons, pname := loopbackPair(t, 512, 8)
	engine(t, cons).SetDelay(20 * time.Millisecond)
	h, err := cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	engine(t, prod).Kill()
	st, err := wait(t, cons, h)
	require.Equal(t, StateErr, st)
	require.ErrorIs(t, err, ErrRemoteDisconnect)
	require.NoError(t, cons.ReleaseXferHandle(h))
}

func TestBusyAndRecovery(t *testing.T) {
	_, cons, pname := loopbackPair(t, 256, 16, func(c *Config) {
		c.Reactor = reactor.Options{Handles: 256, SubmitRing: 64}
	})
	// Completions are held back long enough to fill the table.
	engine(t, cons).SetDelay(300 * time.Millisecond)
	var hs []Handle
	var busy error
	for i := 0; i < 10000 && busy == nil; i++ {
		h, err := cons.PostRead([]int{i % 16}, pname, []int{i % 16}, nil)
		if err != nil {
			busy = err
			break
		}
		hs = append(hs, h)
	}
	require.ErrorIs(t, busy, ErrBusy)
	require.GreaterOrEqual(t, len(hs), 64)
	require.LessOrEqual(t, len(hs), 256)
	// Load drops: the held completions arrive, every accepted read
	// finishes, and the transport takes new work.
	engine(t, cons).SetDelay(0)
	for _, h := range hs {
		st, err := wait(t, cons, h)
		require.NoError(t, err)
		require.Equal(t, StateDone, st)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	h, err := cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	_, err = wait(t, cons, h)
	require.NoError(t, err)
	require.NoError(t, cons.ReleaseXferHandle(h))
	// The reactor counts a READ right after it publishes it DONE.
	require.Eventually(t, func() bool {
		st := cons.Stats()
		return st.ReadsPosted == st.ReadsDone
	}, 10*time.Second, time.Millisecond, "posted and done READs differ: %+v", cons.Stats())
}

func TestWaitWhenBusy(t *testing.T) {
	_, cons, pname := loopbackPair(t, 256, 16, func(c *Config) {
		c.Reactor = reactor.Options{Handles: 256, SubmitRing: 16, WaitWhenBusy: true}
	})
	const workers, each = 8, 200 // 1,600 reads through a 16-entry ring
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []Handle
			for i := 0; i < each; i++ {
				h, err := cons.PostRead([]int{i % 16}, pname, []int{(i + 1) % 16}, nil)
				if err != nil {
					errs <- err
					return
				}
				mine = append(mine, h)
				if len(mine) == 16 { // hold handles (8 workers x 16 < 256 slots), then let go
					for _, h := range mine {
						if err := cons.Wait(context.Background(), h); err != nil {
							errs <- err
							return
						}
						if err := cons.ReleaseXferHandle(h); err != nil {
							errs <- err
							return
						}
					}
					mine = mine[:0]
				}
			}
			for _, h := range mine {
				if err := cons.Wait(context.Background(), h); err != nil {
					errs <- err
				}
				_ = cons.ReleaseXferHandle(h)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	// The reactor counts a READ right after it publishes it DONE.
	require.Eventually(t, func() bool { return cons.Stats().ReadsDone == uint64(workers*each) },
		10*time.Second, time.Millisecond, "READs done: %d", cons.Stats().ReadsDone)
}

func TestDeregisterWhilePosting(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "loopback"}
	prod := e.transport(uniqueName("p"), 512, 8)
	cons, err := New(Config{AgentName: uniqueName("c"), Backend: "loopback", BlockSize: 512, NumBlocks: 8})
	require.NoError(t, err)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				h, err := cons.PostRead([]int{0}, pname, []int{1}, nil)
				if errors.Is(err, ErrClosed) {
					return
				}
				if errors.Is(err, ErrBusy) {
					runtime.Gosched()
					continue
				}
				if err != nil {
					t.Errorf("unexpected error %v", err)
					return
				}
				st, err := cons.CheckXferState(h)
				if st == StateErr && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrBadHandle) {
					t.Errorf("unexpected state error %v", err)
				}
				_ = cons.ReleaseXferHandle(h)
			}
		}()
	}
	time.Sleep(20 * time.Millisecond)
	require.NoError(t, cons.Deregister())
	wg.Wait()
}

func TestSteadyStateAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts need a build without -race; make test runs this test in one")
	}
	for _, c := range []struct {
		name, backend string
		opt           func(*Config)
	}{
		{"loopback", "loopback", nil},
		{"ucx-engine", "ucx", enginePath},
		{"ucx-direct", "ucx", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			const bs, nb = 5120, 2048
			e := env{t: t, backend: c.backend}
			if c.opt != nil {
				e.base = []func(*Config){c.opt}
			}
			pname := uniqueName("prod")
			prod := e.transport(pname, bs, nb)
			cons := e.transport(uniqueName("cons"), bs, nb, func(c *Config) {
				c.Reactor = reactor.Options{Idle: reactor.IdleSpin, Handles: 256}
			})
			_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			rng := rand.New(rand.NewSource(5))
			// Four blocks; one to 16 random ones, as the fan-in cells
			// post them (each READ lands on another slot of the table,
			// most of them untouched so far); and an image's 880
			// scattered ones (more indices than a slot keeps).
			for _, c := range []struct {
				name   string
				n      int
				random bool
			}{{"4 blocks", 4, false}, {"1-16 random blocks", 16, true}, {"880 blocks", 880, false}} {
				local, remote := rng.Perm(nb)[:c.n], rng.Perm(nb)[:c.n]
				read := func() {
					l, r := local, remote
					if c.random {
						k := 1 + rng.Intn(c.n)
						l, r = local[:k], remote[:k]
						for i := range r {
							r[i] = rng.Intn(nb)
						}
					}
					h, err := cons.PostRead(l, pname, r, nil)
					if err != nil {
						panic(err)
					}
					for {
						st, err := cons.CheckXferState(h)
						if err != nil {
							panic(err)
						}
						if st == StateDone {
							break
						}
						runtime.Gosched()
					}
					if err := cons.ReleaseXferHandle(h); err != nil {
						panic(err)
					}
				}
				// Warm up the engine's maps and the pooled buffers of
				// large READs; not every slot of the table (4,096).
				for i := 0; i < 50; i++ {
					read()
				}
				// Enough READs that the runtime's own few allocations
				// meanwhile (timers, the scheduler), and the copy
				// workers' rare ones (see TestDirectAllocs), stay far below
				// 0.05 per READ, where one per slot or per READ would not.
				runs := 2000
				per := allocsPerRead(runs, read)
				t.Logf("%s: %.4f allocations per READ over %d READs", c.name, per, runs)
				require.Less(t, per, 0.05, "%s: PostRead -> DONE -> Release allocates %.3f times per READ (whole process, both reactors)", c.name, per)
			}
		})
	}
}

// allocsPerRead is testing.AllocsPerRun without its rounding down to a
// whole number (0.2 allocations per READ is not zero) and without its
// GOMAXPROCS(1), under which the caller and two spinning reactor threads
// take turns on one P.
func allocsPerRead(runs int, f func()) float64 {
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	for range runs {
		f()
	}
	runtime.ReadMemStats(&m1)
	return float64(m1.Mallocs-m0.Mallocs) / float64(runs)
}

// A caller blocked in Wait (or WaitNotifs) is woken through a channel of
// its own, reused: waiting allocates nothing per READ. (It used to: every
// wake-up replaced a shared channel, about two allocations per READ.)
func TestWaitBlockedAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts need a build without -race; make test runs this test in one")
	}
	_, cons, pname := loopbackPair(t, 512, 8, func(c *Config) {
		c.Reactor = reactor.Options{WaitSpin: time.Nanosecond}
	})
	engine(t, cons).SetDelay(100 * time.Microsecond) // longer than the spin: Wait blocks
	read := func() {
		h, err := cons.PostRead([]int{1}, pname, []int{2}, nil)
		if err == nil {
			err = cons.Wait(context.Background(), h)
		}
		if err == nil {
			err = cons.ReleaseXferHandle(h)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	for range 200 { // warm-up: pools, the waiter list
		read()
	}
	const runs = 2000
	blocks0 := cons.Stats().WaitBlocks
	per := allocsPerRead(runs, read)
	blocked := cons.Stats().WaitBlocks - blocks0
	t.Logf("%.4f allocations per READ over %d READs; Wait blocked in %d of them", per, runs, blocked)
	require.Greater(t, blocked, uint64(runs*9/10), "Wait should have blocked")
	require.LessOrEqual(t, per, 0.05)
}

// Wait must wake for transfers that end without an engine completion: here
// RemoveRemotePeer aborts a read the engine would hold for an hour.
func TestWaitWokenByAbort(t *testing.T) {
	_, cons, pname := loopbackPair(t, 512, 8)
	engine(t, cons).SetDelay(time.Hour)
	h, err := cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() { got <- cons.Wait(context.Background(), h) }()
	time.Sleep(20 * time.Millisecond) // Wait is past its spin and blocked
	require.NoError(t, cons.RemoveRemotePeer(pname))
	select {
	case err := <-got:
		require.ErrorIs(t, err, ErrCanceled)
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not wake when the read was aborted")
	}
	require.NoError(t, cons.ReleaseXferHandle(h))
}

// A Wait blocked on a READ that another goroutine releases wakes with
// ErrBadHandle instead of sleeping until its context ends.
func TestWaitWokenByRelease(t *testing.T) {
	_, cons, pname := loopbackPair(t, 512, 8)
	engine(t, cons).SetDelay(time.Hour)
	h, err := cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() { got <- cons.Wait(context.Background(), h) }()
	time.Sleep(20 * time.Millisecond) // Wait is past its spin and blocked
	require.NoError(t, cons.ReleaseXferHandle(h))
	select {
	case err := <-got:
		require.ErrorIs(t, err, ErrBadHandle)
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not wake when its handle was released")
	}
}

// Wait spins for WaitSpin and then blocks; a completion wakes a blocked Wait.
func TestWaitSpinThenBlock(t *testing.T) {
	for _, c := range []struct {
		name       string
		spin       time.Duration
		delay      time.Duration
		wantBlocks bool
	}{
		// Reads finish in microseconds: a Wait that spins up to a minute
		// sees every one of them without blocking.
		{"spin", time.Minute, 0, false},
		// Reads take 100ms: a Wait that spins 1µs blocks for each and is
		// woken by its completion. (At 5ms, a loaded machine sometimes ran
		// the caller only after a READ had ended: a Wait with nothing to
		// wait for.)
		{"block", time.Microsecond, 100 * time.Millisecond, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, cons, pname := loopbackPair(t, 512, 8, func(cfg *Config) {
				cfg.Reactor.WaitSpin = c.spin
			})
			engine(t, cons).SetDelay(c.delay)
			const reads = 5
			for i := 0; i < reads; i++ {
				h, err := cons.PostRead([]int{i}, pname, []int{i}, nil)
				require.NoError(t, err)
				require.NoError(t, cons.Wait(context.Background(), h))
				st, err := cons.CheckXferState(h)
				require.NoError(t, err)
				require.Equal(t, StateDone, st)
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			blocks := cons.Stats().WaitBlocks
			if c.wantBlocks {
				require.Equal(t, uint64(reads), blocks)
			} else {
				require.Zero(t, blocks)
			}
		})
	}
}

// A producer can block for its notifications instead of polling NewNotifs.
func TestWaitNotifs(t *testing.T) {
	prod, cons, pname := loopbackPair(t, 512, 8)
	got := make(chan map[string][][]byte, 1)
	errs := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m, err := prod.WaitNotifs(ctx)
		got <- m
		errs <- err
	}()
	time.Sleep(20 * time.Millisecond) // the waiter is blocked
	h, err := cons.PostRead([]int{0}, pname, []int{1}, []byte("ready"))
	require.NoError(t, err)
	_, err = wait(t, cons, h)
	require.NoError(t, err)
	require.NoError(t, cons.ReleaseXferHandle(h))
	require.NoError(t, <-errs)
	require.Equal(t, map[string][][]byte{cons.cfg.AgentName: {[]byte("ready")}}, <-got)

	// Nothing more arrives: the context ends it, with an empty map.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	m, err := prod.WaitNotifs(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotNil(t, m)
	require.Empty(t, m)
}

func TestWaitNotifsClosed(t *testing.T) {
	leakcheck.Check(t)
	tr, err := New(Config{AgentName: uniqueName("w"), Backend: "loopback", BlockSize: 64, NumBlocks: 1})
	require.NoError(t, err)
	errs := make(chan error, 1)
	go func() {
		_, err := tr.WaitNotifs(context.Background())
		errs <- err
	}()
	time.Sleep(10 * time.Millisecond)
	require.NoError(t, tr.Deregister())
	select {
	case err := <-errs:
		require.ErrorIs(t, err, ErrClosed)
	case <-time.After(10 * time.Second):
		t.Fatal("WaitNotifs did not return after Deregister")
	}
}

// After Deregister, PeerStats still reports the peers the transport had,
// with their final counters, as Stats does (it used to return none).
func TestPeerStatsAfterDeregister(t *testing.T) {
	_, cons, pname := loopbackPair(t, 1024, 8)
	h, err := cons.PostRead([]int{0}, pname, []int{1}, []byte("n"))
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
	// The reactor counts a READ right after publishing it DONE.
	var before []PeerStat
	require.Eventually(t, func() bool {
		before = cons.PeerStats(before[:0])
		return len(before) == 1 && before[0].BytesRead == 1024
	}, 10*time.Second, time.Millisecond)
	require.NoError(t, cons.Deregister())
	after := cons.PeerStats(nil)
	require.Equal(t, before, after)
	require.Equal(t, uint64(1), after[0].ReadsDone)
	require.Equal(t, uint64(1024), after[0].BytesRead)
}

// A Deregister called while another is tearing down returns only once the
// first has finished everything, the copy workers and the region included
// (it used to return when the reactor thread had exited, and a caller could
// unmap its region under the copy workers).
func TestSecondDeregisterWaitsForTheFirst(t *testing.T) {
	leakcheck.Check(t)
	for range 50 {
		tr, err := New(Config{AgentName: uniqueName("dd"), Backend: "loopback", BlockSize: 4096, NumBlocks: 4,
			Direct: DirectOn, CopyWorkers: 8})
		require.NoError(t, err)
		first := make(chan struct{})
		go func() {
			defer close(first)
			require.NoError(t, tr.Deregister())
			require.Nil(t, tr.Region())
		}()
		for !tr.closed.Load() {
			runtime.Gosched()
		}
		require.NoError(t, tr.Deregister())
		require.Nil(t, tr.Region(), "the second Deregister returned before the first had finished")
		<-first
	}
}
