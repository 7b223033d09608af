package reactor

import (
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// crowdPair is a pair whose consumer has crowdMin 2 (GOMAXPROCS 1 at its
// Start) and n READs in flight that the engine holds for an hour.
func crowdPair(t *testing.T, n int) (*testPair, []uint64) {
	t.Helper()
	procs := runtime.GOMAXPROCS(1)
	p := newPair(t, 16, Options{})
	runtime.GOMAXPROCS(procs)
	require.EqualValues(t, 2, p.cons.crowdMin)
	p.consEng.SetDelay(time.Hour)
	hs := make([]uint64, n)
	for i := range hs {
		h, err := p.cons.Post(p.pname, []int{i}, []int{i}, nil)
		require.NoError(t, err)
		hs[i] = h
	}
	t.Cleanup(func() {
		for _, h := range hs {
			_ = p.cons.Release(h)
		}
	})
	return p, hs
}

// proc checks h once and requires it in flight.
func proc(t *testing.T, r *Reactor, h uint64) {
	t.Helper()
	st, err := r.State(h)
	require.NoError(t, err)
	require.Equal(t, StateProc, st)
}

// A READ polled in a loop among more READs in flight than crowdMin makes
// its checks sleep (and report PROC after); checks spread out as a
// caller's steps are (more than crowdGap apart) never sleep.
func TestCrowdPollerSleeps(t *testing.T) {
	leakcheck.Check(t)
	p, hs := crowdPair(t, 4)
	before := p.cons.Stats().CrowdSleeps
	for round := 0; round < 4; round++ {
		for _, h := range hs {
			proc(t, p.cons, h)
		}
		time.Sleep(2 * crowdGap)
	}
	require.Equal(t, before, p.cons.Stats().CrowdSleeps, "checks a step apart slept")

	for i := 0; i < 200 && p.cons.Stats().CrowdSleeps < before+3; i++ {
		proc(t, p.cons, hs[0])
	}
	require.GreaterOrEqual(t, p.cons.Stats().CrowdSleeps, before+3, "a READ polled in a loop among 4 in flight never slept")
}

// At most crowdMin READs in flight: polling never sleeps.
func TestCrowdFewNoSleep(t *testing.T) {
	leakcheck.Check(t)
	p, hs := crowdPair(t, 2)
	before := p.cons.Stats().CrowdSleeps
	for range 2000 {
		proc(t, p.cons, hs[0])
	}
	require.Equal(t, before, p.cons.Stats().CrowdSleeps)
}

// A READ checked more than crowdGap after its last sleep ended (a caller
// sweeping many READs, which slept on the others meanwhile) never sleeps
// again.
func TestCrowdSweptReadStopsSleeping(t *testing.T) {
	leakcheck.Check(t)
	p, hs := crowdPair(t, 4)
	h := hs[1]
	before := p.cons.Stats().CrowdSleeps
	for i := 0; i < 200 && p.cons.Stats().CrowdSleeps == before; i++ {
		proc(t, p.cons, h)
	}
	slept := p.cons.Stats().CrowdSleeps
	require.Greater(t, slept, before, "the READ never slept")
	time.Sleep(2 * crowdGap)
	for range 500 {
		proc(t, p.cons, h)
	}
	require.Equal(t, slept, p.cons.Stats().CrowdSleeps, "a swept READ slept again")
	// Other READs still sleep when polled in a loop.
	for i := 0; i < 200 && p.cons.Stats().CrowdSleeps == slept; i++ {
		proc(t, p.cons, hs[2])
	}
	require.Greater(t, p.cons.Stats().CrowdSleeps, slept)
}

// Callers polling their READs in a crowd, sleeping in their checks, see
// every one of them DONE.
func TestCrowdSleepersSeeTheirEnds(t *testing.T) {
	leakcheck.Check(t)
	p, _ := crowdPair(t, 6)
	p.consEng.SetDelay(5 * time.Millisecond)
	var mu sync.Mutex
	var ends []State
	var wg sync.WaitGroup
	for i := 6; i < 12; i++ {
		h, err := p.cons.Post(p.pname, []int{i}, []int{i}, nil)
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := pollDone(t, p.cons, h)
			mu.Lock()
			ends = append(ends, st)
			mu.Unlock()
			if err == nil {
				_ = p.cons.Release(h)
			}
		}()
	}
	wg.Wait()
	require.Len(t, ends, 6)
	for _, st := range ends {
		require.Equal(t, StateDone, st)
	}
	require.Positive(t, p.cons.Stats().CrowdSleeps, "the pollers of 12 READs in flight never slept")
}
