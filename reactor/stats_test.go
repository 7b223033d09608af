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
