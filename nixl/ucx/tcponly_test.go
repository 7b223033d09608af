package ucx

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestTCPOnlyOneEnd: UCX_TLS=tcp at one end only, two processes on one
// host: both ends keep error mode NONE (UCX refuses a connection between
// NONE and PEER), and a READ with a notification works either way round,
// over tcp, bytes verified.
func TestTCPOnlyOneEnd(t *testing.T) {
	for _, c := range []struct{ name, consTLS, prodTLS string }{
		{"consumer-tcp", "tcp", "all"},
		{"producer-tcp", "all", "tcp"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ch := startChild(t, childOpts{name: "prod", seed: 12, blocks: 64, alloc: true, tls: c.prodTLS})
			t.Setenv("UCX_TLS", c.consTLS)
			cons := newConsumer(t, Config{Name: "cons"}, 64, testBlock)
			cons.connect(t, ch)
			require.False(t, cons.a.peers[cons.peer].peerMode, "same host: mode NONE at both ends")
			local, remote := []int{0, 1, 2}, []int{9, 3, 40}
			require.NoError(t, cons.read(t, local, remote, []byte("session:one-end")))
			cons.verify(t, 12, local, remote)
			select {
			case f := <-ch.notifs:
				require.Contains(t, string(f.b), "session:one-end")
			case <-time.After(10 * time.Second):
				t.Fatal("the notification never reached the producer")
			}
		})
	}
}
