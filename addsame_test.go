package ecxfer

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// Adding a known peer again with the same metadata and block list answers
// with its name without opening its region again: the direct path mapped
// the region and loaded its pages anew (190 ms for a 1 GiB producer, a
// review measured) only for the reactor to find the peer known and close
// the new view. Once the peer is removed, or replaced under its name, the
// next add goes the whole way.
func TestAddSamePeerAgainOpensNothing(t *testing.T) {
	e := env{t: t, backend: "ucx"}
	pname := uniqueName("prod")
	prod := e.transport(pname, 4096, 8, direct)
	cons := e.transport(uniqueName("cons"), 4096, 8, direct)
	opens, stop := testhook.Count(&testhook.DirectOpened)
	defer stop()
	md, descs := prod.AgentMetadata(), prod.MemDescriptor()
	name, err := cons.AddRemotePeer(md, descs)
	require.NoError(t, err)
	require.Equal(t, pname, name)
	require.Contains(t, cons.PeerPath(pname), "direct")
	require.Equal(t, int64(1), opens.Load())
	for range 3 {
		again, err := cons.AddRemotePeer(md, descs)
		require.NoError(t, err)
		require.Equal(t, name, again)
	}
	require.Equal(t, int64(1), opens.Load(), "the region was opened again for a known peer")
	// The same metadata with another block list is a new list: the whole way.
	all, err := descriptors.Decode(descs)
	require.NoError(t, err)
	other, err := descriptors.Encode(all[:7])
	require.NoError(t, err)
	_, err = cons.AddRemotePeer(md, other)
	require.NoError(t, err)
	require.Equal(t, int64(2), opens.Load())
	h, err := cons.PostRead([]int{0}, pname, []int{0}, []byte("s:m"))
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
	// Removed: the next add opens the region again.
	require.NoError(t, cons.RemoveRemotePeer(pname))
	_, err = cons.AddRemotePeer(md, descs)
	require.NoError(t, err)
	require.Equal(t, int64(3), opens.Load())
}
