package ucx

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// A notification that arrives by rendezvous is dropped by the receiver's
// handler; DroppedNotifs counts it, GetNotifs never returns it, and eager
// notifications still get through.
func TestDroppedNotifs(t *testing.T) {
	leakcheck.Check(t)
	recv := newTestAgent(t, Config{Name: "receiver"})
	rndv := newTestAgent(t, Config{Name: "rndv-sender", rndvNotifs: true})
	eager := newTestAgent(t, Config{Name: "eager-sender"})
	md, err := recv.LocalMetadata()
	require.NoError(t, err)
	for _, s := range []*Agent{rndv, eager} {
		_, err = s.LoadRemoteMetadata(md)
		require.NoError(t, err)
	}
	var _ nixl.NotifDropper = recv
	require.Zero(t, recv.DroppedNotifs())

	const sent = 3
	for i := 0; i < sent; i++ {
		require.NoError(t, rndv.SendNotif("receiver", []byte("by rendezvous")))
	}
	got := map[string][][]byte{}
	deadline := time.Now().Add(5 * time.Second)
	for recv.DroppedNotifs() < sent && time.Now().Before(deadline) {
		_, err := rndv.Progress()
		require.NoError(t, err)
		_, err = recv.Progress()
		require.NoError(t, err)
		recv.GetNotifs(got)
	}
	require.Equal(t, uint64(sent), recv.DroppedNotifs())
	require.Empty(t, got)

	require.NoError(t, eager.SendNotif("receiver", []byte("eager")))
	require.Equal(t, map[string][][]byte{"eager-sender": {[]byte("eager")}},
		collectNotifs(t, recv, 1, 5*time.Second, eager, rndv))
	require.Equal(t, uint64(sent), recv.DroppedNotifs(), "an eager notification is not dropped")
	require.Zero(t, rndv.DroppedNotifs())

	require.NoError(t, recv.Close())
	require.Equal(t, uint64(sent), recv.DroppedNotifs(), "kept after Close")
}

// The receiving handler refuses a notification longer than any engine may
// be configured for (1 MiB), whatever the sender declares: it is counted
// as dropped and never copied (lengths near 4 GiB used to reach GoBytes as
// negative ints and panic on the reactor thread). One at the limit gets
// through.
func TestOversizedNotifsDropped(t *testing.T) {
	leakcheck.Check(t)
	recv := newTestAgent(t, Config{Name: "receiver", MaxNotif: enginekit.MaxNotifLimit})
	big := newTestAgent(t, Config{Name: "big-sender", MaxNotif: enginekit.MaxNotifLimit, oversizeNotifs: true})
	md, err := recv.LocalMetadata()
	require.NoError(t, err)
	_, err = big.LoadRemoteMetadata(md)
	require.NoError(t, err)

	require.NoError(t, big.SendNotif("receiver", make([]byte, enginekit.MaxNotifLimit+1)))
	got := map[string][][]byte{}
	deadline := time.Now().Add(10 * time.Second)
	for recv.DroppedNotifs() < 1 && time.Now().Before(deadline) {
		_, err := big.Progress()
		require.NoError(t, err)
		_, err = recv.Progress()
		require.NoError(t, err)
		recv.GetNotifs(got)
	}
	require.Equal(t, uint64(1), recv.DroppedNotifs())
	require.Empty(t, got)

	require.NoError(t, big.SendNotif("receiver", make([]byte, enginekit.MaxNotifLimit)))
	n := collectNotifs(t, recv, 1, 10*time.Second, big)
	require.Len(t, n["big-sender"], 1)
	require.Len(t, n["big-sender"][0], enginekit.MaxNotifLimit)
	require.Equal(t, uint64(1), recv.DroppedNotifs())
}

// A producer that sleeps on EventFD without a timeout whenever a turn
// finds no work (a parked reactor) is woken by every notification, with
// and without an endpoint of its own to the consumer. An interface none of
// its endpoints uses (a producer's shared-memory interface when it has no
// endpoint back) is one UCP leaves to its async thread and to a re-arming
// callback that needs two progress calls after each wake-up; Arm used to
// arm the worker after the first, and once that happened no notification
// woke the sleeper again (here: none arrived).
func TestParkedProducerWokenByNotifs(t *testing.T) {
	leakcheck.Check(t)
	for _, tc := range tlsCases[:3] {
		for _, back := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/back-endpoint=%v", tc.name, back), func(t *testing.T) {
				t.Setenv("UCX_TLS", tc.tls)
				ch := startChild(t, childOpts{name: "prod", seed: 3, alloc: tc.alloc, tls: tc.tls, errMode: tc.errMode, park: true})
				c := newConsumer(t, Config{Name: "cons", ErrMode: tc.errMode}, testBlocks, testBlock)
				if back {
					c.connect(t, ch)
				} else {
					c.connectOneWay(t, ch)
				}
				for i := range 40 {
					msg := []byte(fmt.Sprintf("notif %d", i))
					if i%2 == 0 {
						idx := []int{i % testBlocks}
						clear(c.buf)
						require.NoError(t, c.read(t, idx, idx, msg))
						c.verify(t, 3, idx, idx)
					} else {
						require.NoError(t, c.a.SendNotif(c.peer, msg))
					}
					name, got, ok := ch.tryNotif(c.a, 10*time.Second)
					if !ok {
						// Tell a lost wake-up (the message waits in the
						// child's queue) from a lost message.
						ch.wake()
						if _, late, ok := ch.tryNotif(c.a, 2*time.Second); ok {
							t.Fatalf("notification %d (%q) arrived only once the parked child was woken by a command: its wake-up was lost", i, late)
						}
						t.Fatalf("notification %d never arrived, not even after waking the child", i)
					}
					require.Equal(t, "cons", name)
					require.Equal(t, msg, got)
					if i%4 < 2 {
						// Let the producer fall asleep before the next one.
						time.Sleep(2 * time.Millisecond)
					}
				}
			})
		}
	}
}
