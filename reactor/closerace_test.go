package reactor

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// A Post racing Close while a caller who guessed its handle releases it:
// whichever of Post, teardown and the release comes last, the READ counts
// posted and canceled once, and its slot is freed.

// closeRace is a consumer whose loop is held in a control operation, with
// its two-place submission ring filled by two READs, so that a third
// Post finds no room.
type closeRace struct {
	*testPair
	unhold func()
}

func newCloseRace(t *testing.T, wait bool) *closeRace {
	t.Helper()
	p := newPair(t, 16, Options{SubmitRing: 2, BatchSize: 1, Handles: 256, WaitWhenBusy: wait})
	in, out := make(chan struct{}), make(chan struct{})
	go func() {
		_ = p.cons.do(func() error {
			close(in)
			<-out
			return nil
		})
	}()
	<-in
	for i := range 2 {
		_, err := p.cons.Post(p.pname, []int{i}, []int{i}, []byte("queued"))
		require.NoError(t, err)
	}
	require.Equal(t, 2, p.cons.sub.Len())
	return &closeRace{testPair: p, unhold: sync.OnceFunc(func() { close(out) })}
}

// closeAsync begins Close and lets the held loop run its teardown; the
// channel gives Close's result.
func (c *closeRace) closeAsync() <-chan error {
	closed := make(chan error, 1)
	go func() { closed <- c.cons.Close() }()
	for !c.cons.closing.Load() {
		runtime.Gosched()
	}
	c.unhold()
	return closed
}

// releaseInFlight does what a Release that passed its closing check
// before Close began does to the one READ still PROC: marks it released
// and queues its cancel entry. It reports whether it found one.
func releaseInFlight(r *Reactor) bool {
	for i := range r.tab.slots {
		s := &r.tab.slots[i]
		w := s.word.Load()
		if wordState(w) != stProc {
			continue
		}
		h := w&r.tab.genMask() | uint64(i)
		return s.word.CompareAndSwap(w, w&^stateMask|stCanceling) && r.cancel.TryPush(h)
	}
	return false
}

// setHook points hook h at f for the test's duration.
func setHook(t *testing.T, h *atomic.Pointer[func()], f func()) {
	h.Store(&f)
	t.Cleanup(func() { h.Store(nil) })
}

// pauseAt makes hook h stop the first goroutine that runs it: reached is
// closed when one does, which goes on once resume is closed.
func pauseAt(t *testing.T, h *atomic.Pointer[func()]) (reached, resume chan struct{}) {
	reached, resume = make(chan struct{}), make(chan struct{})
	setHook(t, h, sync.OnceFunc(func() {
		close(reached)
		<-resume
	}))
	return reached, resume
}

// postLate starts the Post that finds no room on the ring; the channel
// gives its error.
func (c *closeRace) postLate() <-chan error {
	posted := make(chan error, 1)
	go func() {
		_, err := c.cons.Post(c.pname, []int{2}, []int{2}, []byte("late"))
		posted <- err
	}()
	return posted
}

// checkOneCanceled checks the consumer's books once everything has ended:
// three READs posted, the third canceled, every slot free.
func checkOneCanceled(t *testing.T, r *Reactor) {
	t.Helper()
	st := r.Stats()
	books := fmt.Sprintf("posted %d, done %d, failed %d, canceled %d, live handles %d",
		st.ReadsPosted, st.ReadsDone, st.ReadsFailed, st.ReadsCanceled, st.LiveHandles)
	require.EqualValues(t, 3, st.ReadsPosted, books)
	require.EqualValues(t, 1, st.ReadsCanceled, "the released READ was not counted canceled: %s", books)
	require.Equal(t, st.ReadsPosted, st.ReadsDone+st.ReadsFailed+st.ReadsCanceled, "counters do not balance: %s", books)
	require.Zero(t, r.tab.live.Load(), "slots left: %s", books)
}

// The Post's READ reaches the ring after teardown's drains, and the
// release comes before teardown frees the ended slots.
func TestGuessedReleaseBeforeSweep(t *testing.T) {
	leakcheck.Check(t)
	c := newCloseRace(t, true)
	r := c.cons
	atRoom, goPush := pauseAt(t, &testhook.RoomWait)
	var released atomic.Bool
	setHook(t, &testhook.BeforeSweep, func() {
		close(goPush)
		for r.sub.Len() == 0 {
			runtime.Gosched()
		}
		released.Store(releaseInFlight(r))
	})
	posted := c.postLate()
	<-atRoom
	require.NoError(t, <-c.closeAsync())
	require.ErrorIs(t, <-posted, ErrClosed)
	require.True(t, released.Load(), "no READ in flight to release before the sweep")
	checkOneCanceled(t, r)
}

// The release comes after Close has ended: before a Post waiting for
// room (WaitWhenBusy) pushes its READ onto the ring nobody drains any
// more, or before a Post refused room (ErrBusy) takes its handle back.
func TestGuessedReleaseAfterTeardown(t *testing.T) {
	for _, tc := range []struct {
		name string
		wait bool
		hook *atomic.Pointer[func()]
		want error
	}{
		{"waiting for room", true, &testhook.RoomWait, ErrClosed},
		{"refused", false, &testhook.PushRefused, ErrBusy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leakcheck.Check(t)
			c := newCloseRace(t, tc.wait)
			reached, resume := pauseAt(t, tc.hook)
			posted := c.postLate()
			<-reached
			require.NoError(t, <-c.closeAsync())
			require.True(t, releaseInFlight(c.cons), "no READ in flight to release")
			close(resume)
			require.ErrorIs(t, <-posted, tc.want)
			checkOneCanceled(t, c.cons)
		})
	}
}

// Posts, releases of guessed handles and Close, at random moments: after
// Close every READ counted posted is counted ended once, and no handle is
// left live. (The orders above, at whatever moment the scheduler makes.)
func TestGuessedReleasesRacingClose(t *testing.T) {
	leakcheck.Check(t)
	for round := range 40 {
		p := newPair(t, 16, Options{SubmitRing: 2, BatchSize: 1, Handles: 256, WaitWhenBusy: round%2 == 0})
		r := p.cons
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !r.closing.Load() {
				for _, h := range guessHandles(r.tab, 4) {
					_ = r.Release(h)
				}
			}
		}()
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				idx := []int{g}
				for i := 0; ; i++ {
					h, err := r.Post(p.pname, idx, idx, []byte("n"))
					switch {
					case errors.Is(err, ErrClosed):
						return
					case err == nil && i%2 == 0:
						_ = r.Release(h)
					}
				}
			}()
		}
		time.Sleep(time.Duration(100+round*37) * time.Microsecond)
		require.NoError(t, r.Close())
		wg.Wait()
		st := r.Stats()
		require.Equal(t, st.ReadsPosted, st.ReadsDone+st.ReadsFailed+st.ReadsCanceled,
			"round %d: posted %d, done %d, failed %d, canceled %d", round, st.ReadsPosted, st.ReadsDone, st.ReadsFailed, st.ReadsCanceled)
		require.Zero(t, r.tab.live.Load(), "round %d: handles left live after Close", round)
	}
}
