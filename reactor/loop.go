package reactor

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/affinity"
	"github.com/ecxfer/ecxfer/internal/testhook"
	"github.com/ecxfer/ecxfer/nixl"
)

// run is the reactor thread. It never unlocks its OS thread: when it
// returns, the runtime retires the thread, so a pinned affinity mask never
// leaks into the pool of threads other goroutines use.
func (r *Reactor) run(ready chan<- error, setup Setup) {
	runtime.LockOSThread()
	defer func() {
		close(r.done)
		// A record handed over after the last flush (by a caller
		// draining notifications): later ones are their callers' to write.
		if r.ev.log != nil {
			r.flushDeferred()
		}
	}()
	// The engine token (help.go), held from here on except while the
	// loop is idle: parked, napping. Never given back once the loop has
	// stopped (the engine is closed then).
	r.lockEngine()
	r.tid.Store(int32(unix.Gettid()))
	if err := r.pin(); err != nil {
		ready <- err
		return
	}
	if setup != nil {
		descs, dl, err := setup(r.agent)
		if err != nil {
			ready <- err
			return
		}
		g, ok := descriptors.GridOf(descs)
		r.loc.Store(&local{descs: descs, dlist: dl, grid: g, isGrid: ok})
	}
	ready <- nil
	r.logStart()
	defer func() {
		r.flushEvents(true)
		r.logStop(threadCPU())
		// Saved after the logger has run on this thread: a figure read
		// from /proc meanwhile is not above it (ThreadCPU).
		r.finalCPU.Store(int64(threadCPU()))
	}()

	events := make([]unix.EpollEvent, 4)
	last := r.now()
	for !r.stop {
		// While callers step in (help.go), the thread's turns leave the
		// engine's progress to them: a turn of its own would take the
		// token, and a core, from the caller that is taking the READ's
		// data in.
		helped := r.opts.Idle != IdleSpin && r.helpWanted()
		worked := r.turn(!helped)
		if worked {
			last = r.lastTime
			r.armBusy = false
		}
		if helped && !r.stop && r.helpWanted() {
			// Callers are stepping in (help.go): stand aside, even while
			// there is work (a READ's data arriving): they do it. Once
			// they stop, the idle strategy starts over. The nap is not
			// busy time, whatever the turn before it found.
			r.lastWork = false
			r.nap()
			last = r.now()
			continue
		}
		if worked {
			continue
		}
		if (r.opts.Idle == IdleHybrid || r.opts.Idle == IdlePark) && r.copyNapWanted() {
			// Large copies on the workers and nothing else to do: sleep
			// without holding a P (copyNap). The idle strategy starts
			// over when they end.
			r.lastWork = false
			r.copyNap()
			last = r.now()
			continue
		}
		idle := time.Duration(r.lastTime - last)
		switch r.opts.Idle {
		case IdleSpin:
			continue
		case IdleYield:
			schedYield()
			continue
		case IdleHybrid:
			if idle < r.opts.SpinFor {
				continue
			}
			if idle < r.opts.YieldFor {
				// An OS-level yield: the thread keeps its P (it is locked
				// to it anyway), but other threads and processes, such as
				// the peer's reactor on a small machine, get the core.
				schedYield()
				continue
			}
		}
		r.park(events, idle)
		if r.dir != nil {
			r.dir.ns.lastRecv = 0 // a notification may be what woke it
		}
	}
}

func (r *Reactor) pin() error {
	switch {
	case r.opts.PinCPU:
		return affinity.PinThread(r.opts.CPU)
	case r.opts.BindNUMA:
		cpu, err := affinity.PickCPU(r.opts.NUMANode)
		if err != nil {
			return err
		}
		return affinity.PinThread(cpu)
	}
	return nil
}

// park sleeps until a submission, an engine event or the next deadline.
// The sleeping flag is raised before the last look at the rings, and
// submitters push before they look at the flag: with sequentially
// consistent atomics at least one of the two sees the other, so a
// submission is never left behind a sleeping reactor.
func (r *Reactor) park(events []unix.EpollEvent, idle time.Duration) {
	r.sleeping.Store(true)
	defer r.sleeping.Store(false)
	if r.sub.Len() > 0 || r.cancel.Len() > 0 || r.ctrl.Len() > 0 {
		return
	}
	if d := r.dir; d != nil && (d.finished.Len() > 0 || d.notifQ.Len() > 0 || len(d.overflow) > 0) {
		return
	}
	if ok, err := r.agent.Arm(); err != nil || !ok {
		// The engine has events pending, so its fd cannot be armed: the
		// next turn normally handles them (ucx's Arm progresses the
		// worker first, so a message that arrived since the last turn is
		// found here). But an engine can stay busy with work that never
		// finishes and never shows (UCX retrying sends into the full
		// shared-memory queue of a dead peer). After YieldFor without any
		// work, and a turn since the last busy Arm that found none, nap
		// instead of spinning.
		if idle < r.opts.YieldFor || !r.armBusy {
			r.armBusy = true
			return
		}
		// The engine's fd stays readable: wait on the wake-up fd alone.
		r.st.parks.Add(1)
		fds := [1]unix.PollFd{{Fd: int32(r.wakeFD), Events: unix.POLLIN}}
		r.unlockEngine()
		n, _ := unix.Poll(fds[:], 1)
		r.lockEngine()
		if n > 0 {
			r.drainWake()
		}
		return
	}
	r.armBusy = false
	r.st.parks.Add(1)
	ms := r.parkMillis()
	// Callers may step in while the thread sleeps (help.go); their
	// progress may leave the engine's fd readable with nothing to do,
	// which costs one empty turn.
	r.unlockEngine()
	n, _ := unix.EpollWait(r.epollFD, events, ms)
	r.lockEngine()
	// The wake-up fd is read only when it woke us: a producer's reactor
	// wakes for every burst of gets it serves, and an empty read is one
	// more system call each time. Left unread, it would wake the next
	// park at once, which reads it then.
	for _, ev := range events[:max(n, 0)] {
		switch {
		case ev.Fd == int32(r.wakeFD):
			r.drainWake()
		case r.dir != nil && ev.Fd != int32(r.agent.EventFD()) && ev.Fd != int32(r.dir.ns.rfd):
			// A watched peer's pidfd (the only other fds in the set).
			r.dir.pidfdWoke = true
		}
	}
}

// drainWake resets the wake-up eventfd.
func (r *Reactor) drainWake() {
	var buf [8]byte
	_, _ = unix.Read(r.wakeFD, buf[:])
}

// parkMillis is how long park may sleep in epoll, in milliseconds (at
// least 1): ParkTimeout, or less when something is due without an event to
// wake the loop.
func (r *Reactor) parkMillis() int {
	timeout := r.opts.ParkTimeout
	if r.agent.EventFD() < 0 && timeout > time.Millisecond {
		timeout = time.Millisecond // the engine cannot wake us
	}
	if d := r.dir; d != nil && (len(d.ns.backlog) > 0 || len(d.held) > 0) && timeout > time.Millisecond {
		// Notifications a producer's full socket refused are retried
		// every turn, and nothing wakes the loop when that socket drains;
		// held direct READs are looked at every turn too (their fences
		// may go with a process's exit, their timeout may pass).
		timeout = time.Millisecond
	}
	if t := r.timeout.Load(); t > 0 && r.pLen > 0 {
		// The oldest READ's age is subtracted from t, not its post time
		// added to it: a t near the largest Duration (a timeout meant as
		// "never") would wrap.
		until := time.Duration(t - (r.now() - r.postings[r.pHead].posted))
		if until < timeout {
			timeout = until
		}
	}
	if due, ok := r.eventsDue(); ok {
		// Folded events are logged when their second is up.
		if until := time.Duration(due - r.now()); until < timeout {
			timeout = until
		}
	}
	// Rounded up by remainder, not by adding 999,999 ns first: a
	// ParkTimeout near the largest Duration would wrap negative.
	ms := timeout / time.Millisecond
	if timeout%time.Millisecond > 0 {
		ms++
	}
	return int(min(max(ms, 1), 1<<30))
}

// turn does one bounded round of work and reports whether it found any.
// Without progress it does not progress the engine (callers step in for
// it).
func (r *Reactor) turn(progress bool) bool {
	now := r.now()
	if r.lastWork {
		r.st.busyNs.Add(uint64(now - r.lastTime))
	}
	r.lastTime = now
	r.postClock = now
	r.st.loops.Add(1)
	work := false

	if n := r.ctrl.Drain(r.ctrlBuf); n > 0 {
		work = true
		for _, op := range r.ctrlBuf[:n] {
			if r.stop {
				// Queued behind Close in the same batch: the peers and
				// the engine are gone, and an operation run now would
				// fail for the wrong reason (or, like SetDirect, leave
				// something nobody closes).
				op.done <- ErrClosed
				continue
			}
			op.done <- op.fn()
		}
		clear(r.ctrlBuf[:n])
		if r.stop {
			r.lastWork = true
			return true
		}
	}
	if n := r.cancel.Drain(r.batch); n > 0 {
		work = true
		for _, h := range r.batch[:n] {
			r.onCancel(h)
		}
	}
	if n := r.sub.Drain(r.batch); n > 0 {
		work = true
		for _, h := range r.batch[:n] {
			r.submit(h)
		}
	}
	if r.dir != nil && r.drainDirect() {
		work = true
	}
	if progress {
		if did, err := r.agent.Progress(); did {
			work = true
		} else if err != nil {
			r.engineError("progress", err)
		}
	}
	completed := r.pollCompletions()
	if r.pLen > 0 {
		completed += r.expire()
	}
	if r.dir != nil && len(r.dir.held) > 0 && r.releaseHeldJobs() {
		work = true
	}
	if r.takeNotifs() {
		work = true
	}
	if completed > 0 {
		work = true
	}
	if r.ended {
		// Some transfer left PROC this turn (completed, failed before it
		// reached the engine, aborted by a control operation): wake Wait.
		r.ended = false
		if r.broadcast() && r.opts.Idle != IdlePark {
			// It woke callers asleep in a crowd (crowd.go): Go queued
			// them on this thread's processor, which a thread that
			// spins keeps until Go preempts it (10 ms). Hand it over.
			runtime.Gosched()
		}
	}
	if r.ev.errs.pending > 0 || r.ev.tmo.pending > 0 {
		r.flushEvents(false)
	}
	if r.ev.hasDeferred.Load() {
		r.flushDeferred()
	}
	r.lastWork = work
	return work
}

// pollCompletions publishes the transfers the engine reports finished and
// returns how many.
func (r *Reactor) pollCompletions() int {
	completed := 0
	for {
		n := r.agent.PollCompletions(r.comps)
		for _, c := range r.comps[:n] {
			r.complete(c)
		}
		completed += n
		if n < len(r.comps) {
			return completed
		}
	}
}

// engineNotifCounts copies the engine's counts of notifications it lost
// into the stats.
func (r *Reactor) engineNotifCounts() {
	if r.dropper != nil {
		r.st.notifsDroppedByEngine.Store(r.dropper.DroppedNotifs())
	}
	if r.undeliverer != nil {
		r.st.notifsUndeliveredByEngine.Store(r.undeliverer.UndeliveredNotifs())
	}
	if r.gathers != nil {
		r.st.storeGatherCounts(r.gathers.GatherCounts())
	}
}

// takeNotifs moves the notifications the engine received into the map
// NewNotifs and WaitNotifs read, and reports whether there were any.
func (r *Reactor) takeNotifs() bool {
	n := r.agent.GetNotifs(r.notifTmp)
	r.engineNotifCounts()
	if n == 0 {
		return false
	}
	n = 0
	r.dropOversized()
	r.notifMu.Lock()
	for k, v := range r.notifTmp {
		for _, m := range v {
			if r.holdNotif(k, m) {
				n++
			}
		}
	}
	r.notifMu.Unlock()
	r.st.notifsReceived.Add(uint64(n))
	clear(r.notifTmp)
	r.ended = true // wake WaitNotifs
	return true
}

// dropOversized removes from notifTmp the notifications longer than
// MaxNotif, whatever limit their sender was configured with, counts them
// and logs the first from each sender; and those whose sender the engine
// names with a name no agent can have (ValidName: empty, longer than 256
// bytes, or not printable ASCII), which it counts. It returns how many it
// dropped.
func (r *Reactor) dropOversized() int {
	dropped := 0
	for sender, msgs := range r.notifTmp {
		if !ValidName(sender) {
			dropped += len(msgs)
			r.st.notifsBadSender.Add(uint64(len(msgs)))
			clear(msgs)
			delete(r.notifTmp, sender)
			continue
		}
		keep := msgs[:0]
		for _, m := range msgs {
			if len(m) <= r.opts.MaxNotif {
				keep = append(keep, m)
				continue
			}
			dropped++
			r.st.notifsOversized.Add(1)
			r.logOversized(sender, len(m))
		}
		clear(msgs[len(keep):])
		if len(keep) == 0 {
			delete(r.notifTmp, sender)
		} else {
			r.notifTmp[sender] = keep
		}
	}
	return dropped
}

// broadcast wakes every blocked caller (Wait, WaitNotifs, Release, and
// the callers asleep in a crowd) and reports whether it woke one of the
// latter.
func (r *Reactor) broadcast() (crowd bool) {
	if r.waiters.Load() == 0 {
		return false
	}
	r.waitMu.Lock()
	for _, w := range r.waitList {
		select {
		case w.ch <- struct{}{}:
			crowd = crowd || w.crowd
		default: // signaled already and not yet awake
		}
	}
	r.waitMu.Unlock()
	return crowd
}

// submit posts one drained submission.
func (r *Reactor) submit(h uint64) {
	s, w := r.tab.lookup(h)
	if s == nil {
		return // released and freed already
	}
	s.cancelDrained = false
	s.queued = false
	if wordState(w) == stCanceling {
		// Released before it was posted; onCancel frees the slot when it
		// drains the release's cancel entry.
		r.st.canceled.Add(1)
		r.dropJob(s)
		s.trim()
		return
	}
	s.xfer = 0
	p := s.peer
	if code := p.gone.Load(); code != 0 {
		r.dropJob(s)
		s.trim()
		if code == codeCanceled {
			// Queued when its peer was removed: dropped with it, like
			// the peer's READs in flight (abort).
			r.st.canceled.Add(1)
			r.finish(h, s, code)
			return
		}
		r.fail(h, s, code)
		return
	}
	if s.job != nil {
		if r.fencing() && r.jobFenced(s.job) {
			r.holdJob(s.job)
			return
		}
		r.submitDirect(h, s, p)
		return
	}
	loc := r.loc.Load()
	// The notification stays with the slot: the reactor sends it itself,
	// once the READ is published DONE (see complete).
	id, err := r.agent.MakeXfer(nixl.Read, loc.dlist, s.localIdx, p.dlist, s.remoteIdx, nil)
	// The engine copied the indices: drop buffers too large to keep (the
	// slot is still ours, nothing is published yet).
	s.trimIdx()
	if err == nil {
		if err = r.agent.PostXfer(id); err != nil {
			_ = r.agent.ReleaseXfer(id)
		}
	}
	if err != nil {
		code := codeOf(err)
		if code == codeRemoteDisconnect {
			// Not the engine's fault: the peer is gone.
			r.st.engineErrors.Add(1)
			r.peerDead(p, err.Error())
		} else {
			r.engineError("post", err)
		}
		r.fail(h, s, code)
		return
	}
	s.xfer = id
	r.xfers[id] = h
	r.inflight.Add(1)
	// Every posting is recorded, with the timeout on or off: the timeout
	// can be set later and then applies to this transfer too.
	if r.pLen == len(r.postings) {
		r.compactPostings()
	}
	r.postings[(r.pHead+r.pLen)%len(r.postings)] = posting{h: h, posted: r.postClock}
	r.pLen++
}

// compactPostings drops the entries of transfers that already finished.
// The ring has a place per table slot and at most one live entry per slot,
// and the transfer being posted has none yet, so after compaction there is
// always room.
func (r *Reactor) compactPostings() {
	n := len(r.postings)
	kept := 0
	for i := 0; i < r.pLen; i++ {
		d := r.postings[(r.pHead+i)%n]
		if s, w := r.tab.lookup(d.h); s != nil && wordState(w) == stProc {
			r.postings[(r.pHead+kept)%n] = d
			kept++
		}
	}
	for i := kept; i < r.pLen; i++ {
		r.postings[(r.pHead+i)%n] = posting{}
	}
	r.pLen = kept
}

// finish publishes the end of an in-flight transfer whose engine request
// has already been released, and reports whether it did. A slot released
// meanwhile is left as it is (false): onCancel frees it.
func (r *Reactor) finish(h uint64, s *slot, code uint64) bool {
	trimmed := false
	for {
		w := s.word.Load()
		if w&r.tab.genMask() != h&r.tab.genMask() {
			return false
		}
		if !trimmed {
			// The slot's buffers are the reactor's until the state word
			// says otherwise: drop the large ones now.
			s.trim()
			trimmed = true
		}
		switch wordState(w) {
		case stProc:
			nw := w &^ (stateMask | r.tab.mask) // keep the generation
			if code == codeNone {
				nw |= stDone
			} else {
				nw |= code<<errShift | stErr
			}
			if s.word.CompareAndSwap(w, nw) {
				r.ended = true
				return true
			}
		default:
			return false
		}
	}
}

// fail ends a transfer that never reached the engine.
func (r *Reactor) fail(h uint64, s *slot, code uint64) {
	r.countEnd(s, code)
	r.finish(h, s, code)
}

// countEnd counts a READ about to end with the failure code: as canceled
// when the caller has released it already (finish will not publish the
// failure, and the caller asked for it to stop), as failed otherwise. A
// release racing this call between the check and finish is counted
// failed.
func (r *Reactor) countEnd(s *slot, code uint64) {
	if code == codeCanceled || wordState(s.word.Load()) == stCanceling {
		r.st.canceled.Add(1)
		return
	}
	r.countFailed(s.peer, code)
}

func (r *Reactor) complete(c nixl.Completion) {
	h, ok := r.xfers[c.ID]
	if !ok {
		return
	}
	delete(r.xfers, c.ID)
	r.inflight.Add(-1)
	_ = r.agent.ReleaseXfer(c.ID)
	s := &r.tab.slots[h&r.tab.mask]
	if c.Err != nil {
		code := codeOf(c.Err)
		if wordState(s.word.Load()) == stCanceling {
			r.st.canceled.Add(1)
		} else {
			// Canceled by the engine (a READ nobody released: the
			// reactor's own cancels and aborts never come back here) is
			// a failure: counted as such, and an engine error.
			r.countFailed(s.peer, code)
		}
		switch code {
		case codeRemoteDisconnect:
			r.peerDead(s.peer, c.Err.Error())
		case codeEngine, codeCanceled:
			r.engineError("xfer", c.Err)
		}
		r.finish(h, s, code)
		return
	}
	// Once finish publishes DONE the caller may release the handle and a
	// new READ may take the slot: take what is still needed out of it
	// first. The message buffer leaves the slot and goes back to msgPool
	// once sent, so no READ allocates.
	p, bytes, notify := s.peer, s.bytes, s.hasNotif
	took := time.Duration(r.now() - s.start) // stamped before DONE is published
	var msg []byte
	if notify {
		msg, s.notif = s.notif, nil
	}
	if !r.finish(h, s, codeNone) {
		// Released while the engine finished it: canceled, and the
		// producer is not told its blocks are free.
		r.st.canceled.Add(1)
	} else {
		// Only now, with the READ published DONE, is the producer told:
		// a READ released or timed out first never notifies.
		r.readDone(p, bytes, took, notify, msg)
	}
	if notify {
		msgPool.put(msg)
	}
}

// readDone counts a READ of n bytes from p that finish published DONE
// took from the start of its Post, and then sends p its notification msg
// if it has one.
func (r *Reactor) readDone(p *Peer, n uint64, took time.Duration, notify bool, msg []byte) {
	r.countDone(p, n)
	r.st.latency.Add(took)
	if notify {
		r.sendDoneNotif(p, msg)
	}
}

// sendDoneNotif sends p the notification of a READ that ended DONE. A send
// that fails at once is an engine error, not a notification sent.
func (r *Reactor) sendDoneNotif(p *Peer, msg []byte) {
	if err := r.notify(p, msg); err != nil {
		r.engineError("notify", err)
	} else {
		r.st.notifsSent.Add(1)
	}
}

// countDone counts a READ of n bytes from p that ended DONE. Atomics only:
// safe off the loop thread.
func (r *Reactor) countDone(p *Peer, n uint64) {
	r.st.done.Add(1)
	r.st.bytes.Add(n)
	p.pc.done.Add(1)
	p.pc.bytes.Add(n)
}

// abort releases an in-flight transfer's engine request and ends it with
// code.
func (r *Reactor) abort(h uint64, code uint64) {
	s := &r.tab.slots[h&r.tab.mask]
	if _, ok := r.xfers[s.xfer]; !ok || r.xfers[s.xfer] != h {
		return
	}
	delete(r.xfers, s.xfer)
	r.inflight.Add(-1)
	_ = r.agent.ReleaseXfer(s.xfer)
	r.countEnd(s, code)
	r.finish(h, s, code)
}

// onCancel handles one cancel entry. It is the only place that frees a
// canceling slot, and it does so as it drains the slot's one entry: a slot
// cannot be claimed again, released in flight again and so queue a second
// entry before its first is drained. That bounds the cancel ring's
// contents by the table's size.
func (r *Reactor) onCancel(h uint64) {
	s, w := r.tab.lookup(h)
	if s == nil || wordState(w) != stCanceling {
		return
	}
	if s.queued {
		// Released before the loop took its submission: it was never
		// posted, and submit will not find the slot once it is freed.
		s.queued = false
		r.st.canceled.Add(1)
	}
	if id := s.xfer; id != 0 {
		if got, ok := r.xfers[id]; ok && got == h {
			delete(r.xfers, id)
			r.inflight.Add(-1)
			_ = r.agent.ReleaseXfer(id)
			r.st.canceled.Add(1)
		}
	}
	if s.job != nil {
		if r.dir != nil && len(r.dir.held) > 0 {
			r.dir.heldCheck = true // it may be one of them
		}
		if s.job.running {
			// endJob frees the slot when the copy ends; this entry is
			// drained, so the slot may be claimed again then. The chunks
			// not started yet are skipped, and Release, which waits for
			// the slot to be freed, returns after the running ones.
			s.cancelDrained = true
			s.job.stop.Store(true)
			r.ended = true
			return
		}
		r.dropJob(s)
	}
	// Released before submit saw it, the request may still hold large
	// buffers.
	s.trim()
	r.tab.free(s, w)
	r.ended = true // a Wait blocked on this handle must see it gone
}

// expire ends the transfers older than the timeout in force now, and drops
// the entries of transfers that have finished from the front of the ring.
// Entries are in post order and one timeout applies to all of them, so the
// transfers expire in that order too and only the front needs looking at.
// With the timeout off it only drops finished entries.
func (r *Reactor) expire() int {
	t := r.timeout.Load()
	n := 0
	peer := ""
	for r.pLen > 0 {
		d := r.postings[r.pHead]
		s, w := r.tab.lookup(d.h)
		live := s != nil && wordState(w) == stProc && s.xfer != 0
		if live && (t <= 0 || r.lastTime-d.posted < t) {
			break
		}
		r.postings[r.pHead] = posting{}
		r.pHead = (r.pHead + 1) % len(r.postings)
		r.pLen--
		if live {
			if n == 0 {
				peer = s.peer.Name
			}
			r.abort(d.h, codeTimeout)
			n++
		}
	}
	r.logTimeouts(n, peer)
	return n
}

// ----------------------------------------------------------------------------
// Control operations; they run on the reactor thread through do.

// AddPeer loads a peer's metadata and prepares its block list. Loading the
// same metadata and list again returns the same name. New metadata under a
// known name replaces the peer: reads of the old one end in
// ErrRemoteDisconnect.
func (r *Reactor) AddPeer(md []byte, descs descriptors.List) (string, error) {
	return r.AddPeerDirect(md, descs, nil)
}

// AddPeerDirect is AddPeer for a peer on this host whose region d reaches
// without the engine (nil: the engine path). The reactor owns d from here
// on, whatever the outcome: it closes it when the peer goes, or at once
// when d is not used (an error, the same peer loaded again, or a reactor
// without the direct path).
func (r *Reactor) AddPeerDirect(md []byte, descs descriptors.List, d *Direct) (string, error) {
	if r.closing.Load() {
		if d != nil {
			d.Close()
		}
		return "", ErrClosed
	}
	var name string
	ran := false
	err := r.do(func() error {
		ran = true
		var err error
		name, err = r.addPeer(md, descs, d)
		return err
	})
	if !ran && d != nil {
		d.Close()
	}
	return name, err
}

func (r *Reactor) addPeer(md []byte, descs descriptors.List, d *Direct) (_ string, err error) {
	// Inline READs that were DONE before this call queued notifications
	// the loop has not sent yet: out they go while their peer is still
	// the one they were for (a replaced peer's go by name, through the
	// engine, when it has no socket, or when they do not fit one).
	r.sendQueuedNotifs()
	if d != nil {
		defer func() {
			if err != nil || !r.isDirect(d) {
				d.Close()
			}
		}()
	}
	name, err := r.agent.LoadRemoteMetadata(md)
	restarted, failed := false, 0
	// dropped: the restarted peer dropped before its new metadata is
	// loaded (engines that cannot stage), still published; if this call
	// fails from here on, it goes, and says so.
	var dropped *Peer
	defer func() {
		if err != nil && dropped != nil {
			r.publishPeer(dropped.Name, nil)
			r.unwatchPeer(dropped)
			r.logPeer(EventPeerRemoved, dropped.Name, slog.Int("reads_canceled", failed),
				slog.String("why", "restarted, and its new metadata was refused"))
		}
	}()
	// stage: the restarted peer, loaded beside the old one, which keeps
	// working until the new one is ready (engines that can).
	var stage nixl.StagedPeer
	// kept: the counters of a restarted peer dropped before its new
	// metadata is loaded (engines that cannot stage), for the new peer.
	var kept *peerCounters
	if errors.Is(err, nixl.ErrNotAllowed) && name != "" {
		// Changed metadata under a loaded name: the peer restarted.
		old := r.peer(name)
		if st, ok := r.agent.(nixl.MetadataStager); ok && old != nil {
			stage, err = st.StageRemoteMetadata(md)
			restarted = true
		} else {
			if old != nil {
				// Dropped, but left published (its READs fail as it is
				// gone) until the new one replaces it: a scrape meanwhile
				// must not see the name vanish and give its per-peer
				// series' place to another peer. Should the new one not
				// load, it goes then (below).
				failed = r.dropPeerAs(old, codeRemoteDisconnect, false)
				kept = old.pc
				restarted = true
				dropped = old
				testhook.Run(&testhook.RestartDropped)
			} else if ierr := r.agent.InvalidateRemoteMetadata(name); ierr != nil {
				return "", fmt.Errorf("%w: replacing %q: %v", ErrBadMetadata, name, ierr)
			}
			name, err = r.agent.LoadRemoteMetadata(md)
		}
	}
	if err != nil {
		if outOfResources(err) {
			return "", fmt.Errorf("%w: %w", ErrEngine, err)
		}
		return "", fmt.Errorf("%w: %v", ErrBadMetadata, err)
	}
	old := r.peer(name)
	if old == dropped {
		old = nil // dropped above: replaced as a new peer, with its counters (kept)
	}
	// undo forgets what this call loaded, leaving the peer as it was.
	undo := func() {
		switch {
		case stage != nil:
			stage.Abort()
		case old == nil:
			_ = r.agent.InvalidateRemoteMetadata(name)
		}
	}
	if !ValidName(name) {
		// Published peers all have valid names, so old and stage are nil.
		undo()
		return "", wrapf(ErrBadMetadata, "peer name %q: want 1 to 256 bytes of printable ASCII without spaces", name)
	}
	if stage == nil && old != nil && slices.Equal(descs, old.Descs) {
		return name, nil
	}
	shared := false
	if stage != nil {
		shared = stage.SharedQueueGets()
	} else if sq, ok := r.agent.(nixl.SharedQueueGetter); ok {
		shared = sq.SharedQueueGets(name)
	}
	if shared && (d == nil || r.dir == nil) {
		undo()
		return "", wrapf(ErrConfig, "peer %q: its blocks are memory it registered itself on this host, "+
			"which the engine reads with gets the peer answers through this process's shared-memory receive queue; "+
			"a peer that dies mid-answer stops transfers from every peer. "+
			"Read it directly (Config.Direct auto or on; the option \"direct\" from Python), give the producer an engine-allocated region, "+
			"or set UCX_TLS without shared memory", name)
	}
	var dl nixl.DlistID
	if stage != nil {
		dl, err = stage.PrepDlist(descs, nixl.DRAM)
	} else {
		dl, err = r.agent.PrepDlist(name, descs, nixl.DRAM)
	}
	if err != nil {
		undo()
		return "", fmt.Errorf("%w: %v", ErrBadDescriptor, err)
	}
	p := &Peer{Name: name, Descs: descs, dlist: dl, pc: &peerCounters{}}
	switch {
	case old != nil:
		p.pc = old.pc
	case kept != nil:
		p.pc = kept
	}
	p.grid, p.isGrid = descriptors.GridOf(descs)
	if d != nil && r.dir != nil {
		p.direct = d
	}
	if old != nil {
		// A new block list, or the restarted peer: the old one's READs
		// end, its list goes, and (restarted) the engine's old peer too.
		old.gone.Store(codeRemoteDisconnect)
		failed = r.failPeerReads(old, codeRemoteDisconnect)
		_ = r.agent.ReleaseDlist(old.dlist)
		r.unwatchPeer(old)
	}
	if stage != nil {
		stage.Commit()
	}
	if p.direct != nil {
		// Before callers can see p: its first notification must not
		// overtake those still waiting for an earlier peer of its socket.
		r.dir.ns.adopt(p)
	}
	r.publishPeer(name, p)
	if dropped != nil {
		r.unwatchPeer(dropped) // replaced by p just now
	}
	r.watchPeer(p)
	switch {
	case restarted:
		r.logPeer(EventPeerReplaced, name, slog.String("why", "restarted"),
			slog.Int("blocks", len(descs)), slog.Int("reads_failed", failed))
	case old != nil:
		r.logPeer(EventPeerReplaced, name, slog.String("why", "new block list"),
			slog.Int("blocks", len(descs)), slog.Int("reads_failed", failed))
	default:
		r.logPeer(EventPeerAdded, name, slog.Int("blocks", len(descs)))
	}
	return name, nil
}

// RemovePeer cancels the peer's in-flight reads, releases its prepared list
// and forgets it.
func (r *Reactor) RemovePeer(name string) error {
	if r.closing.Load() {
		return ErrClosed
	}
	return r.do(func() error {
		p := r.peer(name)
		if p == nil {
			return wrapf(ErrUnknownPeer, "%s", QuoteName(name))
		}
		r.sendQueuedNotifs() // as in addPeer
		n := r.dropPeer(p, codeCanceled)
		r.logPeer(EventPeerRemoved, name, slog.Int("reads_canceled", n))
		return nil
	})
}

// dropPeer forgets p, ending its reads in flight with code; it returns how
// many there were.
func (r *Reactor) dropPeer(p *Peer, code uint64) int {
	return r.dropPeerAs(p, code, true)
}

// dropPeerAs is dropPeer; without unpublish p stays where callers and
// PeerStats find it (gone: its READs fail with code), and watched, for
// the caller to replace or unpublish.
func (r *Reactor) dropPeerAs(p *Peer, code uint64, unpublish bool) int {
	p.gone.Store(code)
	n := r.failPeerReads(p, code)
	_ = r.agent.ReleaseDlist(p.dlist)
	_ = r.agent.InvalidateRemoteMetadata(p.Name)
	if unpublish {
		r.publishPeer(p.Name, nil)
		r.unwatchPeer(p)
	}
	return n
}

func (r *Reactor) failPeerReads(p *Peer, code uint64) int {
	n := 0
	for _, h := range r.xfers {
		if r.tab.slots[h&r.tab.mask].peer == p {
			r.abort(h, code)
			n++
		}
	}
	return n + r.failDirectReads(p, code)
}

func (r *Reactor) publishPeer(name string, p *Peer) {
	cur := *r.peers.Load()
	next := make(map[string]*Peer, len(cur)+1)
	for k, v := range cur {
		next[k] = v
	}
	if p == nil {
		delete(next, name)
	} else {
		next[name] = p
	}
	r.peers.Store(&next)
}

// Close stops the reactor: every in-flight transfer is released, every peer
// dropped, the agent closed, the thread retired. It is idempotent.
func (r *Reactor) Close() error {
	if r.onLoop() {
		return ErrReactorThread
	}
	if r.closing.Swap(true) {
		<-r.done
		return nil
	}
	var cerr error
	err := r.do(func() error {
		cerr = r.teardown()
		return nil
	})
	<-r.done
	r.closeFDs()
	if err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	return cerr
}

func (r *Reactor) teardown() error {
	// Notifications a direct peer's socket has not taken yet are sent
	// first, while the peers are still known alive (the engine's are
	// already in its queues).
	flushUntil := time.Now().Add(time.Second)
	r.flushNotifs(time.Second)
	for {
		n := r.cancel.Drain(r.batch)
		if n == 0 {
			break
		}
		for _, h := range r.batch[:n] {
			r.onCancel(h)
		}
	}
	for {
		n := r.sub.Drain(r.batch)
		if n == 0 {
			if r.sub.Len() == 0 {
				break
			}
			// A Post has claimed a place and not yet written it, and the
			// Posts behind it may have returned their handles believing
			// them queued: wait for it. (A Post that claims a place from
			// now on sees closing and deals with its own handle.)
			runtime.Gosched()
			continue
		}
		for _, h := range r.batch[:n] {
			s, w := r.tab.lookup(h)
			switch {
			case s == nil:
			case wordState(w) == stCanceling:
				// Released, and its cancel entry came after the drain
				// above: canceled, as submit and onCancel count it.
				if s.queued {
					s.queued = false
					r.st.canceled.Add(1)
				}
				r.dropJob(s)
				s.trim()
			default:
				if p := s.peer; r.finish(h, s, codeClosed) {
					r.countFailed(p, codeClosed)
				}
			}
		}
	}
	for _, h := range r.xfers {
		r.abort(h, codeClosed)
	}
	for _, p := range *r.peers.Load() {
		p.gone.Store(codeClosed)
		r.failDirectReads(p, codeClosed)
	}
	// Copies write into the local region, which goes with the engine.
	r.waitDirect()
	// An inline READ that passed Post's closing check before Close began
	// may have ended DONE and queued its notification after the flush
	// above: send those too, within what is left of the second.
	r.flushNotifs(max(0, time.Until(flushUntil)))
	// Notifications that arrived before Close are still handed out after
	// it: take what the engine and the direct path's socket hold (a loop
	// turn takes them only after its control operations, Close among them).
	r.takeNotifs()
	if r.dir != nil {
		r.drainNotifSocket()
		r.dir.ns.close()
	}
	for _, p := range *r.peers.Load() {
		_ = r.agent.ReleaseDlist(p.dlist)
		_ = r.agent.InvalidateRemoteMetadata(p.Name)
		r.unwatchPeer(p)
	}
	empty := map[string]*Peer{}
	r.final.Store(r.peers.Load()) // PeerStats keeps reporting them
	r.peers.Store(&empty)
	if loc := r.loc.Load(); loc != nil {
		_ = r.agent.ReleaseDlist(loc.dlist)
	}
	err := r.agent.Close()
	r.engineNotifCounts() // with what Close dropped
	// Every transfer the reactor owned has ended: free the slots of ended
	// transfers. A slot still CLAIMED or PROC belongs to a Post that
	// claimed it and has not handed it over (or handed it over after the
	// drain above); that Post sees closing, waits for the loop to end and
	// frees it, so no other Post can claim the slot while the first still
	// fills it in.
	testhook.Run(&testhook.BeforeSweep)
	for i := range r.tab.slots {
		s := &r.tab.slots[i]
		w := s.word.Load()
		if w == 0 || wordState(w) == stProc || wordState(w) == stClaimed {
			continue
		}
		if wordState(w) == stCanceling && s.queued {
			// Released before the loop took it, with its cancel entry
			// (and its submission, if any) pushed after the drains
			// above: canceled, as onCancel counts it.
			s.queued = false
			r.st.canceled.Add(1)
		}
		r.tab.free(s, w)
	}
	r.stop = true
	r.broadcast()
	return err
}

// schedYield gives the core to another runnable thread, if there is one.
func schedYield() { _, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }
