package ucx

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// TestTCPOnlyPeerGone: with UCX_TLS=tcp, a peer on this host gets error
// mode PEER under ErrModeAuto (shared memory, the reason for NONE, is not
// there), so a READ of a peer that went away ends in ErrRemoteDisconnect:
// "cold", the peer went before it ever progressed, with the endpoint's
// wire-up request still queued (in mode NONE UCX 1.13 then aborted the
// whole process: an assertion in its purge of pending requests), and
// "warm", after a READ had completed (in mode NONE the next READ hung).
func TestTCPOnlyPeerGone(t *testing.T) {
	for _, warm := range []bool{false, true} {
		name := map[bool]string{false: "cold", true: "warm"}[warm]
		t.Run(name, func(t *testing.T) {
			t.Setenv("UCX_TLS", "tcp")
			cons := newTestAgent(t, Config{Name: "consumer"})
			require.False(t, cons.shm)
			cbuf := mmapBuf(t, testBlock*testBlocks)
			_, err := cons.RegisterMem(cbuf, nixl.DRAM, 0)
			require.NoError(t, err)
			local, err := cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(cbuf), testBlocks, testBlock, 0), nixl.DRAM)
			require.NoError(t, err)
			prod, err := New(Config{Name: "producer"})
			require.NoError(t, err)
			_, buf, err := prod.AllocMem(testBlock*testBlocks, nixl.DRAM, 0)
			require.NoError(t, err)
			fillBlocks(buf, testBlock, 5)
			md, err := prod.LocalMetadata()
			require.NoError(t, err)
			peer, err := cons.LoadRemoteMetadata(md)
			require.NoError(t, err)
			require.True(t, cons.peers[peer].peerMode, "same host, no shared memory: mode PEER")
			remote, err := cons.PrepDlist(peer, descriptors.BuildBlockDescs(addrOf(buf), testBlocks, testBlock, 0), nixl.DRAM)
			require.NoError(t, err)
			read := func() nixl.XferID {
				id, err := cons.MakeXfer(nixl.Read, local, []int{0}, remote, []int{3}, nil)
				require.NoError(t, err)
				require.NoError(t, cons.PostXfer(id))
				return id
			}
			if warm {
				id := read()
				require.NoError(t, waitXfer(t, cons, id, 10*time.Second, prod))
				require.Equal(t, -1, checkBlock(cbuf[:testBlock], 5, 3))
				cons.ReleaseXfer(id)
			}
			var id nixl.XferID
			if !warm {
				id = read()
				for range 100 {
					_, err := cons.Progress()
					require.NoError(t, err)
				}
			}
			require.NoError(t, prod.Close())
			if warm {
				id = read()
			}
			err = waitXfer(t, cons, id, 20*time.Second)
			require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
			cons.ReleaseXfer(id)
			require.NoError(t, cons.ReleaseDlist(remote))
			require.NoError(t, cons.InvalidateRemoteMetadata(peer))
		})
	}
}

// TestSharedMemoryKeepsModeNone: with UCX's default transports a peer on
// this host keeps mode NONE, which shared memory needs in UCX 1.13.
func TestSharedMemoryKeepsModeNone(t *testing.T) {
	withSharedMemory(t)
	p := newPair(t, true)
	require.True(t, p.cons.shm)
	require.False(t, p.cons.peers[p.peer].peerMode)
}

// TestTCPOnlyOneEnd: when only one end's UCX has no shared memory, both
// ends still pick mode PEER (the metadata says which lacks it; UCX refuses
// a connection between the two modes): a READ with a notification between
// two processes works either way round, bytes verified.
func TestTCPOnlyOneEnd(t *testing.T) {
	for _, c := range []struct{ name, consTLS, prodTLS string }{
		{"consumer-tcp", "tcp", "all"},
		{"producer-tcp", "all", "tcp"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ch := startChild(t, childOpts{name: "prod", seed: 12, blocks: 64, alloc: true, tls: c.prodTLS})
			t.Setenv("UCX_TLS", c.consTLS)
			cons := newConsumer(t, Config{Name: "cons"}, 64, testBlock)
			require.Equal(t, c.consTLS != "tcp", cons.a.shm)
			cons.connect(t, ch)
			require.True(t, cons.a.peers[cons.peer].peerMode, "one end without shared memory: PEER at both")
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
