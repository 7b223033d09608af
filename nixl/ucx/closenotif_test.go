package ucx

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// Notifications SendNotif accepted (the reactor sends a READ's once it is
// DONE) reach the peer even when Close comes right after them, before the
// peer has taken any: Close flushes the endpoints before it abandons
// (mode NONE) or force-closes (mode PEER) them. The notifications are
// large, so they are still queued or in UCX's buffers at Close.
func TestCloseDeliversSentNotifs(t *testing.T) {
	leakcheck.Check(t)
	for _, mode := range []ErrMode{ErrModeNone, ErrModePeer} {
		t.Run(fmt.Sprint(mode), func(t *testing.T) {
			prod := newTestAgent(t, Config{Name: "producer", ErrMode: mode})
			cons, err := New(Config{Name: "consumer", ErrMode: mode})
			require.NoError(t, err)
			_, _, err = prod.AllocMem(1<<20, nixl.DRAM, 0)
			require.NoError(t, err)
			md, err := prod.LocalMetadata()
			require.NoError(t, err)
			_, err = cons.LoadRemoteMetadata(md)
			require.NoError(t, err)
			require.NoError(t, cons.SendNotif("producer", []byte("hello"))) // connects
			collectNotifs(t, prod, 1, 5*time.Second, cons)
			// 16 x 60 KiB: more than the shared-memory receive queue
			// takes at once, so some are still queued at Close. What is
			// tested is that Close flushes them before it lets the
			// endpoint go, not how fast: on a loaded machine under the
			// race detector 250 ms (closeWait) once saw 8 of 64 through,
			// so Close may take up to 10 s here (it returns as soon as
			// the flush is done).
			old := closeWait
			closeWait = 10 * time.Second
			t.Cleanup(func() { closeWait = old })
			const n = 16
			for i := range n {
				msg := make([]byte, 60<<10)
				copy(msg, fmt.Sprintf("notif %d", i))
				require.NoError(t, cons.SendNotif("producer", msg))
			}
			// The producer progresses only from here, beside Close.
			done := make(chan error, 1)
			go func() { done <- cons.Close() }()
			got := map[string][][]byte{}
			k := 0
			for deadline := time.Now().Add(10 * time.Second); k < n && time.Now().Before(deadline); {
				prod.Progress()
				k += prod.GetNotifs(got)
			}
			require.NoError(t, <-done)
			require.Equal(t, n, k, "notifications lost at Close")
			for i, m := range got["consumer"] {
				require.Equal(t, fmt.Sprintf("notif %d", i), string(m[:len(fmt.Sprintf("notif %d", i))]))
			}
		})
	}
}
