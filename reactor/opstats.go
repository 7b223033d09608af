package reactor

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// FailReasons names the ways a READ ends in ERR, indexed like
// Stats.FailedBy: the label values of ecxfer_reads_failed_total. READs
// released in flight or dropped with their removed peer end in
// ErrCanceled but count in Stats.ReadsCanceled, not here; "canceled"
// counts the READs the engine itself canceled while nobody had released
// them (0 unless the engine does).
var FailReasons = [numCodes]string{
	codeNone:             "other",
	codeRemoteDisconnect: "remote_disconnect",
	codeTimeout:          "timeout",
	codeCanceled:         "canceled",
	codeEngine:           "engine",
	codeUnknownPeer:      "unknown_peer",
	codeClosed:           "closed",
}

// NumFailReasons is the length of Stats.FailedBy.
const NumFailReasons = int(numCodes)

// PeerStat is one peer's state and counters.
type PeerStat struct {
	Name string
	// Path is how READs reach the peer: "engine" (through the transfer
	// engine), or "direct-file", "direct-sysv", "direct-proc" (copied
	// from its mapped region, see PeerPath).
	Path string
	// State is "up", or "dead" once a READ from it failed because it
	// disconnected or, on the direct path, its process was seen to exit
	// (until it is replaced).
	State       string
	ReadsDone   uint64
	ReadsFailed uint64
	BytesRead   uint64
}

// peerCounters are the counters of a peer's name (Peer.pc), written by
// the reactor thread (and by Post for a small direct READ it copies).
type peerCounters struct {
	done, failed, bytes atomic.Uint64
}

// PeerStats appends the known peers' state and counters to dst.
func (r *Reactor) PeerStats(dst []PeerStat) []PeerStat {
	peers := r.peers.Load()
	if f := r.final.Load(); f != nil {
		peers = f // closed: the peers it had, with their final figures
	}
	for _, p := range *peers {
		st := "up"
		if p.dead.Load() {
			st = "dead"
		}
		path := "engine"
		if p.direct != nil && r.dir != nil {
			path = p.direct.Path()
		}
		dst = append(dst, PeerStat{
			Name:        p.Name,
			Path:        path,
			State:       st,
			ReadsDone:   p.pc.done.Load(),
			ReadsFailed: p.pc.failed.Load(),
			BytesRead:   p.pc.bytes.Load(),
		})
	}
	return dst
}

// countFailed counts a READ that ended in ERR with code. Atomics only: the
// loop calls it, and so does Post for a small direct READ it copies.
func (r *Reactor) countFailed(p *Peer, code uint64) {
	r.st.failed.Add(1)
	if code < numCodes {
		r.st.failedBy[code].Add(1)
	}
	if p != nil {
		p.pc.failed.Add(1)
	}
}

// ThreadCPU returns the CPU time the reactor thread has used so far (user
// and system), read from /proc: a few microseconds, so not for hot paths.
// Once the reactor has stopped it is the thread's total.
// It never goes down from one call to the next, so it can be exported as
// a counter.
func (r *Reactor) ThreadCPU() (time.Duration, error) {
	if t := r.finalCPU.Load(); t > 0 {
		return r.cpuAtLeast(t), nil
	}
	select {
	case <-r.done:
		return 0, ErrClosed
	default:
	}
	tid := r.tid.Load()
	if tid == 0 {
		return 0, fmt.Errorf("reactor: thread not started")
	}
	t, err := schedstatCPU(fmt.Sprintf("/proc/self/task/%d/schedstat", tid))
	if err != nil {
		if t := r.finalCPU.Load(); t > 0 { // it exited meanwhile
			return r.cpuAtLeast(t), nil
		}
		return 0, err
	}
	return r.cpuAtLeast(int64(t)), nil
}

// cpuAtLeast raises the highest CPU figure ThreadCPU has returned to t and
// returns it: a figure read from /proc just before the thread saves its
// own at exit may be above the saved one.
func (r *Reactor) cpuAtLeast(t int64) time.Duration {
	for {
		hi := r.cpuHigh.Load()
		if t <= hi {
			return time.Duration(hi)
		}
		if r.cpuHigh.CompareAndSwap(hi, t) {
			return time.Duration(t)
		}
	}
}

// schedstatCPU reads the CPU time a thread has run (ns) from its
// schedstat file. ThreadCPU and the loop's final figure both come from
// here, so the counter built on them never goes down at the stop.
func schedstatCPU(path string) (time.Duration, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return parseSchedstat(b)
}

// parseSchedstat reads the first field of a schedstat file's text b: the
// time the thread has run, in ns.
func parseSchedstat(b []byte) (time.Duration, error) {
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, fmt.Errorf("reactor: empty schedstat")
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil || ns < 0 {
		return 0, fmt.Errorf("reactor: schedstat: %q is not a time in ns", f[0])
	}
	return time.Duration(ns), nil
}
