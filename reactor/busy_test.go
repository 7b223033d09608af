package reactor

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// fillTable posts transfers that never complete until Post refuses one,
// and returns their handles.
func fillTable(t *testing.T, p *testPair) []uint64 {
	t.Helper()
	p.consEng.SetDelay(time.Hour)
	var hs []uint64
	for i := 0; ; i++ {
		h, err := p.cons.Post(p.pname, []int{i % 16}, []int{i % 16}, nil)
		if errors.Is(err, ErrBusy) {
			return hs
		}
		require.NoError(t, err)
		hs = append(hs, h)
	}
}

// ErrBusy comes only when the table is full: exactly Handles transfers can
// be in flight (Handles is rounded up to a power of two, at least 256).
func TestPostBusyOnlyWhenTableFull(t *testing.T) {
	leakcheck.Check(t)
	for _, handles := range []int{256, 1024} {
		p := newPair(t, 16, Options{Handles: handles, SubmitRing: 2 * handles})
		hs := fillTable(t, p)
		require.Equal(t, handles, len(hs), "ErrBusy before the table was full")
		for _, h := range hs {
			require.NoError(t, p.cons.Release(h))
		}
	}
}

// With WaitWhenBusy, a Post that finds the table full waits, takes the
// slot a Release frees, and gives up with ErrClosed when the reactor
// closes.
func TestWaitWhenBusy(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{Handles: 256, WaitWhenBusy: true})
	p.consEng.SetDelay(time.Hour)
	hs := make([]uint64, 0, 256)
	for i := 0; i < 256; i++ {
		h, err := p.cons.Post(p.pname, []int{i % 16}, []int{i % 16}, nil)
		require.NoError(t, err)
		hs = append(hs, h)
	}
	require.Eventually(t, func() bool { return p.cons.inflight.Load() == 256 }, 5*time.Second, time.Millisecond)

	type result struct {
		h   uint64
		err error
	}
	post := func() <-chan result {
		out := make(chan result, 1)
		go func() {
			h, err := p.cons.Post(p.pname, []int{0}, []int{0}, nil)
			out <- result{h, err}
		}()
		return out
	}

	waiting := post()
	time.Sleep(50 * time.Millisecond)
	select {
	case r := <-waiting:
		t.Fatalf("Post returned (%x, %v) while the table was full", r.h, r.err)
	default:
	}

	// A release makes room: the waiter takes it.
	require.NoError(t, p.cons.Release(hs[0]))
	r := <-waiting
	require.NoError(t, r.err)
	hs[0] = r.h

	// Close ends a waiting Post with ErrClosed.
	waiting = post()
	time.Sleep(10 * time.Millisecond)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = p.cons.Close() }()
	r = <-waiting
	require.ErrorIs(t, r.err, ErrClosed)
	wg.Wait()
}
