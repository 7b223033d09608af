package reactor

import (
	"context"
	"errors"
	"reflect"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// Who frees a slot: each slot has one owner at a time, and only its owner
// frees it. These tests race the owners against each other.

// watchLive samples the table's live count until stop is closed and reports
// the smallest value it saw.
func watchLive(r *Reactor, stop <-chan struct{}) <-chan int64 {
	out := make(chan int64, 1)
	go func() {
		low := r.tab.live.Load()
		for {
			if v := r.tab.live.Load(); v < low {
				low = v
			}
			select {
			case <-stop:
				out <- low
				return
			default:
				runtime.Gosched()
			}
		}
	}()
	return out
}

// Posts racing Close: a Post that claimed a slot must free that slot and
// no other, and Close must not free a slot a Post is still filling in (the
// race detector sees the second claimer writing the slot's request while
// the first still does).
func TestPostRacingClose(t *testing.T) {
	leakcheck.Check(t)
	for round := 0; round < 40; round++ {
		p := newPair(t, 16, Options{SubmitRing: 2, BatchSize: 1, Handles: 256})
		stop := make(chan struct{})
		low := watchLive(p.cons, stop)
		var wg sync.WaitGroup
		var posted atomic.Int64
		for g := 0; g < 6; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				idx := []int{g % 16}
				for i := 0; ; i++ {
					h, err := p.cons.Post(p.pname, idx, idx, []byte("n"))
					switch {
					case errors.Is(err, ErrClosed):
						return
					case err == nil:
						posted.Add(1)
						if i%2 == 0 {
							_ = p.cons.Release(h)
						}
					}
				}
			}(g)
		}
		time.Sleep(time.Duration(200+round*25) * time.Microsecond)
		require.NoError(t, p.cons.Close())
		wg.Wait()
		close(stop)
		require.GreaterOrEqual(t, <-low, int64(0), "live handles went negative")
		require.Equal(t, int64(0), p.cons.tab.live.Load(), "slots left claimed after Close (posted %d)", posted.Load())
	}
}

// Releases of in-flight transfers, as fast as slots can be recycled: every
// canceling slot is freed once, by the reactor, after its cancel entry is
// drained, so the cancel ring (one place per slot) never overflows.
func TestReleaseInFlightStorm(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{BatchSize: 1, Handles: 256})
	p.consEng.SetDelay(20 * time.Microsecond)
	var wg sync.WaitGroup
	var canceled atomic.Int64
	deadline := time.Now().Add(time.Second)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			idx := []int{g % 16}
			for time.Now().Before(deadline) {
				h, err := p.cons.Post(p.pname, idx, idx, nil)
				if errors.Is(err, ErrBusy) {
					runtime.Gosched()
					continue
				}
				require.NoError(t, err)
				st, _ := p.cons.State(h)
				require.NoError(t, p.cons.Release(h))
				if st == StateProc {
					canceled.Add(1)
				}
			}
		}(g)
	}
	wg.Wait()
	require.NotZero(t, canceled.Load(), "no release found its transfer in flight")
	require.Eventually(t, func() bool { return p.cons.tab.live.Load() == 0 }, 10*time.Second, time.Millisecond,
		"slots left after every handle was released")
	require.Equal(t, int64(0), p.cons.inflight.Load())
}

// claimAsPost claims a slot of p's consumer as Post does first, and
// returns its handle, the slot and the word the claim stored.
func claimAsPost(t *testing.T, p *testPair) (uint64, *slot, uint64) {
	t.Helper()
	h, s := p.cons.tab.claim()
	require.NotNil(t, s)
	return h, s, p.cons.tab.claimedWord(h)
}

// A slot a Post has claimed and not yet handed to the reactor is the
// Post's: Close leaves it alone, so no other Post can claim it while the
// first still fills in its request, and the first frees it itself.
func TestCloseLeavesClaimedSlotToItsPost(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{Handles: 256})
	_, s, claimed := claimAsPost(t, p)
	require.NoError(t, p.cons.Close())
	require.Equal(t, claimed, s.word.Load(), "Close changed a slot a Post still owns")
	for i := 0; i < len(p.cons.tab.slots); i++ {
		_, other := p.cons.tab.claim()
		require.NotSame(t, s, other, "a second claimer got a slot its first owner still fills in")
	}
	require.True(t, p.cons.tab.free(s, claimed), "the owner cannot free its slot")
}

// Control operations racing Close: a caller that got past the closing
// check must not write the wake-up eventfd after Close has closed it (the
// number may already name another file).
func TestControlRacingClose(t *testing.T) {
	leakcheck.Check(t)
	for round := 0; round < 30; round++ {
		r, _ := startLoopback(t, "ctl", 16, Options{})
		var wg sync.WaitGroup
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					if err := r.RemovePeer("nobody"); errors.Is(err, ErrClosed) {
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(100+round*20) * time.Microsecond)
		require.NoError(t, r.Close())
		wg.Wait()
	}
}

// A Post that has claimed a place on the submission ring and not yet
// written it holds up the drain behind it, while the Posts behind it have
// already returned their handles. Close's teardown waits for it instead of
// taking the stalled place for the end of the ring: every handle a Post
// returned is ended, and no slot stays claimed after Close.
func TestCloseWaitsForAStalledPush(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{Handles: 256})
	r := p.cons
	// The first Post stalls between claiming its place and writing it:
	// claim one by hand, through the ring's fields.
	rv := reflect.ValueOf(r.sub).Elem()
	field := func(v reflect.Value, name string) *atomic.Uint64 {
		f := v.FieldByName(name)
		require.True(t, f.IsValid(), "the ring has no field %q: update the test", name)
		return (*atomic.Uint64)(unsafe.Pointer(f.UnsafeAddr()))
	}
	pos := field(rv, "tail").Add(1) - 1
	h, err := r.Post(p.pname, []int{0}, []int{0}, nil) // the second, behind it
	require.NoError(t, err)
	published := make(chan struct{})
	go func() {
		// The stalled Post writes its place once Close has begun. (It
		// carries handle 0, which names no slot.)
		for !r.closing.Load() {
			runtime.Gosched()
		}
		time.Sleep(10 * time.Millisecond)
		slots := rv.FieldByName("slots")
		field(slots.Index(int(pos&uint64(slots.Len()-1))), "seq").Store(pos + 1)
		close(published)
	}()
	require.NoError(t, r.Close())
	<-published
	st, err := r.State(h)
	require.Equal(t, StateErr, st, "the READ behind the stalled place was not ended (%v)", err)
	require.ErrorIs(t, err, ErrClosed)
	require.Equal(t, int64(0), r.tab.live.Load(), "a slot was left claimed after Close")
}

// Control operations queued behind Close in the batch the loop drains
// report ErrClosed; they are not run against the closed engine and the
// emptied peer map.
func TestControlQueuedBehindClose(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	r := p.cons
	md := loopbackMD(t, p.prod, p.prodEng)
	descs := p.prod.loc.Load().descs
	require.NoError(t, r.RemovePeer(p.pname))
	// Hold the loop in an operation until Close's and one more are queued
	// behind it.
	block, started := make(chan struct{}), make(chan struct{})
	go func() { _ = r.do(func() error { close(started); <-block; return nil }) }()
	<-started
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	for r.ctrl.Len() < 1 {
		runtime.Gosched()
	}
	ran := false
	res := make(chan error, 1)
	go func() { // an AddPeer that passed its closing check just before Close
		res <- r.do(func() error { ran = true; _, err := r.addPeer(md, descs, nil); return err })
	}()
	for r.ctrl.Len() < 2 {
		runtime.Gosched()
	}
	close(block)
	require.NoError(t, <-closed)
	require.ErrorIs(t, <-res, ErrClosed)
	require.False(t, ran, "an operation queued behind Close ran after the teardown")
}

// A handle whose Post has claimed its slot and not yet returned is not a
// caller's: State, Wait and Release refuse it (ErrBadHandle) and leave
// the word alone, so a caller who passes a handle it was never given
// cannot cancel a READ whose request is still being written.
func TestClaimedHandleRefused(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{Handles: 256})
	h, s, claimed := claimAsPost(t, p)
	require.Equal(t, claimed, s.word.Load())

	_, err := p.cons.State(h)
	require.ErrorIs(t, err, ErrBadHandle)
	require.ErrorIs(t, p.cons.Release(h), ErrBadHandle)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.ErrorIs(t, p.cons.Wait(ctx, h), ErrBadHandle)
	require.Equal(t, claimed, s.word.Load(), "a claimed slot changed under its Post")
	require.Zero(t, p.cons.cancel.Len(), "a cancel entry queued for a claimed slot")
	require.True(t, p.cons.tab.free(s, claimed))
}

// guessHandles returns the handles the table's next claims would most
// likely get: the next generations at their home slots.
func guessHandles(tab *table, n int) []uint64 {
	var out []uint64
	g := tab.gen.Load()
	for i := 1; i <= n; i++ {
		gi := g + uint64(i)
		var kb [8]byte
		for j := range kb {
			kb[j] = byte(gi >> (8 * j))
		}
		home := xxhash.Sum64(kb[:]) & tab.mask
		out = append(out, (gi<<tab.slotBits)&tab.genMask()|home)
	}
	return out
}

// Posts racing a caller that releases the handles they are about to
// return (guessed: the next generations at their home slots), with a
// submission ring so small that Posts also fail ErrBusy after their
// handle was released: every slot is freed once, the counters balance,
// and (under the race detector) no release reaches a request still being
// written.
func TestGuessedReleasesRacingPosts(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{SubmitRing: 2, BatchSize: 1, Handles: 256})
	p.consEng.SetDelay(10 * time.Microsecond)
	stop := make(chan struct{})
	low := watchLive(p.cons, stop)
	var wg sync.WaitGroup
	var hits atomic.Int64
	deadline := time.Now().Add(time.Second)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for time.Now().Before(deadline) {
			for _, h := range guessHandles(p.cons.tab, 4) {
				if p.cons.Release(h) == nil {
					hits.Add(1)
				}
			}
		}
	}()
	var posted, busy atomic.Int64
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			idx := []int{g % 16}
			for time.Now().Before(deadline) {
				h, err := p.cons.Post(p.pname, idx, idx, []byte("guess"))
				if errors.Is(err, ErrBusy) {
					busy.Add(1)
					runtime.Gosched()
					continue
				}
				require.NoError(t, err)
				posted.Add(1)
				// Released by the guesser already, or ours to release.
				if err := p.cons.Release(h); err != nil {
					require.ErrorIs(t, err, ErrBadHandle)
				}
			}
		}(g)
	}
	wg.Wait()
	t.Logf("posted %d, busy %d, guessed releases that hit %d", posted.Load(), busy.Load(), hits.Load())
	require.Eventually(t, func() bool { return p.cons.tab.live.Load() == 0 }, 10*time.Second, time.Millisecond,
		"slots left after every handle was released")
	close(stop)
	require.GreaterOrEqual(t, <-low, int64(0), "live handles went negative")
	// A READ is counted right after it is published, and a released DONE
	// slot may be free before its READ was counted.
	require.Eventually(t, func() bool {
		st := p.cons.Stats()
		return st.ReadsPosted == st.ReadsDone+st.ReadsFailed+st.ReadsCanceled
	}, 10*time.Second, time.Millisecond, "counters do not balance: %+v", p.cons.Stats())
}
