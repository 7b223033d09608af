package ecxfer

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// drainingHandler calls NewNotifs on the transport it logs for when it
// gets an oversized-notification record, as a handler may (README), and
// reports whether the call returned.
type drainingHandler struct {
	tr       atomic.Pointer[Transport]
	returned chan bool
}

func (h *drainingHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *drainingHandler) Handle(_ context.Context, r slog.Record) error {
	t := h.tr.Load()
	if r.Message != EventNotifOversized || t == nil {
		return nil
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-done:
			h.returned <- true
		case <-time.After(5 * time.Second):
			h.returned <- false
		}
	}()
	_ = t.NewNotifs()
	close(done)
	return nil
}

func (h *drainingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *drainingHandler) WithGroup(string) slog.Handler      { return h }

// TestHandlerDrainsNotifsOnOversized: a notification longer than the
// producer's MaxNotif, on the direct path's socket, is logged
// (ecxfer.notif.oversized) to a handler that calls NewNotifs. The record
// used to be written while the reactor thread held the socket's receive
// lock, which NewNotifs takes: the thread waited for itself for good.
func TestHandlerDrainsNotifsOnOversized(t *testing.T) {
	e := env{t: t, backend: "ucx"}
	h := &drainingHandler{returned: make(chan bool, 4)}
	pname := uniqueName("prod")
	prod := e.transport(pname, 4096, 8, direct, func(c *Config) {
		c.Logger = slog.New(h)
		c.Reactor.MaxNotif = 100
	})
	h.tr.Store(prod)
	cons := e.transport(uniqueName("cons"), 4096, 8, direct)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	require.Contains(t, cons.PeerPath(pname), "direct")
	hd, err := cons.PostRead([]int{0}, pname, []int{1}, make([]byte, 200))
	require.NoError(t, err)
	st, err := wait(t, cons, hd)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(hd))
	select {
	case ok := <-h.returned:
		require.True(t, ok, "NewNotifs from the handler did not return")
	case <-time.After(10 * time.Second):
		t.Fatal("no oversized event")
	}
	require.Equal(t, uint64(1), prod.Stats().NotifsOversized)
	// The reactor thread goes on: a READ of the producer's own and its
	// notification still work.
	h.tr.Store(nil)
	hd, err = cons.PostRead([]int{2}, pname, []int{3}, []byte("s:h"))
	require.NoError(t, err)
	st, err = wait(t, cons, hd)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(hd))
	require.Eventually(t, func() bool { return len(prod.NewNotifs()[cons.cfg.AgentName]) == 1 }, 10*time.Second, time.Millisecond)
}
