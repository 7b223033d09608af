package metrics_test

import (
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/metrics"
)

// The Exporter's and the options' hostile cases: addresses it cannot
// listen on, a transport added twice, two transports of one name, removals
// of what was never added, WithPeers bounds that are no bound, Close twice,
// a transport deregistered while it is served. Nothing leaks.
func TestExporterHostile(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	for _, addr := range []string{"not an address", "127.0.0.1:99999", "256.0.0.1:0", "127.0.0.1:-1"} {
		ex, err := metrics.Listen(addr)
		require.Error(t, err, "%q", addr)
		require.Nil(t, ex)
	}
	ex, err := metrics.Listen("127.0.0.1:0")
	require.NoError(t, err)
	busy, err := metrics.Listen(ex.Addr())
	require.Error(t, err, "a port in use")
	require.Nil(t, busy)

	a := newTransport(t, "loopback", name("hx"))
	b := newTransport(t, "loopback", name("hx"))
	// A ucx transport of a's name: loopback names are unique in a process.
	twin, err := ecxfer.New(ecxfer.Config{AgentName: a.AgentName(), Backend: "ucx", BlockSize: 4096, NumBlocks: 32})
	require.NoError(t, err)
	defer func() { require.NoError(t, twin.Deregister()) }()

	require.False(t, ex.Remove(a), "never added")
	require.NoError(t, ex.Add(a, metrics.WithPeers(-5)))
	require.Error(t, ex.Add(a), "added twice")
	require.Error(t, ex.Add(twin), "a second transport of the same name")
	require.NoError(t, ex.Add(b, metrics.WithPeers(0)))
	url := "http://" + ex.Addr() + "/metrics"
	fams := get(t, url)
	require.NotNil(t, fams["ecxfer_reads_done_total"])
	require.Nil(t, fams["ecxfer_peer_reads_done_total"], "WithPeers(-5) and WithPeers(0) export no per-peer series")
	require.Nil(t, fams["ecxfer_peer_series_omitted"])

	// Served while and after it is deregistered: scrapes keep working.
	require.NoError(t, a.Deregister())
	fams = get(t, url)
	require.Equal(t, 0.0, value(t, fams, "ecxfer_handles_live", map[string]string{"agent": a.AgentName()}))

	require.True(t, ex.Remove(a))
	require.False(t, ex.Remove(a), "removed twice")
	require.NoError(t, ex.Add(twin), "the name is free again")
	require.True(t, ex.Remove(twin))
	require.True(t, ex.Remove(b))

	require.NoError(t, ex.Close())
	require.NoError(t, ex.Close(), "Close twice")
	c := http.Client{Timeout: 2 * time.Second}
	_, err = c.Get(url)
	require.Error(t, err, "still serving after Close")
	// The port is free again.
	ln, err := net.Listen("tcp", ex.Addr())
	require.NoError(t, err)
	require.NoError(t, ln.Close())
}

// A nil transport: NewCollector panics saying so, Add returns an error,
// Remove reports it was never added; a nil Option is skipped.
func TestNilTransportAndOption(t *testing.T) {
	leakcheck.Check(t)
	require.PanicsWithError(t, "metrics: a nil *ecxfer.Transport", func() { metrics.NewCollector(nil) })
	ex, err := metrics.Listen("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { require.NoError(t, ex.Close()) }()
	require.EqualError(t, ex.Add(nil), "metrics: a nil *ecxfer.Transport")
	require.False(t, ex.Remove(nil))
	tr := newTransport(t, "loopback", name("nil-opt"))
	require.NoError(t, ex.Add(tr, nil, metrics.WithPeers(2), nil))
	require.NotNil(t, get(t, "http://"+ex.Addr()+"/metrics")["ecxfer_reads_done_total"])
	require.True(t, ex.Remove(tr))
}

// A collector registered twice on one registry, and collectors of two
// transports of one name, are refused by the registry, not served as
// clashing series.
func TestCollectorClashes(t *testing.T) {
	leakcheck.Check(t)
	tr := newTransport(t, "loopback", name("cc"))
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(tr)))
	require.Error(t, reg.Register(metrics.NewCollector(tr)))
	twin, err := ecxfer.New(ecxfer.Config{AgentName: tr.AgentName(), Backend: "ucx", BlockSize: 4096, NumBlocks: 32})
	require.NoError(t, err)
	defer func() { require.NoError(t, twin.Deregister()) }()
	require.Error(t, reg.Register(metrics.NewCollector(twin, metrics.WithPeers(1))))
	_, err = reg.Gather()
	require.NoError(t, err)
}
