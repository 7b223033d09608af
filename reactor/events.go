package reactor

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/testhook"
)

// Structured events. When Options.Logger is set, the reactor reports these,
// with the event name as the record's message and the details as
// attributes. They are rare by construction: nothing is logged per READ,
// and repeated events of one kind (timeouts, engine errors) are folded
// into at most one record per second, with a count.
const (
	// EventReactorStart: the loop started. Attributes: pinned, cpu (when
	// pinned to one), numa_node (when bound), idle, spin_for, yield_for, park_timeout,
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
	// At most one record per second, folded like EventEngineError.
	// Attributes: count (timeouts since the last record), peer (of the
	// first of them), timeout.
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
	log *slog.Logger
	// errs folds engine errors (a: op, b: error of the latest), tmo
	// timeouts (a: peer of the first).
	errs, tmo fold
	// oversized holds the senders whose oversized notification was
	// logged; bounded so that a stream of invented names cannot grow it.
	// Under oversizedMu: a caller draining the notification socket
	// (Reactor.Notifs) logs too.
	oversizedMu sync.Mutex
	oversized   map[string]struct{}
	// deferred holds the records of events noticed off the reactor
	// thread (a caller stepping in for it, a copy finisher, a caller
	// draining the notification socket), which the thread writes on its
	// next turn: a handler runs only there, never on a goroutine that
	// holds the engine token, where one that called Release (which waits
	// for the loop) deadlocked the reactor. Under deferMu; hasDeferred
	// says it is not empty.
	deferMu     sync.Mutex
	deferred    []deferredRecord
	hasDeferred atomic.Bool
}

// deferredRecord is one event record waiting for the reactor thread.
type deferredRecord struct {
	level slog.Level
	event string
	attrs []slog.Attr
}

// fold is one kind of event logged at most once per second: the events
// of the second after a record are counted and written as one record
// when that second is up, even if no event follows.
type fold struct {
	at      int64 // r.now() of the last record
	logged  bool  // at is set
	pending uint64
	a, b    string // what the pending record names
}

// ready reports whether the pending events are to be written at now.
func (f *fold) ready(now int64, force bool) bool {
	return f.pending > 0 && (force || !f.logged || now-f.at >= int64(time.Second))
}

// take marks a record written at now and returns the count it carries.
func (f *fold) take(now int64) uint64 {
	n := f.pending
	f.at, f.logged, f.pending = now, true, 0
	return n
}

// due is the time at which the pending events are to be written, and
// false when none are pending.
func (f *fold) due() (int64, bool) {
	return f.at + int64(time.Second), f.pending > 0
}

// maxOversizedSenders bounds events.oversized.
const maxOversizedSenders = 1024

// logOversized logs EventNotifOversized once per sender, for the first
// maxOversizedSenders senders. Loop thread only.
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

// logEvent writes a record on the reactor thread; called elsewhere it
// hands the record to the thread (see events.deferred), which writes it
// after those handed over before it.
func (r *Reactor) logEvent(level slog.Level, event string, attrs ...slog.Attr) {
	if !r.onLoop() && !r.loopEnded() {
		testhook.Run(&testhook.BeforeDefer)
		r.ev.deferMu.Lock()
		r.ev.deferred = append(r.ev.deferred, deferredRecord{level, event, slices.Clone(attrs)})
		r.ev.hasDeferred.Store(true)
		r.ev.deferMu.Unlock()
		if r.loopEnded() {
			// The thread stopped meanwhile, perhaps after its last
			// flush: nobody else would write the record.
			r.flushDeferred()
			return
		}
		r.writeWake() // events are rare: wake the thread whatever it is doing
		return
	}
	r.flushDeferred()
	r.ev.log.LogAttrs(context.Background(), level, event, attrs...)
}

// loopEnded reports whether the reactor thread has stopped for good (it
// wrote what was handed to it as it stopped: a record noticed later, by a
// caller draining notifications, is written by that caller).
func (r *Reactor) loopEnded() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// flushDeferred writes the records handed to the reactor thread. Reactor
// thread only, or anyone once the thread has stopped.
func (r *Reactor) flushDeferred() {
	if !r.ev.hasDeferred.Load() {
		return
	}
	r.ev.deferMu.Lock()
	recs := r.ev.deferred
	r.ev.deferred = nil
	r.ev.hasDeferred.Store(false)
	r.ev.deferMu.Unlock()
	for _, d := range recs {
		r.ev.log.LogAttrs(context.Background(), d.level, d.event, d.attrs...)
	}
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

// threadCPU is the calling OS thread's user+system time, 0 if unknown:
// from schedstat as ThreadCPU reads it (getrusage's figure is cut to
// microseconds and would put the exported counter below its last value).
func threadCPU() time.Duration {
	if t, err := schedstatCPU("/proc/thread-self/schedstat"); err == nil {
		return t
	}
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
	p.dead.Store(true)
	if r.dir != nil && len(r.dir.held) > 0 {
		r.dir.heldCheck = true // its held READs end
	}
	r.logPeer(EventPeerDead, p.Name, slog.String("why", why))
}

// logTimeouts counts n READs that timed out, the first of them from
// peer, and logs them folded (see fold). Loop thread only.
func (r *Reactor) logTimeouts(n int, peer string) {
	if r.ev.log == nil || n == 0 {
		return
	}
	if r.ev.tmo.pending == 0 {
		r.ev.tmo.a = peer
	}
	r.ev.tmo.pending += uint64(n)
	r.flushEvents(false)
}

// engineError counts a failed engine call and logs it. Loop thread only.
func (r *Reactor) engineError(op string, err error) {
	r.st.engineErrors.Add(1)
	r.logEngineError(op, err)
}

// logEngineError logs an engine failure folded (see fold): a record names
// the latest failure and counts those since the last. Loop thread only.
func (r *Reactor) logEngineError(op string, err error) {
	if r.ev.log == nil {
		return
	}
	r.ev.errs.pending++
	r.ev.errs.a, r.ev.errs.b = op, "<nil>"
	if err != nil {
		r.ev.errs.b = err.Error()
	}
	r.flushEvents(false)
}

// flushEvents writes the records of folded events whose second is up, or
// all pending ones with force. Loop thread only.
func (r *Reactor) flushEvents(force bool) {
	if r.ev.errs.pending == 0 && r.ev.tmo.pending == 0 {
		return
	}
	now := r.now()
	if f := &r.ev.errs; f.ready(now, force) {
		op, msg := f.a, f.b
		n := f.take(now)
		r.logEvent(slog.LevelError, EventEngineError,
			slog.String("op", op), slog.String("error", msg), slog.Uint64("count", n))
	}
	if f := &r.ev.tmo; f.ready(now, force) {
		peer := f.a
		n := f.take(now)
		r.logEvent(slog.LevelWarn, EventReadTimeout,
			slog.Int64("count", int64(n)),
			slog.String("peer", peer),
			slog.Duration("timeout", time.Duration(r.timeout.Load())),
		)
	}
}

// eventsDue is the time (ns on r.now's clock) at which pending folded
// events are to be logged, and false when none are pending.
func (r *Reactor) eventsDue() (int64, bool) {
	d1, ok1 := r.ev.errs.due()
	d2, ok2 := r.ev.tmo.due()
	switch {
	case ok1 && ok2:
		return min(d1, d2), true
	case ok1:
		return d1, true
	}
	return d2, ok2
}
