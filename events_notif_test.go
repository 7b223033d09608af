package ecxfer

import (
	"bytes"
	"context"
	"fmt"
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

// postingHandler posts n one-block READs of the peer it is told of, each
// with a notification too long for the caller to send itself, from the
// handler of the consumer's peer-added record: on the reactor thread,
// which alone drains the queue such notifications wait in.
type postingHandler struct {
	tr    atomic.Pointer[Transport]
	peer  string
	n     int
	errs  chan error
	fired atomic.Bool
}

func (h *postingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *postingHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *postingHandler) WithGroup(string) slog.Handler            { return h }

func (h *postingHandler) Handle(_ context.Context, r slog.Record) error {
	t := h.tr.Load()
	if r.Message != EventPeerAdded || t == nil || h.fired.Swap(true) {
		return nil
	}
	h.errs <- h.post(t)
	return nil
}

func (h *postingHandler) post(t *Transport) error {
	for i := 0; i < h.n; i++ {
		msg := make([]byte, 1000)
		copy(msg, fmt.Sprintf("n-%d", i))
		hd, err := t.PostRead([]int{i % 8}, h.peer, []int{i % 8}, msg)
		if err != nil {
			return err
		}
		st, err := t.CheckXferState(hd)
		if err == nil && st != StateDone {
			err = fmt.Errorf("READ %d not copied inline: %v", i, st)
		}
		if rerr := t.ReleaseXferHandle(hd); err == nil {
			err = rerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// TestHandlerPostsBeyondTheNotifQueue: a handler on the consumer's
// reactor thread posts more inline READs with notifications than the
// queue they wait in holds (one place per handle: 256 here). The Post
// that found it full waited for the thread to drain it, on that thread:
// the reactor hung for good. Every notification now arrives, once, in
// order.
func TestHandlerPostsBeyondTheNotifQueue(t *testing.T) {
	e := env{t: t, backend: "ucx"}
	pname := uniqueName("prod")
	const n = 1000
	h := &postingHandler{peer: pname, n: n, errs: make(chan error, 1)}
	prod := e.transport(pname, 4096, 8, direct)
	cons := e.transport(uniqueName("cons"), 4096, 8, direct, func(c *Config) {
		c.Logger = slog.New(h)
		c.Reactor.Handles = 256
	})
	h.tr.Store(cons)
	added := make(chan error, 1)
	go func() {
		_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		added <- err
	}()
	select {
	case err := <-h.errs:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the handler's Posts never returned: the reactor thread waits for itself")
	}
	require.NoError(t, <-added)
	require.Contains(t, cons.PeerPath(pname), "direct")
	var got [][]byte
	deadline := time.Now().Add(20 * time.Second)
	for len(got) < n && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		m, _ := prod.WaitNotifs(ctx)
		cancel()
		got = append(got, m[cons.AgentName()]...)
	}
	require.Len(t, got, n)
	for i, msg := range got {
		require.Equal(t, fmt.Sprintf("n-%d", i), string(bytes.TrimRight(msg, "\x00")), "notification %d", i)
	}
	require.Equal(t, uint64(n), cons.Stats().NotifsSent)
}
