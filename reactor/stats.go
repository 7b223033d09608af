package reactor

import (
	"sync/atomic"
	"time"

	"github.com/ecxfer/ecxfer/nixl"
)

// counters are written by the reactor thread and read by anyone.
type counters struct {
	posted, done, failed, canceled atomic.Uint64
	bytes                          atomic.Uint64
	notifsSent, notifsReceived     atomic.Uint64
	notifsDroppedByEngine          atomic.Uint64
	gathers                        [9]atomic.Uint64 // nixl.GatherCounts, in its order
	notifsUndeliveredByEngine      atomic.Uint64
	notifsOversized                atomic.Uint64
	notifsUntaken                  atomic.Uint64
	notifsBadSender                atomic.Uint64
	engineErrors                   atomic.Uint64
	loops, parks                   atomic.Uint64
	callerSteps, naps              atomic.Uint64
	napTurnsSkipped                atomic.Uint64 // napOn (tests)
	finisherEnds                   atomic.Uint64
	latency                        Histogram

	failedBy     [numCodes]atomic.Uint64
	busyNs       atomic.Uint64 // time in loop turns that found work
	busyRefusals atomic.Uint64 // counted by callers whose Post got ErrBusy
	// waitBlocks and crowdSleeps are the exception: callers count them.
	waitBlocks, crowdSleeps atomic.Uint64
}

// Stats is a snapshot of the reactor's counters, taken without stopping it.
type Stats struct {
	ReadsPosted   uint64 // accepted: Post returned a handle; each ends counted once below
	ReadsDone     uint64 // finished with every byte landed
	ReadsFailed   uint64 // finished in ERR (engine error, disconnect, timeout, close), not canceled
	ReadsCanceled uint64 // released in flight, or dropped with their peer
	BytesRead     uint64 // bytes of the reads that finished DONE
	// NotifsSent counts notifications of finished reads handed to the
	// engine or the producer's socket, or queued for that socket while it
	// is full (NotifsUndelivered counts those that never went out).
	NotifsSent     uint64
	NotifsReceived uint64 // notifications received from peers
	// NotifsOversized counts notifications dropped on receipt for being
	// longer than Options.MaxNotif (never handed to the application).
	NotifsOversized uint64
	// NotifsBadSender counts notifications dropped on receipt because the
	// engine named their sender with a name no agent can have (empty,
	// longer than 256 bytes, or not printable ASCII without spaces).
	NotifsBadSender uint64
	// NotifsUntaken counts notifications dropped on receipt because
	// MaxHeldNotifBytes of received ones were waiting for NewNotifs or
	// WaitNotifs already.
	NotifsUntaken uint64
	EngineErrors  uint64 // engine calls that failed
	// LiveHandles counts handles not yet released, and released ones
	// whose READ was in flight until the loop has ended it (a release
	// of such a READ waits for that: a direct copy stops between chunks,
	// an engine READ is released by the loop; see Reactor.Release).
	LiveHandles int64
	InFlight    int64  // reads the engine or the copy workers are working on, or held (behind a fence)
	Peers       int    // peers currently known (after Close: those it had then)
	LoopTurns   uint64 // event loop turns
	Parks       uint64 // times the reactor slept
	WaitBlocks  uint64 // times Wait spun for WaitSpin and then blocked
	CrowdSleeps uint64 // checks of a READ polled among many that slept until some READ ended (crowd.go)
	// CallerSteps counts steps of the engine work that callers polling a
	// READ took for the reactor (Options.ReactorOnly); Naps the times the
	// reactor thread stood aside for them.
	CallerSteps uint64
	Naps        uint64
	// FinisherEnds counts the times the goroutine that copied the last
	// chunk of a direct READ (a copy worker, or a caller helping with the
	// copy) published its end itself, the reactor thread being asleep
	// (see IdleStrategy).
	FinisherEnds uint64
	Latency      HistSnapshot // post → DONE

	// For operators (the metrics package).
	FailedBy     [NumFailReasons]uint64 // ReadsFailed by reason, indexed like FailReasons
	BusyRefusals uint64                 // Posts refused with ErrBusy
	BusyTime     time.Duration          // reactor time spent in loop turns that found work

	// NotifsDroppedByEngine counts notifications that reached this
	// process and that the engine threw away instead of handing them over
	// (ucx: arrived by rendezvous, oversized, or no memory to queue them,
	// and fragments it could not put back together; libnixl: records it
	// could not parse). It stays 0 for an engine that
	// cannot tell (one that is no nixl.NotifDropper). Notifications a peer
	// never sent are not in it, nor those the reactor itself drops
	// (NotifsOversized).
	NotifsDroppedByEngine uint64
	// NotifsUndelivered counts notifications in NotifsSent that waited
	// and were dropped unsent. Direct path: for a full producer socket, or
	// an inline READ's for the reactor, and the producer exited, the send
	// failed for good (also an engine error), or the transport closed
	// before it went out. Engine path (an engine
	// that is a nixl.NotifUndeliverer; ucx over shared memory): for room
	// in the producer's receive queue, and the producer died, or was
	// removed and did not take them in time, or the transport closed.
	NotifsUndelivered uint64
	// Gathers counts gathered READs, as producer and as consumer (an
	// engine that is a nixl.GatherCounter: ucx, peers on other hosts);
	// zero otherwise. Copied from the engine as the loop turns.
	Gathers nixl.GatherCounts

	// The direct path.
	DirectPeers int    // peers read on the direct path (same host, region mapped)
	DirectReads uint64 // READs of direct peers that copied every byte
	InlineReads uint64 // of those, READs the caller copied inside Post

	// The copy workers (0 and 0 without a direct path).
	CopyWorkers  int           // workers in the copy pool
	CopyBusyTime time.Duration // time they spent copying, summed over them
}

// Stats returns the counters.
func (r *Reactor) Stats() Stats {
	// Ends before posts, parts before wholes (wholes are counted first):
	// a READ counted between two loads then shows in the whole only, never
	// done > posted, inline > direct > done, the failures by reason above
	// ReadsFailed or undelivered notifications above those sent in one
	// snapshot. The latency histogram before done, which
	// is counted before its latency is added: its count is never above
	// ReadsDone. A READ can end before Post has counted it posted (the
	// loop takes it as soon as it is on the ring), so posted is at least
	// what has ended; the max of two counters that only rise only rises.
	lat := r.st.latency.Snapshot()
	failedBy := r.failedBy()
	undelivered := r.st.notifsUndeliveredByEngine.Load()
	var inline, direct uint64
	if d := r.dir; d != nil {
		undelivered += d.ns.undelivered.Load()
		inline = d.inlineReads.Load()
		direct = d.reads.Load()
	}
	notifsSent := r.st.notifsSent.Load()
	ended := [3]uint64{r.st.done.Load(), r.st.failed.Load(), r.st.canceled.Load()}
	posted := max(r.st.posted.Load(), ended[0]+ended[1]+ended[2])
	st := Stats{
		ReadsDone:      ended[0],
		ReadsFailed:    ended[1],
		ReadsCanceled:  ended[2],
		ReadsPosted:    posted,
		BytesRead:      r.st.bytes.Load(),
		NotifsSent:     notifsSent,
		NotifsReceived: r.st.notifsReceived.Load(),
		EngineErrors:   r.st.engineErrors.Load(),
		LiveHandles:    r.tab.live.Load(),
		InFlight:       r.inflight.Load(),
		Peers:          len(r.knownPeers()),
		LoopTurns:      r.st.loops.Load(),
		Parks:          r.st.parks.Load(),
		WaitBlocks:     r.st.waitBlocks.Load(),
		CrowdSleeps:    r.st.crowdSleeps.Load(),
		CallerSteps:    r.st.callerSteps.Load(),
		Naps:           r.st.naps.Load(),
		FinisherEnds:   r.st.finisherEnds.Load(),
		Latency:        lat,
		FailedBy:       failedBy,
		BusyRefusals:   r.st.busyRefusals.Load(),
		BusyTime:       time.Duration(r.st.busyNs.Load()),

		NotifsDroppedByEngine: r.st.notifsDroppedByEngine.Load(),
		Gathers:               r.st.gatherCounts(),
		NotifsUndelivered:     undelivered,
		NotifsOversized:       r.st.notifsOversized.Load(),
		NotifsBadSender:       r.st.notifsBadSender.Load(),
		NotifsUntaken:         r.st.notifsUntaken.Load(),
	}
	if d := r.dir; d != nil {
		st.InlineReads, st.DirectReads = inline, direct
		if d.pool != nil {
			st.CopyWorkers, st.CopyBusyTime = d.pool.Workers(), d.pool.BusyTime()
		}
		for _, p := range r.knownPeers() {
			if p.direct != nil {
				st.DirectPeers++
			}
		}
	}
	return st
}

// knownPeers is the peer map, or once the reactor has closed, the peers
// it had then (as PeerStats reports them).
func (r *Reactor) knownPeers() map[string]*Peer {
	if f := r.final.Load(); f != nil {
		return *f
	}
	return *r.peers.Load()
}

func (r *Reactor) failedBy() (out [NumFailReasons]uint64) {
	for i := range out {
		out[i] = r.st.failedBy[i].Load()
	}
	return out
}

// dropper returns agent as a nixl.NotifDropper, or nil if it is none.
func dropper(agent nixl.Agent) nixl.NotifDropper {
	d, _ := agent.(nixl.NotifDropper)
	return d
}

// gatherCounter returns agent as a nixl.GatherCounter, or nil.
func gatherCounter(agent nixl.Agent) nixl.GatherCounter {
	g, _ := agent.(nixl.GatherCounter)
	return g
}

func (s *counters) gatherCounts() nixl.GatherCounts {
	g := &s.gathers
	return nixl.GatherCounts{Served: g[0].Load(), Busy: g[1].Load(), Refused: g[2].Load(), Dropped: g[3].Load(),
		Late: g[4].Load(), Bad: g[5].Load(), Retries: g[6].Load(), ZeroCopy: g[7].Load(), Copied: g[8].Load()}
}

func (s *counters) storeGatherCounts(c nixl.GatherCounts) {
	// Every loop turn: loads, and a store only where a count moved.
	for i, v := range [9]uint64{c.Served, c.Busy, c.Refused, c.Dropped, c.Late, c.Bad, c.Retries, c.ZeroCopy, c.Copied} {
		if s.gathers[i].Load() != v {
			s.gathers[i].Store(v)
		}
	}
}
