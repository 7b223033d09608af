package ucx

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// A released READ whose gets UCX cannot cancel (emulated gets the
// producer has not answered yet) keeps its local region registered:
// DeregisterMem refuses until the last get has called back, so a late
// reply never lands in memory its owner was told is free, or in memory
// that was unmapped. Then the region deregisters as usual.
func TestDeregisterWaitsForCancelledGets(t *testing.T) {
	leakcheck.Check(t)
	for _, engineMem := range []bool{false, true} {
		t.Run(map[bool]string{false: "caller memory", true: "engine memory"}[engineMem], func(t *testing.T) {
			prod := newTestAgent(t, Config{Name: "producer"})
			cons := newTestAgent(t, Config{Name: "consumer"})
			n := testBlock * testBlocks
			// Caller memory on the producer: the consumer's gets are
			// emulated and answered only when the producer progresses.
			prodBuf := mmapBuf(t, n)
			_, err := prod.RegisterMem(prodBuf, nixl.DRAM, 0)
			require.NoError(t, err)
			fillBlocks(prodBuf, testBlock, 7)
			var mem nixl.MemID
			var consBuf []byte
			if engineMem {
				mem, consBuf, err = cons.AllocMem(n, nixl.DRAM, 0)
			} else {
				consBuf = mmapBuf(t, n)
				mem, err = cons.RegisterMem(consBuf, nixl.DRAM, 0)
			}
			require.NoError(t, err)
			md, err := prod.LocalMetadata()
			require.NoError(t, err)
			peer, err := cons.LoadRemoteMetadata(md)
			require.NoError(t, err)
			local, err := cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(consBuf), testBlocks, testBlock, 0), nixl.DRAM)
			require.NoError(t, err)
			remote, err := cons.PrepDlist(peer, descriptors.BuildBlockDescs(addrOf(prodBuf), testBlocks, testBlock, 0), nixl.DRAM)
			require.NoError(t, err)

			idx := []int{0, 1, 2, 3}
			id, err := cons.MakeXfer(nixl.Read, local, idx, remote, idx, nil)
			require.NoError(t, err)
			require.NoError(t, cons.PostXfer(id))
			for range 10 {
				cons.Progress() // the gets leave; nobody answers them yet
			}
			require.NoError(t, cons.ReleaseXfer(id))
			require.NoError(t, cons.ReleaseDlist(local))
			require.Positive(t, int(cons.c.nlive), "the gets are outstanding (else this tests nothing)")
			require.ErrorIs(t, cons.DeregisterMem(mem), nixl.ErrNotAllowed,
				"deregistered with gets into it outstanding")

			deadline := time.Now().Add(10 * time.Second)
			for cons.c.nlive > 0 && time.Now().Before(deadline) {
				prod.Progress()
				cons.Progress()
				cons.PollCompletions(make([]nixl.Completion, 4))
			}
			require.Zero(t, int(cons.c.nlive), "the cancelled gets never called back")
			require.Empty(t, cons.orphans)
			require.NoError(t, cons.DeregisterMem(mem), "still refused once the gets have called back")
		})
	}
}

// Close with a peer staged and neither committed nor aborted closes it
// like a loaded one: its pidfd, endpoint and keys (with their System V
// attachments) go. (They stayed until the process exited.)
func TestCloseWithStagedPeer(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t)
	prod := newTestAgent(t, Config{Name: "producer"})
	_, _, err := prod.AllocMem(1<<20, nixl.DRAM, 0)
	require.NoError(t, err)
	md, err := prod.LocalMetadata()
	require.NoError(t, err)
	restarted := newTestAgent(t, Config{Name: "producer"})
	_, _, err = restarted.AllocMem(1<<20, nixl.DRAM, 0)
	require.NoError(t, err)
	md2, err := restarted.LocalMetadata()
	require.NoError(t, err)

	fds, sysv := fdCount(t), sysvMaps(t)
	cons, err := New(Config{Name: "consumer"})
	require.NoError(t, err)
	_, err = cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	st, err := cons.StageRemoteMetadata(md2)
	require.NoError(t, err)
	require.Greater(t, sysvMaps(t), sysv, "the staged peer's key attached its segment")
	require.NoError(t, cons.Close())
	require.Equal(t, fds, fdCount(t), "descriptors left after Close with a staged peer")
	require.Equal(t, sysv, sysvMaps(t), "System V attachments left after Close with a staged peer")
	st.Commit() // after Close: does nothing
	st.Abort()
}

// sysvMaps counts this process's System V shared-memory mappings.
func sysvMaps(t *testing.T) int {
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	return bytes.Count(b, []byte("/SYSV"))
}
