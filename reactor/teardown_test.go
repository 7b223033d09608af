package reactor

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// A notification the engine received before Close is handed out by Notifs
// after it, as Deregister promises. The loop takes notifications from the
// engine only after a turn's control operations, so one that arrived
// between two turns, with Close among the next turn's operations, was
// thrown away with the engine. Two blocking control operations hold the
// loop so that Close's teardown runs in the same batch as the second,
// after the notification arrived.
func TestNotifReceivedBeforeCloseIsKept(t *testing.T) {
	p := newPair(t, 16, Options{})
	prod := p.prod

	gate0, gate1 := make(chan struct{}), make(chan struct{})
	in0 := make(chan struct{})
	go func() { _ = prod.do(func() error { close(in0); <-gate0; return nil }) }()
	<-in0
	go func() { _ = prod.do(func() error { <-gate1; return nil }) }()
	require.Eventually(t, func() bool { return prod.ctrl.Len() == 1 }, 5*time.Second, time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- prod.Close() }()
	require.Eventually(t, func() bool { return prod.ctrl.Len() == 2 }, 5*time.Second, time.Millisecond)
	close(gate0) // this turn ends; the next runs the second operation, then the teardown
	require.Eventually(t, func() bool { return prod.ctrl.Len() == 0 }, 5*time.Second, time.Millisecond)

	h, err := p.cons.Post(p.pname, []int{0}, []int{0}, []byte("hello"))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, p.cons.Wait(ctx, h))
	// The loopback engine puts the notification straight into the
	// producer engine's inbox once the READ is DONE.
	require.Eventually(t, func() bool { return p.cons.Stats().NotifsSent == 1 }, 5*time.Second, time.Millisecond,
		"notification not sent")

	close(gate1) // the teardown runs now
	require.NoError(t, <-closed)
	got := prod.Notifs()
	require.Equal(t, [][]byte{[]byte("hello")}, got[p.cons.agent.Name()], "a notification received before Close was dropped")
	require.Equal(t, uint64(1), prod.Stats().NotifsReceived)
}

// TestStartWithoutAgent: Start with no agent is an error, and leaves no
// descriptor behind; it used to open its eventfd and epoll set and then
// panic on the agent.
func TestStartWithoutAgent(t *testing.T) {
	leakcheck.Check(t)
	r, err := Start(nil, Options{}, noSetup)
	require.Error(t, err)
	require.Nil(t, r)
}
