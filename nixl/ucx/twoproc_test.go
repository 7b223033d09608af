package ucx

import (
	"math/rand"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

type tlsCase struct {
	name    string
	tls     string
	errMode ErrMode
	alloc   bool
}

var tlsCases = []tlsCase{
	{"shm/allocated", "shm", ErrModeAuto, true},
	{"shm/registered", "shm", ErrModeAuto, false},
	{"tcp/allocated", "tcp", ErrModeAuto, true}, // tcp alone at both ends: PEER
	{"tcp/peer-mode", "tcp", ErrModePeer, true},
	{"tcp/none-mode", "tcp", ErrModeNone, true},
}

func TestTwoProcessRead(t *testing.T) {
	leakcheck.Check(t)
	const blocks = 512
	for _, tc := range tlsCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("UCX_TLS", tc.tls)
			ch := startChild(t, childOpts{name: "prod", seed: 11, blocks: blocks, alloc: tc.alloc, tls: tc.tls, errMode: tc.errMode})
			c := newConsumer(t, Config{Name: "cons", ErrMode: tc.errMode}, blocks, testBlock)
			c.connect(t, ch)
			p := c.a.peers[c.peer]
			require.Equal(t, tc.errMode == ErrModePeer || tc.errMode == ErrModeAuto && tc.tls == "tcp", p.peerMode)
			require.GreaterOrEqual(t, p.pidfd, 0, "same host: pidfd watch")

			seq := make([]int, blocks)
			for i := range seq {
				seq[i] = i
			}
			rev := slices.Clone(seq)
			slices.Reverse(rev)
			rng := rand.New(rand.NewSource(5))
			perm := rng.Perm(blocks)
			cases := []struct {
				name          string
				local, remote []int
			}{
				{"contiguous", seq, seq},
				{"scattered", seq, perm},
				{"scattered-both", rng.Perm(blocks), perm},
				{"reversed", seq, rev},
			}
			for i, rc := range cases {
				clear(c.buf)
				notif := []byte("read " + rc.name)
				require.NoError(t, c.read(t, rc.local, rc.remote, notif), rc.name)
				c.verify(t, 11, rc.local, rc.remote)
				name, msg := ch.nextNotif(c.a, 10*time.Second)
				require.Equal(t, "cons", name, "notification key, read %d", i)
				require.Equal(t, notif, msg)
			}
		})
	}
}

// TestTwoProcessCancel releases a READ while it is in flight (the producer
// is stalled, so its emulated gets cannot complete), checks it is never
// reported and sends no notification, and that the agent keeps working.
func TestTwoProcessCancel(t *testing.T) {
	leakcheck.Check(t)
	t.Setenv("UCX_TLS", "shm")
	ch := startChild(t, childOpts{name: "prod", seed: 3, blocks: 256, tls: "shm"})
	c := newConsumer(t, Config{Name: "cons"}, 256, testBlock)
	c.connect(t, ch)
	idx := rand.New(rand.NewSource(9)).Perm(256)

	ch.command('S', nil, c.a)
	id, err := c.a.MakeXfer(nixl.Read, c.local, idx, c.remote, idx, []byte("cancelled"))
	require.NoError(t, err)
	require.NoError(t, c.a.PostXfer(id))
	for i := 0; i < 100; i++ {
		_, _ = c.a.Progress()
	}
	done, err := c.a.XferStatus(id)
	require.NoError(t, err)
	require.False(t, done, "stalled producer: the read must still be in flight")
	require.NoError(t, c.a.ReleaseXfer(id))
	_, err = c.a.XferStatus(id)
	require.ErrorIs(t, err, nixl.ErrNotFound)
	ch.command('R', nil, c.a)

	// The cancelled request's operations drain; nothing is reported.
	var comp [8]nixl.Completion
	deadline := time.Now().Add(5 * time.Second)
	for c.a.c.nlive > 0 && time.Now().Before(deadline) {
		_, _ = c.a.Progress()
		require.Zero(t, c.a.PollCompletions(comp[:]))
	}
	require.Zero(t, uint64(c.a.c.nlive), "C requests freed")
	ch.noNotif(c.a, 200*time.Millisecond)

	require.NoError(t, c.read(t, idx[:10], idx[:10], []byte("after")))
	c.verify(t, 3, idx[:10], idx[:10])
	_, msg := ch.nextNotif(c.a, 5*time.Second)
	require.Equal(t, []byte("after"), msg)
}

// TestTwoProcessInvalidateRestart: in-flight reads end in
// ErrRemoteDisconnect on invalidation; a restarted producer under the same
// name is refused until the old one is invalidated, then reloaded.
func TestTwoProcessInvalidateRestart(t *testing.T) {
	leakcheck.Check(t)
	t.Setenv("UCX_TLS", "shm")
	ch := startChild(t, childOpts{name: "prod", seed: 1, blocks: 128, tls: "shm"})
	c := newConsumer(t, Config{Name: "cons"}, 128, testBlock)
	c.connect(t, ch)
	idx := rand.New(rand.NewSource(2)).Perm(128)
	require.NoError(t, c.read(t, idx, idx, nil))
	c.verify(t, 1, idx, idx)

	ch.command('S', nil, c.a)
	id, err := c.a.MakeXfer(nixl.Read, c.local, idx, c.remote, idx, []byte("x"))
	require.NoError(t, err)
	require.NoError(t, c.a.PostXfer(id))
	_, _ = c.a.Progress()

	ch2 := startChild(t, childOpts{name: "prod", seed: 2, blocks: 128, tls: "shm"})
	name, err := c.a.LoadRemoteMetadata(ch2.md)
	require.ErrorIs(t, err, nixl.ErrNotAllowed)
	require.Equal(t, "prod", name)

	require.NoError(t, c.a.InvalidateRemoteMetadata("prod"))
	var comp [4]nixl.Completion
	n := c.a.PollCompletions(comp[:])
	require.Equal(t, 1, n)
	require.Equal(t, id, comp[0].ID)
	require.ErrorIs(t, comp[0].Err, nixl.ErrRemoteDisconnect)
	done, err := c.a.XferStatus(id)
	require.True(t, done)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	require.ErrorIs(t, c.a.PostXfer(id), nixl.ErrRemoteDisconnect)
	require.NoError(t, c.a.ReleaseXfer(id))
	ch.command('R', nil, c.a)
	ch.stop()

	c.connect(t, ch2)
	var msg []byte
	require.NoError(t, c.read(t, idx, idx, []byte("new")))
	c.verify(t, 2, idx, idx)
	name, msg = ch2.nextNotif(c.a, 5*time.Second)
	require.Equal(t, "cons", name)
	require.Equal(t, []byte("new"), msg)
}

// TestTwoProcessKill: SIGKILL a producer while reads are in flight; they end
// in ErrRemoteDisconnect within a second.
func TestTwoProcessKill(t *testing.T) {
	leakcheck.Check(t)
	cases := []struct {
		name    string
		tls     string
		errMode ErrMode
		noPidfd bool
	}{
		{"shm/pidfd", "shm", ErrModeAuto, false},
		{"tcp/pidfd", "tcp", ErrModeAuto, false},
		{"tcp/peer-mode-callback", "tcp", ErrModePeer, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("UCX_TLS", tc.tls)
			const blocks = 256
			ch := startChild(t, childOpts{name: "prod", seed: 4, blocks: blocks, tls: tc.tls, errMode: tc.errMode})
			c := newConsumer(t, Config{Name: "cons", ErrMode: tc.errMode, noPidfd: tc.noPidfd}, blocks, testBlock)
			c.connect(t, ch)
			idx := rand.New(rand.NewSource(2)).Perm(blocks)
			require.NoError(t, c.read(t, idx[:4], idx[:4], nil))

			ch.command('S', nil, c.a)
			var ids []nixl.XferID
			for k := 0; k < 4; k++ {
				part := idx[k*64 : (k+1)*64]
				id, err := c.a.MakeXfer(nixl.Read, c.local, part, c.remote, part, []byte("never"))
				require.NoError(t, err)
				require.NoError(t, c.a.PostXfer(id))
				ids = append(ids, id)
			}
			for i := 0; i < 100; i++ {
				_, _ = c.a.Progress()
			}
			for _, id := range ids {
				done, err := c.a.XferStatus(id)
				require.NoError(t, err)
				require.False(t, done)
			}
			// Park on the event fd, as a reactor would: the death must wake
			// it. Over shm the worker stays busy (the stalled producer leaves
			// operations pending) and cannot be armed; the pidfd in the epoll
			// set must still report the death.
			armed := false
			for i := 0; i < 1000 && !armed; i++ {
				var err error
				armed, err = c.a.Arm()
				require.NoError(t, err)
				if !armed {
					_, _ = c.a.Progress()
				}
			}
			if tc.tls == "tcp" {
				require.True(t, armed, "Arm")
			}
			pidfd := c.a.peers[c.peer].pidfd
			ch.kill()
			start := time.Now()
			ev := make([]unix.EpollEvent, 8)
			for woken := false; !woken; {
				require.Less(t, time.Since(start), 2*time.Second, "parked agent not woken by the death")
				n, err := unix.EpollWait(c.a.EventFD(), ev, 2000)
				if err == unix.EINTR {
					continue
				}
				require.NoError(t, err)
				for _, e := range ev[:n] {
					if pidfd < 0 || int(e.Fd) == pidfd {
						woken = true
					}
				}
			}
			t.Logf("%s: woken %v after SIGKILL", tc.name, time.Since(start))
			got := map[nixl.XferID]error{}
			var comp [8]nixl.Completion
			for len(got) < len(ids) && time.Since(start) < 5*time.Second {
				_, err := c.a.Progress()
				require.NoError(t, err)
				n := c.a.PollCompletions(comp[:])
				for _, cp := range comp[:n] {
					got[cp.ID] = cp.Err
				}
			}
			elapsed := time.Since(start)
			require.Len(t, got, len(ids))
			for _, id := range ids {
				require.ErrorIs(t, got[id], nixl.ErrRemoteDisconnect)
			}
			require.Less(t, elapsed, time.Second, "death noticed in %v", elapsed)
			t.Logf("%s: in-flight reads failed %v after SIGKILL", tc.name, elapsed)
			for _, id := range ids {
				require.NoError(t, c.a.ReleaseXfer(id))
			}
			require.NoError(t, c.a.InvalidateRemoteMetadata("prod"))
		})
	}
}

// A READ of 32 MiB from a same-host peer's segment goes out in 4 MiB
// rounds, the later ones from Progress. The peer is killed and reaped
// right after PostXfer: the rounds posted after that copy what the dead
// process left behind, so the READ must not end DONE. (It did: only
// PostXfer polled the pidfd, and Progress only every 64th call after
// LivenessPoll.)
func TestMultiRoundReadAfterDeath(t *testing.T) {
	leakcheck.Check(t)
	const block, blocks = 1 << 20, 32
	idx := make([]int, blocks)
	for i := range idx {
		idx[i] = i
	}
	for run := range 3 {
		ch := startChild(t, childOpts{name: "prod", seed: 3, block: block, blocks: blocks, alloc: true})
		c := newConsumer(t, Config{Name: "cons"}, blocks, block)
		c.connect(t, ch)
		id, err := c.a.MakeXfer(nixl.Read, c.local, idx, c.remote, idx, nil)
		require.NoError(t, err)
		require.NoError(t, c.a.PostXfer(id))
		require.True(t, c.a.xfers[id].recheck, "run %d: the READ went out in one round", run)
		ch.kill() // SIGKILL and reaped: the pidfd is readable from here on
		var comp [4]nixl.Completion
		var got *nixl.Completion
		for calls := 0; got == nil && calls < 100000; calls++ {
			_, _ = c.a.Progress()
			for _, cp := range comp[:c.a.PollCompletions(comp[:])] {
				if cp.ID == id {
					got = &cp
				}
			}
		}
		require.NotNil(t, got, "run %d: the READ never ended", run)
		require.ErrorIs(t, got.Err, nixl.ErrRemoteDisconnect, "run %d", run)
		require.NoError(t, c.a.ReleaseXfer(id))
	}
}

// A reactor's turn may post READs and take completions and notifications
// without progressing the engine (callers step in for it). The pidfd
// poll that PostXfer makes once per round must not carry over such a
// turn: a same-host producer reaped after one READ was posted would serve
// the next READ from the segment it left behind, and that READ ended
// DONE (the pidfd was polled only once per Progress).
func TestReadAfterDeathWithoutProgress(t *testing.T) {
	leakcheck.Check(t)
	ch := startChild(t, childOpts{name: "prod", seed: 5, blocks: 16, alloc: true})
	c := newConsumer(t, Config{Name: "cons"}, 16, testBlock)
	c.connect(t, ch)
	var comp [4]nixl.Completion
	first, err := c.a.MakeXfer(nixl.Read, c.local, []int{0}, c.remote, []int{1}, nil)
	require.NoError(t, err)
	second, err := c.a.MakeXfer(nixl.Read, c.local, []int{2}, c.remote, []int{3}, nil)
	require.NoError(t, err)
	_, _ = c.a.Progress()
	require.NoError(t, c.a.PostXfer(first)) // polls the pidfd: alive
	ch.kill()                               // SIGKILL and reaped
	// A turn without progress: completions and notifications taken.
	c.a.PollCompletions(comp[:])
	c.a.GetNotifs(map[string][][]byte{})
	if err := c.a.PostXfer(second); err != nil {
		require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	} else {
		var got *nixl.Completion
		for calls := 0; got == nil && calls < 100000; calls++ {
			_, _ = c.a.Progress()
			for _, cp := range comp[:c.a.PollCompletions(comp[:])] {
				if cp.ID == second {
					got = &cp
				}
			}
		}
		require.NotNil(t, got, "the READ never ended")
		require.ErrorIs(t, got.Err, nixl.ErrRemoteDisconnect, "a READ posted after the producer was reaped")
	}
	require.NoError(t, c.a.ReleaseXfer(first))
	require.NoError(t, c.a.ReleaseXfer(second))
}
