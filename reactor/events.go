package reactor

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Structured events. When Options.Logger is set, the reactor reports these,
// with the event name as the record's message and the details as
// attributes. They are rare by construction: nothing is logged per READ,
// and repeated events of one kind (timeouts, engine errors) are folded
// into one record per loop turn or per second with a count.
const (
	// EventReactorStart: the loop started. Attributes: pinned, cpu,
	// numa_node (when bound), idle, spin_for, yield_for, park_timeout,
	// batch, handles, submit_ring.
	EventReactorStart = "ecxfer.reactor.start"
	// EventReactorStop: the loop stopped. Attributes: uptime, cpu_time
	// (the reactor thread's user+system time), loop_turns, parks,
	// reads_done, reads_failed.
	EventReactorStop = "ecxfer.reactor.stop"
	// EventPeerAdded: a new peer was loaded. Attributes: peer, blocks.
	EventPeerAdded = "ecxfer.peer.added"
	// EventPeerReplaced: a known peer came back with new metadata (it
	// restarted) or a new block list; the old one's READs in flight end in
	// ErrRemoteDisconnect. Attributes: peer, why ("restarted" or
	// "new block list"), blocks, reads_failed.
	EventPeerReplaced = "ecxfer.peer.replaced"
	// EventPeerRemoved: RemoveRemotePeer dropped a peer. Attributes: peer,
	// reads_canceled (its READs in flight then; those still queued for
	// the loop end in ErrCanceled too, and count in
	// Stats.ReadsCanceled, as they reach it).
	EventPeerRemoved = "ecxfer.peer.removed"
	// EventPeerDead: a peer was found dead; logged once per peer (until it
	// is replaced). Attributes: peer, why.
	EventPeerDead = "ecxfer.peer.dead"
	// EventReadTimeout: READs reached XferTimeout and ended in ErrTimeout.
	// One record per loop turn that expired any. Attributes: count, peer
	// (of the first one), timeout.
	EventReadTimeout = "ecxfer.read.timeout"
	// EventEngineError: engine calls failed. At most one record per
	// second: failures within a second of a record are folded into the
	// next, which is written when that second is up. Attributes: op and
	// error (of the latest failure), count (failures since the last
	// record).
	EventEngineError = "ecxfer.engine.error"
	// EventNotifOversized: a notification longer than MaxNotif arrived
	// and was dropped (Stats.NotifsOversized counts them all). Logged once
	// per sender, for the first 1,024 senders. Attributes: peer, bytes,
	// limit.
	EventNotifOversized = "ecxfer.notif.oversized"
)

// events is the loop's logging state. Every method is a no-op without a
// logger, and none allocates then.
type events struct {
	log        *slog.Logger
	errAt      int64 // r.now() of the last engine error record
	errLogged  bool  // errAt is set
	errPending uint64
	// errOp and errMsg are the latest engine error not logged yet: the
	// record that folds the pending ones in names it.
	errOp, errMsg string
	// oversized holds the senders whose oversized notification was
	// logged; bounded so that a stream of invented names cannot grow it.
	// Under oversizedMu: a caller draining the notification socket
	// (Reactor.Notifs) logs too.
	oversizedMu sync.Mutex
	oversized   map[string]struct{}
}

// maxOversizedSenders bounds events.oversized.
const maxOversizedSenders = 1024

// logOversized logs EventNotifOversized once per sender. Loop thread only.
func (r *Reactor) logOversized(sender string, n int) {
	if r.ev.log == nil {
		return
	}
	r.ev.oversizedMu.Lock()
	_, seen := r.ev.oversized[sender]
	if !seen && len(r.ev.oversized) < maxOversizedSenders {
		if r.ev.oversized == nil {
			r.ev.oversized = map[string]struct{}{}
		}
		r.ev.oversized[sender] = struct{}{}
	} else {
		seen = true
	}
	r.ev.oversizedMu.Unlock()
	if seen {
		return
	}
	r.logEvent(slog.LevelWarn, EventNotifOversized,
		slog.String("peer", sender), slog.Int("bytes", n), slog.Int("limit", r.opts.MaxNotif))
}

func (r *Reactor) logEvent(level slog.Level, event string, attrs ...slog.Attr) {
	r.ev.log.LogAttrs(context.Background(), level, event, attrs...)
}

func (r *Reactor) logStart() {
	if r.ev.log == nil {
		return
	}
	o := r.opts
	attrs := []slog.Attr{slog.Bool("pinned", o.PinCPU || o.BindNUMA)}
	if o.PinCPU {
		attrs = append(attrs, slog.Int("cpu", o.CPU))
	}
	if o.BindNUMA {
		attrs = append(attrs, slog.Int("numa_node", o.NUMANode))
	}
	attrs = append(attrs,
		slog.String("idle", o.Idle.String()),
		slog.Duration("spin_for", o.SpinFor),
		slog.Duration("yield_for", o.YieldFor),
		slog.Duration("park_timeout", o.ParkTimeout),
		slog.Int("batch", o.BatchSize),
		slog.Int("handles", len(r.tab.slots)),
		slog.Int("submit_ring", r.sub.Cap()),
	)
	r.logEvent(slog.LevelInfo, EventReactorStart, attrs...)
}

// logStop runs on the reactor thread as it exits, so the thread's rusage
// is the reactor's own CPU time.
func (r *Reactor) logStop(cpu time.Duration) {
	if r.ev.log == nil {
		return
	}
	r.logEvent(slog.LevelInfo, EventReactorStop,
		slog.Duration("uptime", time.Since(r.epoch)),
		slog.Duration("cpu_time", cpu),
		slog.Uint64("loop_turns", r.st.loops.Load()),
		slog.Uint64("parks", r.st.parks.Load()),
		slog.Uint64("reads_done", r.st.done.Load()),
		slog.Uint64("reads_failed", r.st.failed.Load()),
	)
}

// threadCPU is the calling OS thread's user+system time, 0 if unknown.
func threadCPU() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func (r *Reactor) logPeer(event, name string, attrs ...slog.Attr) {
	if r.ev.log == nil {
		return
	}
	level := slog.LevelInfo
	if event == EventPeerDead {
		level = slog.LevelWarn
	}
	r.logEvent(level, event, append([]slog.Attr{slog.String("peer", name)}, attrs...)...)
}

// peerDead logs EventPeerDead once for p. Loop thread only.
func (r *Reactor) peerDead(p *Peer, why string) {
	if p == nil || p.deadLogged {
		return
	}
	p.deadLogged = true
	p.pc.dead.Store(true)
	r.logPeer(EventPeerDead, p.Name, slog.String("why", why))
}

func (r *Reactor) logTimeouts(n int, peer string) {
	if r.ev.log == nil || n == 0 {
		return
	}
	r.logEvent(slog.LevelWarn, EventReadTimeout,
		slog.Int("count", n),
		slog.String("peer", peer),
		slog.Duration("timeout", time.Duration(r.timeout.Load())),
	)
}

// engineError counts a failed engine call and logs it. Loop thread only.
func (r *Reactor) engineError(op string, err error) {
	r.st.engineErrors.Add(1)
	r.logEngineError(op, err)
}

// logEngineError logs an engine failure, at most one record per second:
// the failures of the second after a record are folded into the next one
// (with their count, naming the latest), which flushEngineErrors writes
// once the second has passed even if no failure follows. Loop thread only.
func (r *Reactor) logEngineError(op string, err error) {
	if r.ev.log == nil {
		return
	}
	r.ev.errPending++
	r.ev.errOp, r.ev.errMsg = op, "<nil>"
	if err != nil {
		r.ev.errMsg = err.Error()
	}
	r.flushEngineErrors(false)
}

// flushEngineErrors writes the record of the pending engine errors when a
// second has passed since the last one, or at once with force. Loop
// thread only.
func (r *Reactor) flushEngineErrors(force bool) {
	if r.ev.errPending == 0 {
		return
	}
	now := r.now()
	if !force && r.ev.errLogged && now-r.ev.errAt < int64(time.Second) {
		return
	}
	r.ev.errAt, r.ev.errLogged = now, true
	n := r.ev.errPending
	r.ev.errPending = 0
	r.logEvent(slog.LevelError, EventEngineError,
		slog.String("op", r.ev.errOp), slog.String("error", r.ev.errMsg), slog.Uint64("count", n))
}

// engineErrorsDue is the time (ns on r.now's clock) at which pending
// engine errors are to be logged, and false when none are pending.
func (r *Reactor) engineErrorsDue() (int64, bool) {
	return r.ev.errAt + int64(time.Second), r.ev.errPending > 0
}
