package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/scrape"
	"github.com/ecxfer/ecxfer/metrics"
	"github.com/ecxfer/ecxfer/nixl/loopback"
	"github.com/ecxfer/ecxfer/reactor"
)

var seq atomic.Int64

// warmPoller makes the runtime open its network poller before a leak
// baseline, so that a test run alone does not count it.
func warmPoller() {
	if r, w, err := os.Pipe(); err == nil {
		_ = r.Close()
		_ = w.Close()
	}
}

func name(p string) string { return fmt.Sprintf("%s-%d", p, seq.Add(1)) }

func newTransport(tb testing.TB, backend, agent string, cfg ...func(*ecxfer.Config)) *ecxfer.Transport {
	tb.Helper()
	c := ecxfer.Config{AgentName: agent, Backend: backend, BlockSize: 4096, NumBlocks: 32}
	for _, f := range cfg {
		f(&c)
	}
	t, err := ecxfer.New(c)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = t.Deregister() })
	return t
}

func get(t *testing.T, url string) map[string]*scrape.Family {
	t.Helper()
	fams, err := scrape.Get(url)
	require.NoError(t, err)
	return fams
}

func value(t *testing.T, fams map[string]*scrape.Family, metric string, labels map[string]string) float64 {
	t.Helper()
	f := fams[metric]
	require.NotNil(t, f, "metric %s missing", metric)
	v, ok := f.Value("", labels)
	require.True(t, ok, "%s%v missing", metric, labels)
	return v
}

// TestScrapeOverHTTP serves a consumer's metrics on a real socket, scrapes
// them before and after READs, and checks names, types and that the
// counters move by what happened.
func TestScrapeOverHTTP(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	pn, cn := name("prod"), name("cons")
	prod := newTransport(t, "loopback", pn)
	prod2 := newTransport(t, "loopback", name("prod"))
	cons := newTransport(t, "loopback", cn, func(c *ecxfer.Config) {
		c.XferTimeout = 2 * time.Second // long enough for a loaded machine; the stuck READs wait it out once
		c.Reactor.Handles = 256
	})
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	_, err = cons.AddRemotePeer(prod2.AgentMetadata(), prod2.MemDescriptor())
	require.NoError(t, err)

	ex, err := metrics.Listen("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { require.NoError(t, ex.Close()) }()
	require.NoError(t, ex.Add(cons, metrics.WithPeers(1)))
	require.NoError(t, ex.Add(prod))
	url := "http://" + ex.Addr() + "/metrics"

	me := map[string]string{"agent": cn}
	before := get(t, url)
	types := map[string]string{
		"ecxfer_reads_posted_total":           "counter",
		"ecxfer_reads_done_total":             "counter",
		"ecxfer_reads_failed_total":           "counter",
		"ecxfer_reads_canceled_total":         "counter",
		"ecxfer_read_bytes_total":             "counter",
		"ecxfer_reads_in_flight":              "gauge",
		"ecxfer_handles_live":                 "gauge",
		"ecxfer_busy_refusals_total":          "counter",
		"ecxfer_notifications_sent_total":     "counter",
		"ecxfer_notifications_received_total": "counter",
		"ecxfer_engine_errors_total":          "counter",
		"ecxfer_notifications_dropped_total":  "counter",
		"ecxfer_reads_direct_total":           "counter",
		"ecxfer_reads_inline_total":           "counter",
		"ecxfer_peers":                        "gauge",
		"ecxfer_reactor_loop_turns_total":     "counter",
		"ecxfer_reactor_parks_total":          "counter",
		"ecxfer_reactor_caller_steps_total":   "counter",
		"ecxfer_reactor_naps_total":           "counter",
		"ecxfer_reactor_busy_seconds_total":   "counter",
		"ecxfer_reactor_cpu_seconds_total":    "counter",
		"ecxfer_wait_blocks_total":            "counter",
		"ecxfer_crowd_sleeps_total":           "counter",
		"ecxfer_read_duration_seconds":        "histogram",
		"ecxfer_peer_reads_done_total":        "counter",
		"ecxfer_peer_reads_failed_total":      "counter",
		"ecxfer_peer_read_bytes_total":        "counter",
		"ecxfer_peer_series_omitted":          "gauge",
		"ecxfer_gather_requests_total":        "counter",
		"ecxfer_gather_answers_dropped_total": "counter",
		"ecxfer_gather_retries_total":         "counter",
		"ecxfer_gather_answers_sent_total":    "counter",
	}
	for n, typ := range types {
		f := before[n]
		require.NotNil(t, f, "%s missing", n)
		require.Equal(t, typ, f.Type, n)
		require.NotEmpty(t, f.Help, n)
	}
	for n := range before {
		require.Contains(t, types, n, "unexpected family %s", n)
	}
	require.Equal(t, 2.0, value(t, before, "ecxfer_peers", map[string]string{"agent": cn, "path": "engine", "state": "up"}))
	require.Equal(t, 1.0, value(t, before, "ecxfer_peer_series_omitted", me), "two peers, one shown")
	require.Zero(t, value(t, before, "ecxfer_reads_done_total", me))

	// Every READ takes at least 200µs in the engine.
	const n, delay = 100, 200 * time.Microsecond
	ctx := context.Background()
	lb := engineOf(t, cons)
	lb.SetDelay(delay)
	for i := 0; i < n; i++ {
		h, err := cons.PostRead([]int{i % 32, (i + 1) % 32}, pn, []int{3, 4}, []byte("x"))
		require.NoError(t, err)
		require.NoError(t, cons.Wait(ctx, h))
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	// One READ that times out, and a refusal: the table holds 256.
	lb.SetDelay(time.Hour)
	var hs []ecxfer.Handle
	for {
		h, err := cons.PostRead([]int{0}, pn, []int{0}, nil)
		if err != nil {
			require.ErrorIs(t, err, ecxfer.ErrBusy)
			break
		}
		hs = append(hs, h)
	}
	// A READ polled in a loop among that crowd (far more in flight than
	// twice GOMAXPROCS): its checks after the first sleep.
	for i := 0; i < 5; i++ {
		st, err := cons.CheckXferState(hs[0])
		require.NoError(t, err)
		require.Equal(t, ecxfer.StateProc, st)
	}
	for _, h := range hs {
		_ = cons.Wait(ctx, h)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	lb.SetDelay(0)
	require.Eventually(t, func() bool { return prod.Stats().NotifsReceived >= n }, 10*time.Second, time.Millisecond,
		"the producer receives every notification")

	after := get(t, url)
	require.Equal(t, float64(n), value(t, after, "ecxfer_reads_done_total", me))
	require.Equal(t, float64(n*2*4096), value(t, after, "ecxfer_read_bytes_total", me))
	require.Equal(t, float64(n), value(t, after, "ecxfer_notifications_sent_total", me))
	require.Equal(t, float64(n), value(t, after, "ecxfer_notifications_received_total", map[string]string{"agent": pn}))
	require.Equal(t, float64(len(hs)), value(t, after, "ecxfer_reads_failed_total", map[string]string{"agent": cn, "reason": "timeout"}))
	require.Equal(t, float64(n+len(hs)), value(t, after, "ecxfer_reads_posted_total", me))
	require.GreaterOrEqual(t, value(t, after, "ecxfer_busy_refusals_total", me), 1.0)
	require.Zero(t, value(t, after, "ecxfer_reads_in_flight", me))
	require.Zero(t, value(t, before, "ecxfer_crowd_sleeps_total", me))
	require.GreaterOrEqual(t, value(t, after, "ecxfer_crowd_sleeps_total", me), 1.0)
	require.Equal(t, float64(cons.Stats().CrowdSleeps), value(t, after, "ecxfer_crowd_sleeps_total", me))
	require.Zero(t, value(t, after, "ecxfer_handles_live", me))
	require.Greater(t, value(t, after, "ecxfer_reactor_loop_turns_total", me), value(t, before, "ecxfer_reactor_loop_turns_total", me))
	require.Greater(t, value(t, after, "ecxfer_reactor_busy_seconds_total", me), 0.0)
	require.Greater(t, value(t, after, "ecxfer_reactor_cpu_seconds_total", me), 0.0)
	require.GreaterOrEqual(t, value(t, after, "ecxfer_reactor_cpu_seconds_total", me), value(t, before, "ecxfer_reactor_cpu_seconds_total", me))

	h := after["ecxfer_read_duration_seconds"]
	count, ok := h.Value("ecxfer_read_duration_seconds_count", me)
	require.True(t, ok)
	require.Equal(t, float64(n), count, "only READs that finished DONE are timed")
	inf, ok := h.Value("ecxfer_read_duration_seconds_bucket", map[string]string{"agent": cn, "le": "+Inf"})
	require.True(t, ok)
	require.Equal(t, count, inf)
	sum, ok := h.Value("ecxfer_read_duration_seconds_sum", me)
	require.True(t, ok)
	// The reactor times a READ from the start of the loop turn that posted
	// it to the start of the one that saw it complete, so one can look
	// shorter than the engine's delay by a turn's length; the sum cannot
	// look much shorter.
	require.GreaterOrEqual(t, sum, float64(n)*delay.Seconds()/2)
	// Buckets are cumulative.
	prev := -1.0
	for _, b := range metrics.DurationBuckets {
		v, ok := h.Value("ecxfer_read_duration_seconds_bucket", map[string]string{"agent": cn, "le": fmt.Sprint(b.Seconds())})
		require.True(t, ok, "bucket %v", b)
		require.GreaterOrEqual(t, v, prev)
		prev = v
	}
	require.Equal(t, float64(n), prev, "the last bucket (34 s) holds every READ")

	// Per-peer series: the first peer by name, with its own counters.
	first := pn
	if p2 := prod2.AgentName(); p2 < first {
		first = p2
	}
	peerDone := value(t, after, "ecxfer_peer_reads_done_total", map[string]string{"agent": cn, "peer": first})
	if first == pn {
		require.Equal(t, float64(n), peerDone)
		require.Equal(t, float64(len(hs)), value(t, after, "ecxfer_peer_reads_failed_total", map[string]string{"agent": cn, "peer": first}))
	} else {
		require.Zero(t, peerDone)
	}
	require.Len(t, after["ecxfer_peer_reads_done_total"].Samples, 1)
	// The producer's collector has no per-peer series.
	for _, s := range after["ecxfer_peer_reads_done_total"].Samples {
		require.Equal(t, cn, s.Labels["agent"])
	}
}

// TestPeerStates: a peer whose READs fail with a disconnect counts as dead.
func TestPeerStates(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	pn, cn := name("prod"), name("cons")
	prod := newTransport(t, "loopback", pn)
	cons := newTransport(t, "loopback", cn)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(cons)))
	engineOf(t, prod).Kill()
	h, err := cons.PostRead([]int{0}, pn, []int{0}, nil)
	require.NoError(t, err)
	require.ErrorIs(t, cons.Wait(context.Background(), h), ecxfer.ErrRemoteDisconnect)
	require.NoError(t, cons.ReleaseXferHandle(h))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	// Every path and state has a series, 0 when no peer is in it.
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "ecxfer_peers" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var path, state string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "path":
					path = l.GetValue()
				case "state":
					state = l.GetValue()
				}
			}
			got[path+"/"+state] = m.GetGauge().GetValue()
		}
	}
	require.Equal(t, map[string]float64{
		"engine/up": 0, "engine/dead": 1,
		"direct-file/up": 0, "direct-file/dead": 0,
		"direct-sysv/up": 0, "direct-sysv/dead": 0,
		"direct-proc/up": 0, "direct-proc/dead": 0,
	}, got)
	require.NoError(t, cons.RemoveRemotePeer(pn))
}

// TestPeerSeriesStayPut: with WithPeers(1), the peer shown keeps its
// series when a peer that sorts before it is added (its counters would
// vanish, then come back with a jump), and the other takes the place once
// it is removed.
func TestPeerSeriesStayPut(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	pb := newTransport(t, "loopback", name("peer-b"))
	pa := newTransport(t, "loopback", name("peer-a"))
	cons := newTransport(t, "loopback", name("cons"))
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(cons, metrics.WithPeers(1))))
	scrape := func() (shown []string, omitted float64) {
		t.Helper()
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			switch mf.GetName() {
			case "ecxfer_peer_reads_done_total":
				for _, m := range mf.GetMetric() {
					for _, l := range m.GetLabel() {
						if l.GetName() == "peer" {
							shown = append(shown, l.GetValue())
						}
					}
				}
			case "ecxfer_peer_series_omitted":
				omitted = mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return shown, omitted
	}
	nb, err := cons.AddRemotePeer(pb.AgentMetadata(), pb.MemDescriptor())
	require.NoError(t, err)
	shown, omitted := scrape()
	require.Equal(t, []string{nb}, shown)
	require.Zero(t, omitted)
	na, err := cons.AddRemotePeer(pa.AgentMetadata(), pa.MemDescriptor())
	require.NoError(t, err)
	require.Less(t, na, nb)
	shown, omitted = scrape()
	require.Equal(t, []string{nb}, shown, "the peer shown keeps its place")
	require.Equal(t, 1.0, omitted)
	require.NoError(t, cons.RemoveRemotePeer(nb))
	shown, omitted = scrape()
	require.Equal(t, []string{na}, shown)
	require.Zero(t, omitted)
	require.NoError(t, cons.RemoveRemotePeer(na))
}

// TestCollectorAfterDeregister: scraping a closed transport works and
// reports the reactor thread's final CPU time.
func TestCollectorAfterDeregister(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	tr := newTransport(t, "loopback", name("x"))
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(tr, metrics.WithPeers(4))))
	require.NoError(t, tr.Deregister())
	mfs, err := reg.Gather()
	require.NoError(t, err)
	cpu := -1.0
	for _, mf := range mfs {
		if mf.GetName() == "ecxfer_reactor_cpu_seconds_total" {
			cpu = mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	require.Greater(t, cpu, 0.0)
}

func engineOf(t *testing.T, tr *ecxfer.Transport) *loopback.Agent {
	t.Helper()
	a := loopback.Find(tr.AgentName())
	require.NotNil(t, a)
	return a
}

// BenchmarkReadWhileScraped: one-block READs through the reactor, in
// alternating chunks of 1,000 without a scraper and with one gathering
// every millisecond (a thousand times Prometheus' usual rate), so both
// phases see the same machine. It reports ns per READ of each phase and
// their ratio: the cost of being scraped.
func BenchmarkReadWhileScraped(b *testing.B) {
	for _, backend := range []string{"loopback", "ucx"} {
		// Every millisecond (15,000 times Prometheus' usual rate: the
		// scraper's cost made visible), and every 100 ms, still 150 times
		// the usual rate, with chunks long enough for a few scrapes each.
		for _, c := range []struct {
			every time.Duration
			chunk int
		}{{time.Millisecond, 1000}, {100 * time.Millisecond, 40000}} {
			b.Run(fmt.Sprintf("%s/every=%v", backend, c.every), func(b *testing.B) { benchScraped(b, backend, c.every, c.chunk) })
		}
	}
}

// benchScraped alternates chunks of one-block READs without and with a
// scraper gathering every interval.
func benchScraped(b *testing.B, backend string, every time.Duration, chunk int) {
	prod := newTransport(b, backend, name("bp"))
	cons := newTransport(b, backend, name("bc"), func(c *ecxfer.Config) {
		c.Reactor = reactor.Options{Idle: reactor.IdleSpin, Handles: 256}
	})
	pn, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(b, err)
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewCollector(cons, metrics.WithPeers(8)))
	local, remote := []int{1}, []int{2}
	one := func() {
		h, err := cons.PostRead(local, pn, remote, nil)
		if err != nil {
			b.Fatal(err)
		}
		for {
			st, err := cons.CheckXferState(h)
			if err != nil {
				b.Fatal(err)
			}
			if st == ecxfer.StateDone {
				break
			}
			runtime.Gosched()
		}
		if err := cons.ReleaseXferHandle(h); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < 5000; i++ {
		one()
	}
	var scraping atomic.Bool
	var scrapes atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(every)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				if !scraping.Load() {
					continue
				}
				if _, err := reg.Gather(); err != nil {
					panic(err)
				}
				scrapes.Add(1)
			}
		}
	}()
	var el [2]time.Duration
	var n [2]int
	b.ResetTimer()
	for i, phase := 0, 0; i < b.N; phase ^= 1 {
		scraping.Store(phase == 1)
		m := min(chunk, b.N-i)
		start := time.Now()
		for range m {
			one()
		}
		el[phase] += time.Since(start)
		n[phase] += m
		i += m
	}
	b.StopTimer()
	close(stop)
	<-done
	if n[0] > 0 && n[1] > 0 {
		quiet, scraped := float64(el[0])/float64(n[0]), float64(el[1])/float64(n[1])
		b.ReportMetric(quiet, "ns/read-unscraped")
		b.ReportMetric(scraped, "ns/read-scraped")
		b.ReportMetric(scraped/quiet, "scraped/unscraped")
		b.ReportMetric(float64(scrapes.Load())/el[1].Seconds(), "scrapes/s")
	}
}

// BenchmarkGather: one scrape of a transport with 16 peers, per-peer
// series on (what a scraper costs the process, not the READ path).
func BenchmarkGather(b *testing.B) {
	cons := newTransport(b, "loopback", name("gc"))
	for i := 0; i < 16; i++ {
		p := newTransport(b, "loopback", name("gp"))
		_, err := cons.AddRemotePeer(p.AgentMetadata(), p.MemDescriptor())
		require.NoError(b, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewCollector(cons, metrics.WithPeers(16)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := reg.Gather(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestDirectPathMetrics: a same-host ucx peer read on the direct path is
// counted under its path, and its READs as direct (and inline); a READ
// above InlineBytes moves the copy workers' busy time.
func TestDirectPathMetrics(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	pn, cn := name("dprod"), name("dcons")
	direct := func(c *ecxfer.Config) { c.Direct, c.InlineBytes, c.CopyWorkers = ecxfer.DirectOn, 4096, 2 }
	prod := newTransport(t, "ucx", pn, direct)
	cons := newTransport(t, "ucx", cn, direct)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(cons, metrics.WithPeers(4))))
	const n = 10
	for i := 0; i < n; i++ {
		h, err := cons.PostRead([]int{i}, pn, []int{i}, nil)
		require.NoError(t, err)
		require.NoError(t, cons.Wait(context.Background(), h))
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	vals := map[string]float64{}
	paths := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "ecxfer_peers":
				var path, state string
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "path":
						path = l.GetValue()
					case "state":
						state = l.GetValue()
					}
				}
				if state == "up" {
					paths[path] += m.GetGauge().GetValue()
				}
			case "ecxfer_reads_direct_total", "ecxfer_reads_inline_total", "ecxfer_peer_reads_done_total":
				vals[mf.GetName()] = m.GetCounter().GetValue()
			}
		}
	}
	require.Zero(t, paths["engine"])
	var onDirect float64
	for p, v := range paths {
		if strings.HasPrefix(p, "direct-") {
			onDirect += v
		}
	}
	require.Equal(t, 1.0, onDirect, "paths: %v", paths)
	require.Equal(t, float64(n), vals["ecxfer_reads_direct_total"])
	require.Equal(t, float64(n), vals["ecxfer_reads_inline_total"], "4 KiB READs are copied inline")
	require.Equal(t, float64(n), vals["ecxfer_peer_reads_done_total"])

	// All 32 blocks in one READ: above InlineBytes, so the workers copy it.
	all := make([]int, 32)
	for i := range all {
		all[i] = i
	}
	// Nobody checks the READ until the workers have copied: a caller that
	// checks it copies the chunks no worker has taken yet itself.
	h, err := cons.PostRead(all, pn, all, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return cons.Stats().CopyBusyTime > 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, cons.Wait(context.Background(), h))
	require.NoError(t, cons.ReleaseXferHandle(h))
	mfs, err = reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "ecxfer_copy_workers":
			got[mf.GetName()] = mf.GetMetric()[0].GetGauge().GetValue()
		case "ecxfer_copy_busy_seconds_total", "ecxfer_reads_direct_total", "ecxfer_reads_inline_total",
			"ecxfer_peer_reads_done_total":
			got[mf.GetName()] = mf.GetMetric()[0].GetCounter().GetValue()
		case "ecxfer_read_duration_seconds":
			got[mf.GetName()] = float64(mf.GetMetric()[0].GetHistogram().GetSampleCount())
		}
	}
	require.Equal(t, 2.0, got["ecxfer_copy_workers"])
	require.Greater(t, got["ecxfer_copy_busy_seconds_total"], 0.0)
	require.Equal(t, float64(n+1), got["ecxfer_reads_direct_total"], "the workers' READ is a direct one")
	require.Equal(t, float64(n), got["ecxfer_reads_inline_total"], "and not an inline one")
	require.Equal(t, float64(n+1), got["ecxfer_peer_reads_done_total"])
	require.Equal(t, float64(n+1), got["ecxfer_read_duration_seconds"], "every DONE READ has its latency in the histogram")
}

// Close returns promptly and without error while a client holds a
// connection it has sent nothing on, and that connection is closed.
func TestExporterCloseWithIdleClient(t *testing.T) {
	leakcheck.Check(t)
	ex, err := metrics.Listen("127.0.0.1:0")
	require.NoError(t, err)
	c, err := net.Dial("tcp", ex.Addr())
	require.NoError(t, err)
	defer c.Close()
	time.Sleep(50 * time.Millisecond) // the server has accepted it
	require.NoError(t, ex.Close(), "Close gave up on the idle client")
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Read(make([]byte, 1))
	// EOF once the server had accepted it; a reset when the listener
	// closed with the connection still in its accept queue (the sleep
	// above is no guarantee on a loaded machine).
	if !errors.Is(err, syscall.ECONNRESET) {
		require.ErrorIs(t, err, io.EOF, "the server side of the connection is still open")
	}
}

// TestGatherMetrics: two transports that reach each other over tcp alone
// (error mode PEER, READs gathered, as peers on two hosts), the engine
// path: the producer's metrics count the requests it served and how it
// sent their answers, straight out of its memory for adjacent 32 KiB
// blocks (one piece per 60 KiB answer) and copied for every other block
// (two or three pieces).
func TestGatherMetrics(t *testing.T) {
	warmPoller()
	leakcheck.Check(t)
	t.Setenv("UCX_TLS", "tcp")
	const bs = 32768
	for _, c := range []struct {
		step int
		how  string
	}{{1, "zero_copy"}, {2, "copied"}} {
		t.Run(c.how, func(t *testing.T) {
			pn, cn := name("gprod"), name("gcons")
			cfg := func(cf *ecxfer.Config) { cf.Direct, cf.BlockSize, cf.NumBlocks = ecxfer.DirectOff, bs, 256 }
			prod := newTransport(t, "ucx", pn, cfg)
			cons := newTransport(t, "ucx", cn, cfg)
			region := prod.Region()
			for i := range region {
				region[i] = byte(i*13 + i>>10)
			}
			_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			reg := prometheus.NewRegistry()
			require.NoError(t, reg.Register(metrics.NewCollector(prod)))
			// 128 of the producer's blocks, adjacent or every other one,
			// into the consumer's first 128.
			local, remote := make([]int, 128), make([]int, 128)
			for i := range local {
				local[i], remote[i] = i, c.step*i
			}
			h, err := cons.PostRead(local, pn, remote, nil)
			require.NoError(t, err)
			require.NoError(t, cons.Wait(context.Background(), h))
			require.NoError(t, cons.ReleaseXferHandle(h))
			got := cons.Region()
			for i := range local {
				require.Equal(t, region[remote[i]*bs:(remote[i]+1)*bs], got[i*bs:(i+1)*bs], "block %d", i)
			}
			// The producer's reactor publishes the engine's counts in its
			// loop turns.
			var sent, served map[string]float64
			require.Eventually(t, func() bool {
				mfs, err := reg.Gather()
				require.NoError(t, err)
				sent, served = map[string]float64{}, map[string]float64{}
				for _, mf := range mfs {
					for _, m := range mf.GetMetric() {
						var l string
						if len(m.GetLabel()) > 1 {
							l = m.GetLabel()[1].GetValue() // after "agent"
						}
						switch mf.GetName() {
						case "ecxfer_gather_answers_sent_total":
							sent[l] = m.GetCounter().GetValue()
						case "ecxfer_gather_requests_total":
							served[l] = m.GetCounter().GetValue()
						}
					}
				}
				return served["served"] > 0 && sent[c.how] > 0
			}, 10*time.Second, time.Millisecond, "sent %v, requests %v", sent, served)
			t.Logf("requests %v, answers %v", served, sent)
			// Two requests (at most 3.75 MiB each), in 60 KiB answers.
			chunks := float64((15*(4<<20)/16+60<<10-1)/(60<<10) + ((4<<20)/16+60<<10-1)/(60<<10))
			require.Equal(t, chunks, sent["zero_copy"]+sent["copied"])
			if c.how == "zero_copy" {
				require.Zero(t, sent["copied"])
			} else {
				require.GreaterOrEqual(t, sent["copied"], chunks-1, "the last answer may be short enough to go as it is")
			}
		})
	}
}
