package reactor

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
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
