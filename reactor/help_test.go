package reactor

import (
	"context"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/shmview"
)

// pollDone polls h with State until it leaves PROC, yielding between
// checks as a polling caller does, and returns its end.
func pollDone(t *testing.T, r *Reactor, h uint64) (State, error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := r.State(h)
		if st != StateProc {
			return st, err
		}
		if time.Now().After(deadline) {
			t.Fatalf("READ %x still in flight after 10s", h)
		}
		runtime.Gosched()
	}
}

// A caller polling an engine READ takes steps of the engine's work, and
// the reactor thread naps meanwhile; with ReactorOnly neither happens.
// Either way the READ lands and its notification reaches the producer.
func TestCallersStepIn(t *testing.T) {
	leakcheck.Check(t)
	for _, only := range []bool{false, true} {
		p := newPair(t, 16, Options{ReactorOnly: only})
		// Long enough for the reactor thread to find idle turns while the
		// caller polls, however slowly the machine schedules it.
		p.consEng.SetDelay(50 * time.Millisecond)
		before := p.cons.Stats()
		h, err := p.cons.Post(p.pname, []int{3}, []int{5}, []byte("stepped"))
		require.NoError(t, err)
		st, err := pollDone(t, p.cons, h)
		require.NoError(t, err)
		require.Equal(t, StateDone, st)
		require.NoError(t, p.cons.Release(h))
		after := p.cons.Stats()
		if only {
			require.Zero(t, after.CallerSteps-before.CallerSteps, "ReactorOnly: a caller stepped in")
			require.Zero(t, after.Naps-before.Naps, "ReactorOnly: the reactor napped")
		} else {
			require.NotZero(t, after.CallerSteps-before.CallerSteps, "no caller step while a caller polled for 50ms")
			require.NotZero(t, after.Naps-before.Naps, "the reactor thread never stood aside")
		}
		// Counted right after DONE is published (a release that wins the
		// race is counted canceled instead), by whoever published it: when
		// that was the reactor thread, the count may trail the caller.
		require.Eventually(t, func() bool { return p.cons.Stats().ReadsDone == before.ReadsDone+1 },
			5*time.Second, time.Millisecond)
		var got [][]byte
		require.Eventually(t, func() bool {
			got = append(got, p.prod.Notifs()[p.cons.agent.Name()]...)
			return len(got) > 0
		}, 5*time.Second, time.Millisecond)
		require.Equal(t, [][]byte{[]byte("stepped")}, got)
	}
}

// While the reactor thread naps for a polling caller, everything a step
// leaves to it still happens: READs posted by other callers (Post steps
// in, or wakes the nap), releases of READs in flight, control operations,
// and callers blocked in Wait, which stop stepping in and wake the nap.
// Nothing is lost and nothing is counted twice.
func TestNapLosesNothing(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 64, Options{WaitSpin: time.Microsecond})
	p.consEng.SetDelay(2 * time.Millisecond)
	ctx := context.Background()

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var polled int
	// One caller polls READs back to back: the reactor thread naps.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			h, err := p.cons.Post(p.pname, []int{i % 8}, []int{i % 8}, nil)
			if !assertNoErr(t, err) {
				return
			}
			if st, err := pollDone(t, p.cons, h); !assertNoErr(t, err) || st != StateDone {
				t.Errorf("polled READ ended %v", st)
				return
			}
			assertNoErr(t, p.cons.Release(h))
			polled++
		}
	}()
	// Others wait in Wait, release READs in flight and add a peer.
	const waiters, rounds = 3, 40
	for g := 0; g < waiters; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < rounds; i++ {
				blk := 8 + g*8 + i%8
				h, err := p.cons.Post(p.pname, []int{blk}, []int{blk}, []byte{byte(g), byte(i)})
				if !assertNoErr(t, err) {
					return
				}
				if i%4 == 3 {
					// Released in flight: the reactor thread cancels it.
					assertNoErr(t, p.cons.Release(h))
					continue
				}
				if !assertNoErr(t, p.cons.Wait(ctx, h)) {
					return
				}
				if st, err := p.cons.State(h); st != StateDone || err != nil {
					t.Errorf("waited READ: %v, %v", st, err)
				}
				assertNoErr(t, p.cons.Release(h))
			}
		}(g)
	}
	// A control operation while the caller polls.
	_, err := p.cons.AddPeer(nil, nil)
	require.Error(t, err)

	time.Sleep(20 * time.Millisecond)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	// The waiters finish; then the poller is told to stop.
	deadline := time.After(30 * time.Second)
	for p.cons.Stats().ReadsDone+p.cons.Stats().ReadsCanceled < waiters*rounds {
		select {
		case <-deadline:
			t.Fatal("READs of the waiters did not end")
		case <-time.After(time.Millisecond):
		}
	}
	// The poller alone for a while (longer than crowdHold): it steps in.
	time.Sleep(3 * crowdHold)
	close(stop)
	<-done

	// A release in flight returns before the reactor thread has ended
	// the READ: wait for it.
	var st Stats
	require.Eventually(t, func() bool {
		st = p.cons.Stats()
		return st.LiveHandles == 0 && st.ReadsPosted == st.ReadsDone+st.ReadsCanceled
	}, 5*time.Second, time.Millisecond)
	require.Zero(t, st.ReadsFailed)
	require.EqualValues(t, waiters*rounds+polled, st.ReadsPosted)
	require.NotZero(t, st.CallerSteps)
	// Every notification of a READ that ended DONE arrives, once (the
	// polled READs carry none; a READ released in flight may have ended
	// DONE before its release, or been canceled).
	want := int(st.ReadsDone) - polled
	got := map[[2]byte]int{}
	n := 0
	require.Eventually(t, func() bool {
		for _, m := range p.prod.Notifs()[p.cons.agent.Name()] {
			got[[2]byte{m[0], m[1]}]++
			n++
		}
		return n >= want
	}, 5*time.Second, time.Millisecond)
	time.Sleep(10 * time.Millisecond)
	for _, m := range p.prod.Notifs()[p.cons.agent.Name()] {
		got[[2]byte{m[0], m[1]}]++
		n++
	}
	require.Equal(t, want, n)
	for k, c := range got {
		require.Equal(t, 1, c, "notification %v delivered %d times", k, c)
	}
}

func assertNoErr(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// A caller that checks its READ once in a while (as vLLM's scheduler does
// once a step) takes a step each time but does not make the reactor
// thread stand aside: its READ's data is taken in when it arrives, not
// at the next check. Nor do callers step in while more READs are in
// flight than helpMax: many polling goroutines would starve the one
// holding the token.
func TestStepInOnlyWhenPollingAlone(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 64, Options{})
	p.consEng.SetDelay(30 * time.Millisecond)
	before := p.cons.Stats()
	h, err := p.cons.Post(p.pname, []int{1}, []int{2}, nil)
	require.NoError(t, err)
	for {
		st, err := p.cons.State(h)
		require.NoError(t, err)
		if st != StateProc {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	require.NoError(t, p.cons.Release(h))
	mid := p.cons.Stats()
	require.NotZero(t, mid.CallerSteps-before.CallerSteps, "a check took no step")
	require.Zero(t, mid.Naps-before.Naps, "the reactor napped for a caller checking every 2ms")

	// helpMax+1 READs that never end on their own: polling one of them
	// for a while takes no step.
	p.consEng.SetDelay(time.Hour)
	hs := make([]uint64, p.cons.helpMax+1)
	for i := range hs {
		hs[i], err = p.cons.Post(p.pname, []int{10 + i}, []int{10 + i}, nil)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return p.cons.Stats().InFlight == int64(len(hs)) }, 5*time.Second, time.Millisecond)
	mid = p.cons.Stats()
	for end := time.Now().Add(20 * time.Millisecond); time.Now().Before(end); {
		st, err := p.cons.State(hs[0])
		require.NoError(t, err)
		require.Equal(t, StateProc, st)
		runtime.Gosched()
	}
	after := p.cons.Stats()
	require.Equal(t, mid.CallerSteps, after.CallerSteps, "a caller stepped in with %d READs in flight", len(hs))
	require.Equal(t, mid.Naps, after.Naps)
	for _, h := range hs {
		require.NoError(t, p.cons.Release(h))
	}
}

// Two READs polled in turn, in runs (two callers, or one with two READs),
// take no step even where helpMax would allow two in flight; a READ polled alone
// steps again once crowdHold has passed.
func TestCrowdTakesNoStep(t *testing.T) {
	leakcheck.Check(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	p := newPair(t, 16, Options{})
	require.EqualValues(t, 4, p.cons.helpMax)
	p.consEng.SetDelay(time.Hour)
	a, err := p.cons.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	b, err := p.cons.Post(p.pname, []int{2}, []int{2}, nil)
	require.NoError(t, err)
	// The crowd is seen at the first switch from one READ to the other.
	for _, h := range []uint64{a, b} {
		_, err := p.cons.State(h)
		require.NoError(t, err)
	}
	// In runs, as callers sharing a P poll (each for its time slice). A
	// run is judged only if it ended within crowdHold/2 of its start, the
	// switch that renewed the crowd: on a loaded machine (make test runs
	// packages side by side, under -race) a run can take longer than
	// crowdHold, and then its READ is rightly polled alone.
	judged := 0
	for end := time.Now().Add(50 * time.Millisecond); time.Now().Before(end) || judged == 0; {
		for _, h := range []uint64{a, b} {
			before := p.cons.Stats()
			start := time.Now()
			for range 300 {
				st, err := p.cons.State(h)
				require.NoError(t, err)
				require.Equal(t, StateProc, st)
			}
			if time.Since(start) >= crowdHold/2 {
				continue
			}
			judged++
			after := p.cons.Stats()
			require.Equal(t, before.CallerSteps, after.CallerSteps, "callers stepped in while two READs were polled in turn")
			require.Equal(t, before.Naps, after.Naps)
		}
		runtime.Gosched()
		require.Less(t, time.Since(end), 10*time.Second, "no run of 300 checks within %v", crowdHold/2)
	}
	require.NoError(t, p.cons.Release(a))
	require.NoError(t, p.cons.Release(b))

	mid := p.cons.Stats()
	p.consEng.SetDelay(3 * crowdHold)
	c, err := p.cons.Post(p.pname, []int{3}, []int{3}, nil)
	require.NoError(t, err)
	st, err := pollDone(t, p.cons, c)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, p.cons.Release(c))
	require.Greater(t, p.cons.Stats().CallerSteps, mid.CallerSteps, "a READ polled alone took no step after crowdHold")
}

// A reactor thread napping for a lone poller wakes when callers may no
// longer step in (a second READ in flight polled: the crowd), instead of
// sleeping out its nap while nobody progresses the engine. With napTurn
// at an hour, only that wake-up can end the nap.
func TestCrowdWakesTheNap(t *testing.T) {
	leakcheck.Check(t)
	procs := runtime.GOMAXPROCS(8)
	turn := napTurn
	napTurn = time.Hour
	t.Cleanup(func() { runtime.GOMAXPROCS(procs); napTurn = turn })
	p := newPair(t, 16, Options{ParkTimeout: time.Hour})
	p.consEng.SetDelay(time.Hour)
	a, err := p.cons.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	b, err := p.cons.Post(p.pname, []int{2}, []int{2}, nil)
	require.NoError(t, err)
	// a polled alone until the reactor thread naps: no turn for 20ms
	// (a nap can end at once on a wake-up left over from a hand-over of
	// the token).
	deadline := time.Now().Add(5 * time.Second)
	turns, since := p.cons.Stats().LoopTurns, time.Now()
	for time.Since(since) < 20*time.Millisecond {
		require.True(t, time.Now().Before(deadline), "the reactor thread never napped for a lone poller")
		st, err := p.cons.State(a)
		require.NoError(t, err)
		require.Equal(t, StateProc, st)
		if n := p.cons.Stats().LoopTurns; n != turns {
			turns, since = n, time.Now()
		}
	}
	st, err := p.cons.State(b)
	require.NoError(t, err)
	require.Equal(t, StateProc, st)
	require.Eventually(t, func() bool { return p.cons.Stats().LoopTurns > turns }, 5*time.Second, time.Millisecond,
		"the reactor thread slept on after the crowd")
	require.NoError(t, p.cons.Release(a))
	require.NoError(t, p.cons.Release(b))
}

// A reactor thread napping for a lone poller blocks its goroutine and
// frees its P: asleep in a system call, it kept the P until Go's sysmon
// took it back, which sysmon looks for every 20 µs or so while it finds
// some (the caller and the producer felt it on a 2-core machine).
func TestNapFreesItsP(t *testing.T) {
	leakcheck.Check(t)
	turn := napTurn
	napTurn = time.Hour
	t.Cleanup(func() { napTurn = turn })
	p := newPair(t, 16, Options{ParkTimeout: time.Hour})
	p.consEng.SetDelay(time.Hour)
	h, err := p.cons.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	// The napping goroutine is seen blocked in its select (a snapshot
	// may catch it a moment before it gets there, runnable: looked at
	// again; one asleep in a system call is never seen so).
	deadline := time.Now().Add(5 * time.Second)
	var napper, header string
	for !strings.Contains(header, "[select") {
		require.True(t, time.Now().Before(deadline), "the reactor thread never napped blocked in its select for a lone poller; last seen:\n%s", napper)
		st, err := p.cons.State(h)
		require.NoError(t, err)
		require.Equal(t, StateProc, st)
		if !p.cons.napping.Load() {
			continue
		}
		buf := make([]byte, 1<<20)
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "reactor.(*Reactor).nap(") {
				napper = g
				header, _, _ = strings.Cut(napper, "\n")
			}
		}
	}
	// Release wakes the nap (an hour long otherwise), and the READ goes.
	require.NoError(t, p.cons.Release(h))
	require.Eventually(t, func() bool { return p.cons.Stats().LiveHandles == 0 }, 5*time.Second, time.Millisecond)
}

// The reactor thread that waits for the token a caller holds sleeps
// between looks: ppoll writes back the unslept part of its timeout, and
// a reused timeout of zero made the wait a loop of system calls that
// took a core from the caller holding the token.
func TestTokenWaitSleeps(t *testing.T) {
	leakcheck.Check(t)
	p, r := holdToken(t)
	const hold = 100 * time.Millisecond
	before := r.lockSleeps.Load()
	time.Sleep(hold)
	slept := r.lockSleeps.Load() - before
	r.releaseEngine()
	// At most one sleep per lockSleep, twice over for wake-ups and
	// interrupted sleeps; looping without sleeping makes tens of
	// thousands.
	require.NotZero(t, slept, "the reactor thread never slept while it waited for the token")
	require.LessOrEqual(t, slept, int64(2*hold/lockSleep)+10, "the reactor thread did not sleep between its looks at the token")

	// And the loop goes on once it has the token.
	readOnce(t, p)
}

// The reactor thread waiting for the token a caller holds is woken when
// the caller hands it back, not by its sleep's timeout: with lockSleep an
// hour, the loop goes on once the token is released.
func TestTokenHandOverWakes(t *testing.T) {
	leakcheck.Check(t)
	sleep := lockSleep
	lockSleep = time.Hour
	t.Cleanup(func() { lockSleep = sleep })
	p, r := holdToken(t)
	require.Eventually(t, func() bool { return r.lockSleeps.Load() > 0 }, 5*time.Second, 100*time.Microsecond,
		"the reactor thread never went to sleep waiting for the token")
	r.releaseEngine()
	require.Eventually(t, func() bool { return !r.wantEngine.Load() }, 5*time.Second, 100*time.Microsecond,
		"the reactor thread slept on after the token was handed back")
	readOnce(t, p)
}

// holdToken starts a pair whose consumer parks, takes the engine token
// while its reactor thread sleeps without it, and wakes the thread: its
// next turn waits for the token.
func holdToken(t *testing.T) (*testPair, *Reactor) {
	t.Helper()
	p := newPair(t, 16, Options{Idle: IdlePark})
	r := p.cons
	require.Eventually(t, func() bool {
		return r.sleeping.Load() && r.engine.CompareAndSwap(false, true)
	}, 5*time.Second, 100*time.Microsecond)
	r.writeWake()
	require.Eventually(t, r.wantEngine.Load, 5*time.Second, 100*time.Microsecond)
	return p, r
}

// readOnce posts a READ on p's consumer and polls it to DONE.
func readOnce(t *testing.T, p *testPair) {
	t.Helper()
	h, err := p.cons.Post(p.pname, []int{1}, []int{2}, nil)
	require.NoError(t, err)
	st, err := pollDone(t, p.cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, p.cons.Release(h))
}

// BenchmarkCheckSteppingIn is one CheckXferState of an engine READ in
// flight, by a caller that steps in each time (the engine's part is the
// loopback engine's, which has nothing to do): the reactor's own cost of
// the polling path.
func BenchmarkCheckSteppingIn(b *testing.B) {
	p := newPair(b, 16, Options{})
	p.consEng.SetDelay(time.Hour)
	h, err := p.cons.Post(p.pname, []int{3}, []int{5}, nil)
	require.NoError(b, err)
	for range 100 {
		_, _ = p.cons.State(h) // the streak, and the reactor thread's nap
	}
	before := p.cons.Stats().CallerSteps
	b.ResetTimer()
	for range b.N {
		if st, err := p.cons.State(h); st != StateProc || err != nil {
			b.Fatalf("state %v, %v", st, err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(p.cons.Stats().CallerSteps-before)/float64(b.N), "steps/op")
	require.NoError(b, p.cons.Release(h))
}

// While a caller polls one READ, the reactor thread naps on at the end of
// each napTurn instead of taking the token for a turn of its own; the
// READ lands all the same.
func TestNapGoesOnWhileCallersStep(t *testing.T) {
	leakcheck.Check(t)
	turn := napTurn
	napTurn = 2 * time.Millisecond
	t.Cleanup(func() { napTurn = turn })
	p := newPair(t, 16, Options{})
	// Many napTurns long, however slowly the machine runs the caller.
	p.consEng.SetDelay(200 * time.Millisecond)
	before := p.cons.st.napTurnsSkipped.Load()
	h, err := p.cons.Post(p.pname, []int{3}, []int{5}, nil)
	require.NoError(t, err)
	st, err := pollDone(t, p.cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, p.cons.Release(h))
	require.NotZero(t, p.cons.st.napTurnsSkipped.Load()-before, "the reactor thread never napped on while the caller stepped in")
}

// When a nap may go on (napOn): only while the callers' streak stands,
// their last wish is within napTurn, they may step in, and nothing waits
// for the reactor thread.
func TestNapOn(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	// The loop's own turns and naps would move the state under the test:
	// hold the token, as a caller's step does, while the loop sleeps.
	require.Eventually(t, func() bool { return r.sleeping.Load() && r.engine.CompareAndSwap(false, true) },
		5*time.Second, 100*time.Microsecond)
	defer r.releaseEngine()
	stepping := func() {
		r.streak.Store(helpStreak)
		r.helpWant.Store(r.now())
	}
	stepping()
	require.True(t, r.napOn(), "a caller stepping in")
	r.streak.Store(helpStreak - 1)
	require.False(t, r.napOn(), "a streak not built yet")
	stepping()
	r.helpWant.Store(r.now() - int64(napTurn))
	require.False(t, r.napOn(), "the last wish a napTurn ago")
	stepping()
	r.inflight.Store(r.helpMax + 1)
	require.False(t, r.napOn(), "more READs in flight than callers step in for")
	r.inflight.Store(0)
	stepping()
	require.True(t, r.cancel.TryPush(1))
	require.False(t, r.napOn(), "a cancel waiting for the thread")
	var buf [1]uint64
	require.Equal(t, 1, r.cancel.Drain(buf[:]))
	stepping()
	r.closing.Store(true)
	require.False(t, r.napOn(), "closing")
	r.closing.Store(false)
}

// A READ that never completes times out while a caller polls it and the
// reactor thread naps on: the nap goes on no longer than the READ's
// timeout. So does a READ posted after the nap began (its deadline is the
// timeout from its post).
func TestNapOnEndsAtTimeouts(t *testing.T) {
	leakcheck.Check(t)
	turn := napTurn
	napTurn = 2 * time.Millisecond
	t.Cleanup(func() { napTurn = turn })
	p := newPair(t, 16, Options{})
	p.cons.SetTimeout(100 * time.Millisecond)
	// A first READ that completes while the caller polls: the reactor
	// thread naps from then on.
	p.consEng.SetDelay(20 * time.Millisecond)
	h, err := p.cons.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	st, err := pollDone(t, p.cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, p.cons.Release(h))
	// Then READs that never complete, posted and polled back to back.
	p.consEng.SetDelay(time.Hour)
	for i := range 3 {
		posted := time.Now()
		h, err := p.cons.Post(p.pname, []int{2 + i}, []int{2 + i}, nil)
		require.NoError(t, err)
		st, err := pollDone(t, p.cons, h)
		took := time.Since(posted)
		require.ErrorIs(t, err, ErrTimeout, "READ %d", i)
		require.Equal(t, StateErr, st)
		require.NoError(t, p.cons.Release(h))
		// Not a measure of speed: a nap that ignored the deadline went on
		// for seconds, until the caller happened to pause for a napTurn.
		require.Less(t, took, 2*time.Second, "READ %d timed out %v after its post, its timeout 100ms", i, took)
	}
}

// A direct READ held behind an engine fence keeps the reactor thread
// from napping on: only its turns hand held READs to the copy workers
// once the fence lifts, and a nap would leave one PROC for up to two
// napTurns while its caller steps in.
func TestNapOnEndsForHeldDirectReads(t *testing.T) {
	leakcheck.Check(t)
	r := directPair(t, DirectOptions{}).cons
	require.Eventually(t, func() bool { return r.sleeping.Load() && r.engine.CompareAndSwap(false, true) },
		5*time.Second, 100*time.Microsecond)
	defer r.releaseEngine()
	r.streak.Store(helpStreak)
	r.helpWant.Store(r.now())
	require.True(t, r.napOn(), "a caller stepping in")
	r.dir.holding.Store(1)
	require.False(t, r.napOn(), "a held direct READ waiting for the thread")
	r.dir.holding.Store(0)
}

// A caller that polls an engine READ in a loop has the reactor thread nap
// for it, and napping on, it took no turn: the only turns that read the
// direct path's notification socket. A notification that came over the
// socket then waited, whatever blocked in WaitNotifs, until the caller
// stopped polling (here: for ever). With a caller in WaitNotifs the nap
// no longer goes on past napTurn.
func TestWaitNotifsWhileCallersStepIn(t *testing.T) {
	leakcheck.Check(t)
	ns, err := ListenNotify(-1, 0)
	require.NoError(t, err)
	key, token := ns.Key, ns.Token
	p := directPair(t, DirectOptions{Notify: ns, Name: "cons"})
	r := p.cons
	p.consEng.SetDelay(time.Hour)
	h, err := r.Post(p.pname, []int{3}, []int{5}, nil)
	require.NoError(t, err)
	stop := make(chan struct{})
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, _ = r.State(h)
			runtime.Gosched()
		}
	}()
	defer func() {
		close(stop)
		<-polled
		require.NoError(t, r.Release(h))
	}()
	naps := r.st.naps.Load()
	require.Eventually(t, func() bool { return r.st.naps.Load() > naps && r.napping.Load() },
		5*time.Second, 100*time.Microsecond, "the thread naps for the polling caller")

	go func() {
		time.Sleep(20 * time.Millisecond) // WaitNotifs blocks by then
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			panic(err)
		}
		defer unix.Close(fd)
		b := appendNotifDgram(nil, &key, "someone", []byte("hello"))
		if err := unix.Sendto(fd, b, 0, &unix.SockaddrUnix{Name: shmview.NotifyAddr(uint32(unix.Getpid()), token)}); err != nil {
			panic(err)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m, err := r.WaitNotifs(ctx)
	require.NoError(t, err, "the notification never reached WaitNotifs")
	require.Equal(t, map[string][][]byte{"someone": {[]byte("hello")}}, m)
}

// directPair is newPair with the direct path set on the consumer (o, over
// an anonymous region of its own), closed and the region unmapped when
// the test ends.
func directPair(t *testing.T, o DirectOptions) *testPair {
	t.Helper()
	p := newPair(t, 16, Options{})
	region, err := unix.Mmap(-1, 0, 16*64, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, p.cons.Close())
		require.NoError(t, unix.Munmap(region))
	})
	o.Region = region
	require.NoError(t, p.cons.SetDirect(o))
	return p
}
