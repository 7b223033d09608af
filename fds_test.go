package ecxfer

import (
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// withFreeFDs runs f with the process allowed only k more descriptors
// (the soft RLIMIT_NOFILE set to the lowest free descriptor plus k), and
// restores the limit before it returns.
func withFreeFDs(t *testing.T, k int, f func()) {
	t.Helper()
	probe, err := os.Open("/dev/null")
	require.NoError(t, err)
	lowest := probe.Fd()
	require.NoError(t, probe.Close())
	var saved syscall.Rlimit
	require.NoError(t, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &saved))
	lim := saved
	lim.Cur = uint64(lowest) + uint64(k)
	require.NoError(t, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim))
	defer func() { require.NoError(t, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &saved)) }()
	f()
}

// A consumer out of file descriptors cannot add a same-host peer: the
// error says so as an engine error (with EMFILE in its chain), not as bad
// metadata or a peer that is gone, which it used to (the pidfd_open, or
// the read of the peer's start time, failing for want of a descriptor
// was taken for the peer's death). Nothing of the peer is left, and once
// descriptors are free again the same metadata adds and reads.
func TestAddRemotePeerOutOfDescriptors(t *testing.T) {
	leakcheck.Check(t)
	e := ucxEnv(t)
	prod := e.transport(uniqueName("fdprod"), 4096, 16)
	pname := prod.AgentName()
	for _, mode := range []DirectMode{DirectOn, DirectOff} {
		cons := e.transport(uniqueName("fdcons"), 4096, 16, func(c *Config) { c.Direct = mode })
		for k := range 2 { // none free; one (the pidfd opens, the start time cannot be read)
			var err error
			withFreeFDs(t, k, func() {
				_, err = cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			})
			require.ErrorIs(t, err, ErrEngine, "direct %v, %d free", mode, k)
			require.ErrorIs(t, err, syscall.EMFILE)
			require.NotErrorIs(t, err, ErrBadMetadata)
			require.NotErrorIs(t, err, ErrRemoteDisconnect)
			require.Contains(t, err.Error(), "too many open files")
			require.Zero(t, cons.Stats().Peers)
			_, err = cons.PostRead([]int{0}, pname, []int{0}, nil)
			require.ErrorIs(t, err, ErrUnknownPeer)
		}
		name, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		require.Equal(t, pname, name)
		copy(prod.Region()[4096:8192], "fds are back")
		h, err := cons.PostRead([]int{3}, pname, []int{1}, nil)
		require.NoError(t, err)
		st, err := wait(t, cons, h)
		require.NoError(t, err)
		require.Equal(t, StateDone, st)
		require.Equal(t, "fds are back", string(cons.Region()[3*4096:3*4096+12]))
		require.NoError(t, cons.ReleaseXferHandle(h))
		require.NoError(t, cons.RemoveRemotePeer(pname))
	}
}
