// Package metrics exports a Transport's counters to Prometheus.
//
// It is the only package of ecxfer that imports
// github.com/prometheus/client_golang, so a program that embeds ecxfer
// without it pulls nothing of Prometheus in.
//
//	reg := prometheus.NewRegistry()
//	reg.MustRegister(metrics.NewCollector(t))
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// or, for a tool:
//
//	ex, _ := metrics.Listen(":9464")
//	ex.Add(t)
//
// A scrape reads the transport's atomic counters (Transport.Stats) and,
// for ecxfer_reactor_cpu_seconds_total, one small /proc file: it never
// stops or locks the reactor, and the READ path does no work for it
// beyond the counters it keeps anyway.
//
// Every series carries the label agent (Config.AgentName), so one registry
// can hold the collectors of several transports.
//
// The metrics (types in brackets):
//
//	ecxfer_reads_posted_total           [counter]   READs accepted (PostRead returned a handle; also the rare
//	                                                Post that failed after a release or teardown had ended its
//	                                                READ); each ends in one of done, failed, canceled
//	ecxfer_reads_done_total             [counter]   READs finished with every byte landed
//	ecxfer_reads_failed_total{reason}   [counter]   READs ended in ERR, by reason
//	ecxfer_reads_canceled_total         [counter]   READs released in flight or dropped with their peer
//	ecxfer_read_bytes_total             [counter]   bytes of READs finished DONE
//	ecxfer_reads_in_flight              [gauge]     READs the engine or the copy workers are working on
//	ecxfer_handles_live                 [gauge]     handles posted and not yet released (a released in-flight READ's until it has ended)
//	ecxfer_busy_refusals_total          [counter]   PostRead calls refused with ErrBusy
//	ecxfer_notifications_sent_total     [counter]   notifications sent with finished READs
//	                                                (or queued for a full producer socket)
//	ecxfer_notifications_received_total [counter]   notifications received from peers
//	ecxfer_notifications_dropped_total{reason}
//	                                    [counter]   notifications dropped: on receipt, oversized
//	                                                (longer than MaxNotif), bad_sender (the engine
//	                                                named a sender no agent can be), engine (the
//	                                                engine could not hand them over) or untaken
//	                                                (MaxHeldNotifBytes already waiting untaken);
//	                                                on the way out,
//	                                                undelivered (queued for a full producer
//	                                                socket or, on the ucx engine over shared
//	                                                memory, receive queue, then the producer
//	                                                exited or went away)
//	ecxfer_engine_errors_total          [counter]   engine calls that failed
//	ecxfer_peers{path,state}            [gauge]     known peers by path (engine, direct-file,
//	                                                direct-sysv, direct-proc) and state (up, dead);
//	                                                all eight pairs, 0 when empty
//	ecxfer_reads_direct_total           [counter]   READs of direct peers that copied every byte
//	ecxfer_reads_inline_total           [counter]   of those, READs the caller copied inside PostRead
//	ecxfer_copy_workers                 [gauge]     copy workers of the direct path (only with one)
//	ecxfer_copy_busy_seconds_total      [counter]   time the copy workers spent on READs (copies, and
//	                                                the ends they publish), summed;
//	                                                rate / ecxfer_copy_workers is their busy fraction
//	ecxfer_reactor_loop_turns_total     [counter]   event loop turns
//	ecxfer_reactor_parks_total          [counter]   times the reactor slept
//	ecxfer_reactor_caller_steps_total   [counter]   steps of the engine's work callers polling a
//	                                                READ took for the reactor thread
//	ecxfer_reactor_naps_total           [counter]   times the reactor thread stood aside for them
//	ecxfer_reactor_busy_seconds_total   [counter]   reactor time in turns that found work;
//	                                                its rate is the busy fraction
//	ecxfer_reactor_cpu_seconds_total    [counter]   the reactor thread's CPU time
//	ecxfer_wait_blocks_total            [counter]   Wait calls that stopped spinning and slept
//	ecxfer_crowd_sleeps_total           [counter]   checks of a READ polled in a loop among many
//	                                                that slept until some READ ended
//	ecxfer_read_duration_seconds        [histogram] post → DONE latency of READs
//	ecxfer_gather_requests_total{outcome}
//	                                    [counter]   gathered READs' requests this producer received:
//	                                                served, busy, refused, dropped
//	ecxfer_gather_answers_dropped_total{reason}
//	                                    [counter]   answers to this consumer's gathered READs dropped:
//	                                                late, bad
//	ecxfer_gather_answers_sent_total{how}
//	                                    [counter]   answers this producer sent: zero_copy, copied
//	ecxfer_gather_retries_total         [counter]   requests this consumer asked again after busy
//
// With WithPeers(n), up to n peers (see WithPeers for which) also get
// ecxfer_peer_reads_done_total, ecxfer_peer_reads_failed_total and
// ecxfer_peer_read_bytes_total with a label peer; ecxfer_peer_series_omitted
// says how many peers were left out.
package metrics

import (
	"errors"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/reactor"
)

// DurationBuckets are the upper bounds of ecxfer_read_duration_seconds:
// powers of two nanoseconds from 1.024 µs to 34.4 s. They coincide with
// bucket edges of the reactor's own histogram, so the counts are exact
// (a bucket counts the READs that took less than its bound, where
// Prometheus' le means at most: a READ of exactly a bound's nanoseconds
// counts in the next bucket).
var DurationBuckets = func() []time.Duration {
	var b []time.Duration
	for e := 10; e <= 35; e++ {
		b = append(b, time.Duration(1)<<e)
	}
	return b
}()

// Option configures a collector.
type Option func(*collector)

var errNilTransport = errors.New("metrics: a nil *ecxfer.Transport")

// WithPeers exports per-peer series for at most n peers. A peer keeps its
// series for as long as it is known, and free places go to the others in
// name order, so a peer added later that sorts first does not push one
// out (whose counters would vanish and come back with a jump). Zero, the
// default, exports none; the bound keeps a consumer with thousands of
// peers from flooding Prometheus.
func WithPeers(n int) Option {
	return func(c *collector) {
		if n > 0 {
			c.maxPeers = n
		}
	}
}

type collector struct {
	t        *ecxfer.Transport
	maxPeers int
	agent    string

	mu    sync.Mutex // guards peers, reused across scrapes, and shown
	peers []ecxfer.PeerStat
	shown map[string]bool // the peers with per-peer series (WithPeers)

	readsPosted, readsDone, readsFailed, readsCanceled *prometheus.Desc
	readBytes, inFlight, handles, busyRefusals         *prometheus.Desc
	notifsSent, notifsReceived, engineErrors           *prometheus.Desc
	peersDesc, loopTurns, parks, busySeconds, cpu      *prometheus.Desc
	callerSteps, naps                                  *prometheus.Desc
	waitBlocks, crowdSleeps, duration                  *prometheus.Desc
	notifsDropped, readsDirect, readsInline            *prometheus.Desc
	copyWorkers, copyBusy                              *prometheus.Desc
	gatherRequests, gatherAnswers, gatherRetries       *prometheus.Desc
	gatherSent                                         *prometheus.Desc
	peerDone, peerFailed, peerBytes, peerOmitted       *prometheus.Desc
}

// NewCollector returns a collector of t's metrics. Register it with a
// prometheus.Registerer; it is safe for concurrent scrapes. A nil t is a
// programming error: it panics, saying so (Exporter.Add returns an error
// instead). Nil options are skipped.
func NewCollector(t *ecxfer.Transport, opts ...Option) prometheus.Collector {
	if t == nil {
		panic(errNilTransport)
	}
	c := &collector{t: t, agent: t.AgentName()}
	for _, o := range opts {
		if o != nil {
			o(c)
		}
	}
	cl := prometheus.Labels{"agent": c.agent}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, cl)
	}
	c.readsPosted = d("ecxfer_reads_posted_total", "READs accepted (PostRead returned a handle, or rarely a Post that failed after a release or teardown had ended its READ); each ends in one of done, failed, canceled.")
	c.readsDone = d("ecxfer_reads_done_total", "READs finished with every byte landed.")
	c.readsFailed = d("ecxfer_reads_failed_total", "READs that ended in ERR, by reason.", "reason")
	c.readsCanceled = d("ecxfer_reads_canceled_total", "READs released in flight or dropped with their peer.")
	c.readBytes = d("ecxfer_read_bytes_total", "Bytes of the READs that finished DONE.")
	c.inFlight = d("ecxfer_reads_in_flight", "READs the engine or the copy workers are working on.")
	c.handles = d("ecxfer_handles_live", "Handles posted and not yet released (a released in-flight READ's until it has ended).")
	c.busyRefusals = d("ecxfer_busy_refusals_total", "PostRead calls refused with ErrBusy.")
	c.notifsSent = d("ecxfer_notifications_sent_total", "Notifications sent with finished READs.")
	c.notifsReceived = d("ecxfer_notifications_received_total", "Notifications received from peers.")
	c.engineErrors = d("ecxfer_engine_errors_total", "Engine calls that failed.")
	c.notifsDropped = d("ecxfer_notifications_dropped_total", "Notifications dropped, by reason: on receipt (oversized, bad_sender, engine, untaken) or queued and never sent (undelivered).", "reason")
	c.readsDirect = d("ecxfer_reads_direct_total", "READs of direct peers that copied every byte.")
	c.readsInline = d("ecxfer_reads_inline_total", "READs of direct peers the caller copied inside PostRead.")
	c.copyWorkers = d("ecxfer_copy_workers", "Copy workers of the direct path.")
	c.copyBusy = d("ecxfer_copy_busy_seconds_total", "Time the copy workers spent on READs (copying, and publishing the ends of those whose last chunk they copied), summed over them; its rate over ecxfer_copy_workers is their busy fraction.")
	c.gatherRequests = d("ecxfer_gather_requests_total", "Gathered READs' requests this producer received, by outcome: served, busy (refused while its answers in flight were at their bound; the consumer asks again), refused (malformed or outside its registered memory), dropped (not answered).", "outcome")
	c.gatherAnswers = d("ecxfer_gather_answers_dropped_total", "Answers to this consumer's gathered READs it dropped, by reason: late (the READ was released), bad (it did not fit the READ, which failed).", "reason")
	c.gatherSent = d("ecxfer_gather_answers_sent_total", "Answers (up to 60 KiB each) this producer sent to gathered READs, by how: zero_copy (straight out of its registered memory: their bytes lay in one piece of it) or copied (into a buffer first: they lay in several, as scattered blocks of 60 KiB or less do).", "how")
	c.gatherRetries = d("ecxfer_gather_retries_total", "Gathered READs' requests this consumer asked again after a busy producer refused them.")
	c.peersDesc = d("ecxfer_peers", "Known peers by path and state.", "path", "state")
	c.loopTurns = d("ecxfer_reactor_loop_turns_total", "Event loop turns.")
	c.parks = d("ecxfer_reactor_parks_total", "Times the reactor slept.")
	c.callerSteps = d("ecxfer_reactor_caller_steps_total", "Steps of the engine's work that callers polling a READ took for the reactor thread.")
	c.naps = d("ecxfer_reactor_naps_total", "Times the reactor thread stood aside for callers taking steps.")
	c.busySeconds = d("ecxfer_reactor_busy_seconds_total", "Reactor time spent in loop turns that found work; its rate is the busy fraction.")
	c.cpu = d("ecxfer_reactor_cpu_seconds_total", "CPU time used by the reactor thread.")
	c.waitBlocks = d("ecxfer_wait_blocks_total", "Wait calls that stopped spinning and slept.")
	c.crowdSleeps = d("ecxfer_crowd_sleeps_total", "Checks of a READ polled in a loop among many in flight that slept until some READ ended.")
	c.duration = d("ecxfer_read_duration_seconds", "Post to DONE latency of READs.")
	c.peerDone = d("ecxfer_peer_reads_done_total", "READs from this peer finished DONE.", "peer")
	c.peerFailed = d("ecxfer_peer_reads_failed_total", "READs from this peer that failed (ERR; not those canceled by a release or the peer's removal).", "peer")
	c.peerBytes = d("ecxfer_peer_read_bytes_total", "Bytes read from this peer.", "peer")
	c.peerOmitted = d("ecxfer_peer_series_omitted", "Peers left out of the per-peer series by the WithPeers bound.")
	return c
}

// Describe sends every metric's description.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		c.readsPosted, c.readsDone, c.readsFailed, c.readsCanceled,
		c.readBytes, c.inFlight, c.handles, c.busyRefusals,
		c.notifsSent, c.notifsReceived, c.engineErrors,
		c.peersDesc, c.loopTurns, c.parks, c.callerSteps, c.naps, c.busySeconds, c.cpu,
		c.waitBlocks, c.crowdSleeps, c.duration, c.notifsDropped, c.readsDirect, c.readsInline,
		c.copyWorkers, c.copyBusy, c.gatherRequests, c.gatherAnswers, c.gatherRetries, c.gatherSent,
	} {
		ch <- d
	}
	if c.maxPeers > 0 {
		ch <- c.peerDone
		ch <- c.peerFailed
		ch <- c.peerBytes
		ch <- c.peerOmitted
	}
}

// Collect reads the transport's counters and sends them.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.t.Stats()
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter(c.readsPosted, float64(s.ReadsPosted))
	counter(c.readsDone, float64(s.ReadsDone))
	for i, n := range s.FailedBy {
		if i == 0 && n == 0 {
			continue // "other" is never used today
		}
		counter(c.readsFailed, float64(n), reactor.FailReasons[i])
	}
	counter(c.readsCanceled, float64(s.ReadsCanceled))
	counter(c.readBytes, float64(s.BytesRead))
	gauge(c.inFlight, float64(s.InFlight))
	gauge(c.handles, float64(s.LiveHandles))
	counter(c.busyRefusals, float64(s.BusyRefusals))
	counter(c.notifsSent, float64(s.NotifsSent))
	counter(c.notifsReceived, float64(s.NotifsReceived))
	counter(c.engineErrors, float64(s.EngineErrors))
	counter(c.notifsDropped, float64(s.NotifsOversized), "oversized")
	counter(c.notifsDropped, float64(s.NotifsBadSender), "bad_sender")
	counter(c.notifsDropped, float64(s.NotifsUntaken), "untaken")
	counter(c.notifsDropped, float64(s.NotifsDroppedByEngine), "engine")
	counter(c.notifsDropped, float64(s.NotifsUndelivered), "undelivered")
	g := s.Gathers
	counter(c.gatherRequests, float64(g.Served), "served")
	counter(c.gatherRequests, float64(g.Busy), "busy")
	counter(c.gatherRequests, float64(g.Refused), "refused")
	counter(c.gatherRequests, float64(g.Dropped), "dropped")
	counter(c.gatherAnswers, float64(g.Late), "late")
	counter(c.gatherAnswers, float64(g.Bad), "bad")
	counter(c.gatherSent, float64(g.ZeroCopy), "zero_copy")
	counter(c.gatherSent, float64(g.Copied), "copied")
	counter(c.gatherRetries, float64(g.Retries))
	counter(c.readsDirect, float64(s.DirectReads))
	counter(c.readsInline, float64(s.InlineReads))
	if s.CopyWorkers > 0 {
		gauge(c.copyWorkers, float64(s.CopyWorkers))
		counter(c.copyBusy, s.CopyBusyTime.Seconds())
	}
	counter(c.loopTurns, float64(s.LoopTurns))
	counter(c.parks, float64(s.Parks))
	counter(c.callerSteps, float64(s.CallerSteps))
	counter(c.naps, float64(s.Naps))
	counter(c.busySeconds, s.BusyTime.Seconds())
	if cpu, err := c.t.ReactorCPU(); err == nil {
		counter(c.cpu, cpu.Seconds())
	}
	counter(c.waitBlocks, float64(s.WaitBlocks))
	counter(c.crowdSleeps, float64(s.CrowdSleeps))
	buckets := make(map[float64]uint64, len(DurationBuckets))
	for _, b := range DurationBuckets {
		buckets[b.Seconds()] = s.Latency.CountBelow(b)
	}
	ch <- prometheus.MustNewConstHistogram(c.duration, s.Latency.Count(), s.Latency.Sum().Seconds(), buckets)
	c.collectPeers(ch)
}

// peerPaths are the paths a peer's READs can take (Transport.PeerPath).
var peerPaths = [...]string{"engine", "direct-file", "direct-sysv", "direct-proc"}

func (c *collector) collectPeers(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.peers = c.t.PeerStats(c.peers[:0])
	defer clear(c.peers) // keep the slice, not the names, until the next scrape
	type key struct{ path, state string }
	// Every path and state, 0 when none: a series that vanished when its
	// last peer went would read as "no data", not as none.
	byState := make(map[key]int, 2*len(peerPaths))
	for _, path := range peerPaths {
		byState[key{path, "up"}], byState[key{path, "dead"}] = 0, 0
	}
	for _, p := range c.peers {
		byState[key{p.Path, p.State}]++
	}
	for k, n := range byState {
		ch <- prometheus.MustNewConstMetric(c.peersDesc, prometheus.GaugeValue, float64(n), k.path, k.state)
	}
	if c.maxPeers == 0 {
		return
	}
	sort.Slice(c.peers, func(i, j int) bool { return c.peers[i].Name < c.peers[j].Name })
	// The peers shown last time that are still known keep their places
	// (at most maxPeers of them); the free places go to the others in
	// name order. Names no longer known leave the set.
	next := make(map[string]bool, min(len(c.peers), c.maxPeers))
	for _, p := range c.peers {
		if c.shown[p.Name] {
			next[p.Name] = true
		}
	}
	for _, p := range c.peers {
		if len(next) >= c.maxPeers {
			break
		}
		next[p.Name] = true
	}
	c.shown = next
	for _, p := range c.peers {
		if !next[p.Name] {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.peerDone, prometheus.CounterValue, float64(p.ReadsDone), p.Name)
		ch <- prometheus.MustNewConstMetric(c.peerFailed, prometheus.CounterValue, float64(p.ReadsFailed), p.Name)
		ch <- prometheus.MustNewConstMetric(c.peerBytes, prometheus.CounterValue, float64(p.BytesRead), p.Name)
	}
	ch <- prometheus.MustNewConstMetric(c.peerOmitted, prometheus.GaugeValue, float64(len(c.peers)-len(next)))
}
