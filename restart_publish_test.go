package ecxfer

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// On an engine that cannot load a restarted peer's new metadata beside the
// old (loopback here, libnixl in life), the old is dropped first. It stays
// known, by name, until the new replaces it: PeerStats (and so a scrape)
// never sees the name missing, so the peer keeps its per-peer series'
// place (metrics.WithPeers). It used to vanish for that moment, and a
// scrape then gave its place to another peer for good.
func TestRestartKeepsPeerKnown(t *testing.T) {
	e := env{t: t, backend: "loopback"}
	pname := uniqueName("prod")
	p1 := e.transport(pname, 512, 16)
	cons := e.transport(uniqueName("cons"), 512, 16)
	_, err := cons.AddRemotePeer(p1.AgentMetadata(), p1.MemDescriptor())
	require.NoError(t, err)
	require.NoError(t, p1.Deregister())
	p2 := e.transport(pname, 512, 16)

	var known []bool
	look := func() {
		found := false
		for _, s := range cons.PeerStats(nil) {
			found = found || s.Name == pname
		}
		known = append(known, found)
	}
	testhook.RestartDropped.Store(&look)
	defer testhook.RestartDropped.Store(nil)
	_, err = cons.AddRemotePeer(p2.AgentMetadata(), p2.MemDescriptor())
	require.NoError(t, err)
	require.Equal(t, []bool{true}, known, "the peer was looked at once, dropped for its restart: still known")
	h, err := cons.PostRead([]int{0}, pname, []int{1}, nil)
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
	require.Equal(t, 1, cons.Stats().Peers)
}

// A restarted peer whose new metadata is then refused (here its block
// list lies outside its region) on such an engine is gone, as before, and
// now says so: ecxfer.peer.removed with why. It used to leave without an
// event. Its READ in flight fails with ErrRemoteDisconnect either way.
func TestRestartRefusedOnNonStagingEngineSaysSo(t *testing.T) {
	log := newEventLog()
	e := env{t: t, backend: "loopback"}
	pname := uniqueName("prod")
	p1 := e.transport(pname, 512, 16)
	cons := e.transport(uniqueName("cons"), 512, 16, func(c *Config) { c.Logger = slog.New(log) })
	_, err := cons.AddRemotePeer(p1.AgentMetadata(), p1.MemDescriptor())
	require.NoError(t, err)
	engine(t, cons).SetDelay(time.Hour)
	h, err := cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	require.NoError(t, p1.Deregister())
	p2 := e.transport(pname, 512, 16)
	descs, err := descriptors.Decode(p2.MemDescriptor())
	require.NoError(t, err)
	for i := range descs {
		descs[i].Addr += 1 << 40 // outside its region
	}
	bad, err := descriptors.Encode(descs)
	require.NoError(t, err)
	_, err = cons.AddRemotePeer(p2.AgentMetadata(), bad)
	require.ErrorIs(t, err, ErrBadDescriptor)
	st, err := wait(t, cons, h)
	require.Equal(t, StateErr, st)
	require.ErrorIs(t, err, ErrRemoteDisconnect)
	require.NoError(t, cons.ReleaseXferHandle(h))
	engine(t, cons).SetDelay(0)
	require.Equal(t, 0, cons.Stats().Peers)
	require.Empty(t, cons.PeerStats(nil))
	removed := log.eventually(t, EventPeerRemoved, 1)
	require.Equal(t, pname, removed[0].attrs["peer"].String())
	require.Equal(t, "restarted, and its new metadata was refused", removed[0].attrs["why"].String())
	require.Contains(t, removed[0].attrs, "reads_canceled")
	require.Empty(t, log.named(EventPeerReplaced))
	// Added again with a good list, it is a peer again.
	_, err = cons.AddRemotePeer(p2.AgentMetadata(), p2.MemDescriptor())
	require.NoError(t, err)
	require.Equal(t, 1, cons.Stats().Peers)
}
