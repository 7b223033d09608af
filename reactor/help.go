package reactor

import (
	"math"
	"time"

	"golang.org/x/sys/unix"
)

// Callers that step in for the reactor.
//
// On a machine with few cores a caller that polls a READ in a loop and a
// reactor thread that spins beside it take two cores for one transfer,
// and the engine of the peer (across hosts: the producer that serves
// every get) waits for a core. A caller of raw engine calls uses one. So
// when the engine allows it (nixl.AnyThread), a caller that finds an
// engine READ in flight takes one step of the loop's engine work itself
// (step), and while callers do that in a loop, the reactor thread stands
// aside: its turns leave the engine's progress to them, and between
// turns it naps instead of spinning. One token
// (r.engine) says who drives the engine and owns the loop's state: the
// reactor thread holds it whenever it is not sleeping; a caller takes it
// only with a compare-and-swap and never waits for it, and does not try
// while the reactor thread waits for it. The price: while a caller holds
// the token, everything else the loop does waits for it, and a caller's
// goroutine can lose its CPU or its P in the middle of a step (the
// bounds below make that rare, not impossible).

// A caller's wish to step in counts (helpWanted) once callers have
// wished helpStreak times in a row, each within helpGap of the one
// before, and the last within helpGap: a caller polling in a loop, not
// one that checks once in a while (as vLLM's scheduler does once a step),
// whose READ would otherwise wait for the nap's end.
const (
	helpGap    = 200 * time.Microsecond
	helpStreak = 8
)

// crowdHold is how long callers do not step in after two READs were seen
// polled or posted at once.
const crowdHold = 10 * time.Millisecond

// napTurn is how often the napping reactor thread looks whether callers
// still step in (a variable for tests): it naps on while they do
// (napOn), and takes a turn of its own once they stopped or something of
// its own is due. Its turns used to come every napTurn, each taking the
// token from the caller for a while (on this 2-core VM with 1 ms,
// one-block READs across hosts had p99.9 of 0.2-1 ms against 0.1-0.2
// with 10 ms); while a caller steps in for the only READ, what else the
// loop does either wakes the nap (new READs, cancels, control
// operations, direct READs) or is due rarely (timeouts, which also cut
// the nap short, and folded events).
var napTurn = 10 * time.Millisecond

// lockEngine takes the token for the reactor thread. A caller's step
// holds it for microseconds to a millisecond (one that posts an image's
// 880 gets over TCP makes up to one system call for each), and on a small
// machine its thread may lose the CPU meanwhile: after a short spin the
// reactor thread sleeps on its wake-up fd, which every holder but the
// reactor thread writes as it hands the token back while the reactor
// thread wants it (releaseEngine, endFinished), or for at most
// lockSleep. Callers do not take the token while the reactor thread
// wants it.
func (r *Reactor) lockEngine() {
	if r.engine.CompareAndSwap(false, true) {
		return
	}
	r.wantEngine.Store(true)
	fds := [1]unix.PollFd{{Fd: int32(r.wakeFD), Events: unix.POLLIN}}
	for i := 0; !r.engine.CompareAndSwap(false, true); i++ {
		if i < 128 {
			continue
		}
		// A fresh timeout each time: ppoll writes back what was left of
		// it, zero after a sleep that timed out, and a zero timeout does
		// not sleep (reused, it turned this wait into a loop of system
		// calls that took a core from the caller holding the token).
		ts := unix.NsecToTimespec(int64(lockSleep))
		r.lockSleeps.Add(1)
		// The wake-up may have been meant for the loop: the turn that
		// follows looks at everything anyway.
		if n, _ := unix.Ppoll(fds[:], &ts, nil); n > 0 {
			r.drainWake()
		}
	}
	r.wantEngine.Store(false)
}

// lockSleep is the longest lockEngine sleeps before it looks again (a
// variable for tests). The hand-over wakes it, so this is a safety net,
// not how the wait ends: with 50 µs the reactor thread woke every 50 µs
// while a caller's step posted an image's gets, 6-25 times per wait,
// and each wake-up preempted the caller or the peer's engine on a
// 2-core machine (three pairs of runs across two network namespaces, in
// turn: the 880 x 5,120 B scattered row 0.88-0.92x `locked` with 50 µs,
// 1.00-1.03x with 2 ms).
var lockSleep = 2 * time.Millisecond

func (r *Reactor) unlockEngine() { r.engine.Store(false) }

// releaseEngine hands a caller's token back and wakes the reactor thread
// if it waits for it (lockEngine sleeps until then).
func (r *Reactor) releaseEngine() {
	r.engine.Store(false)
	if r.wantEngine.Load() {
		r.writeWake()
	}
}

// help is a caller's turn at the engine: if the reactor thread is not in
// a turn and no other caller is stepping in, it takes a step of the
// loop's engine work on the calling goroutine, and reports whether it
// did. h is the READ the caller polls (posting, from Post). A caller
// steps in only for the READ polled last (or one it just posted): callers
// polling different READs in turn leave the engine to the reactor
// thread, as do callers while more than helpMax READs are in flight or
// queued. With many callers at once, a step's goroutine that lost its
// CPU or its P would hold up the rest while they spin (measured before
// these bounds: the reactor thread waited up to 124 ms for the token
// with 64 polling callers on 2 cores, and READs of 4 callers on one host
// had p99 of 2-3 ms against 0.2-0.3 with the reactor thread alone), and
// the reactor thread serves many callers better anyway. A wish that
// follows the one before within helpGap, for the same READ or for one
// just posted, extends the streak (helpWanted).
func (r *Reactor) help(h uint64, posting bool) bool {
	if !r.helpable {
		return false
	}
	if !r.fewInFlight() {
		// The streak ends: the reactor thread must not stand aside for
		// callers that cannot step in.
		r.endStreak()
		return false
	}
	now := r.now()
	prev := r.helpHandle.Swap(h)
	if prev != h && prev != 0 {
		if s, w := r.tab.lookup(prev); s != nil && wordState(w) == stProc {
			// Another READ is polled or posted while this one is in
			// flight: more than one caller, or one with several READs.
			r.crowdAt.Store(now)
		}
	}
	if now-r.crowdAt.Load() < int64(crowdHold) {
		r.endStreak()
		return false
	}
	same := prev == h || posting
	if now-r.helpWant.Swap(now) < int64(helpGap) && same {
		if r.streak.Load() < helpStreak {
			r.streak.Add(1)
		}
	} else if r.streak.Load() != 0 {
		r.streak.Store(0)
	}
	if !same || r.closing.Load() || r.wantEngine.Load() || !r.engine.CompareAndSwap(false, true) {
		return false
	}
	if !r.stop && r.step(now) {
		// The next wish is measured from here: a step that found work
		// can take longer than helpGap (an image's gets posted and their
		// data taken in). One that found none took microseconds, and
		// the wish's own time stands (a clock read less per check).
		r.helpWant.Store(r.now())
	}
	r.releaseEngine()
	return true
}

// endStreak ends the callers' streak because they may not step in, and
// wakes a reactor thread napping for them: nobody would progress the
// engine until its nap ended.
func (r *Reactor) endStreak() {
	if r.streak.Load() != 0 {
		r.streak.Store(0)
	}
	if r.napping.Load() {
		r.writeWake()
	}
}

// unhelp withdraws the callers' wish to step in (a caller about to block)
// and wakes a napping reactor thread, so that nothing the caller waits for
// waits for the nap's end.
func (r *Reactor) unhelp() {
	if !r.helpable {
		return
	}
	r.helpWant.Store(math.MinInt64 / 2)
	r.streak.Store(0)
	if r.napping.Load() {
		r.writeWake()
	}
}

// fewInFlight reports whether callers may step in: at most helpMax READs
// in flight or queued.
func (r *Reactor) fewInFlight() bool {
	return r.inflight.Load()+int64(r.sub.Len()) <= r.helpMax
}

// helpWanted reports whether callers poll in a loop, want to step in
// (see helpStreak) and may.
func (r *Reactor) helpWanted() bool {
	return r.helpable && r.streak.Load() >= helpStreak && r.now()-r.helpWant.Load() < int64(helpGap) && r.fewInFlight()
}

// step is the engine part of a loop turn, run by a caller holding the
// token: post the queued READs, progress the engine, publish what ended,
// take the notifications that arrived, wake the blocked callers. now is
// the caller's clock reading, the post time of what it submits. It
// reports whether it found work. Cancels, control operations, timeouts
// and the direct path stay with the reactor thread.
func (r *Reactor) step(now int64) bool {
	r.postClock = now
	work := false
	for {
		n := r.sub.Drain(r.batch)
		for _, h := range r.batch[:n] {
			r.submit(h)
		}
		work = work || n > 0
		if n < len(r.batch) {
			break
		}
	}
	did, err := r.agent.Progress()
	if !did && err != nil {
		r.engineError("progress", err)
	}
	if r.pollCompletions() > 0 {
		work = true
	}
	if r.takeNotifs() {
		work = true
	}
	if r.ended {
		r.ended = false
		r.broadcast()
	}
	r.st.callerSteps.Add(1)
	return work || did
}

// nap is the reactor thread standing aside while callers step in: it
// gives up the token and sleeps for up to napTurn (or until a READ's
// timeout is due), its goroutine blocked on napWake and its P free for
// others, and sleeps on, napTurn after napTurn, while callers still step
// in and nothing is due (napOn). What a step leaves to it (cancels,
// control operations, direct READs, a READ posted while the token was
// taken, a caller that stops to block in Wait, callers that may no
// longer step in) wakes it. It does not wake to look whether the caller
// still polls: a look every 1 ms, even without the token, cost the
// caller more than it saved (two pairs of runs across two namespaces, in
// turn: one-block p50 35-37 against 21-31 µs, p99.9 0.23-0.73 against
// 0.09-0.35 ms, image rows 0.52-1.05x locked against 0.77-1.21x). So
// what arrives for the engine after the caller stopped polling
// (notifications, gets this process serves, a peer's error, a READ
// posted and stepped in for and then not polled) waits for the nap's
// end, up to twice napTurn. The napping flag is raised before the last look
// at the rings, as park raises sleeping: a submitter that pushed before
// it is seen here, one that pushes after it sees the flag (and steps in,
// or wakes the nap).
func (r *Reactor) nap() {
	r.napping.Store(true)
	// A wake-up meant for an earlier nap (sent as it ended) must not end
	// this one: drop it. One sent from here on is this nap's; what a
	// waker sent it for before the drop is seen below.
	select {
	case <-r.napWake:
	default:
	}
	// A caller that ended the streak (unhelp, endStreak) before the flag
	// was up did not wake us: look again.
	if !r.helpWanted() || r.sub.Len() > 0 || r.cancel.Len() > 0 || r.ctrl.Len() > 0 {
		r.napping.Store(false)
		return
	}
	if d := r.dir; d != nil && (d.finished.Len() > 0 || d.notifQ.Len() > 0 || len(d.overflow) > 0) {
		r.napping.Store(false)
		return
	}
	// No longer than park would sleep: a READ's timeout or a folded
	// event may be due sooner.
	d := min(time.Duration(r.parkMillis())*time.Millisecond, napTurn)
	r.st.naps.Add(1)
	r.sleepNapping(d, r.napLongest())
}

// napLongest is how long in all a nap may go on while callers step in
// (napOn): until something of the loop's own is due that nothing wakes it
// for. That is the oldest READ's timeout, the timeout of a READ a caller
// posts meanwhile (t from now at the soonest) and folded events; with
// direct READs held or notifications to send again it does not go on.
// Loop only (it reads the loop's state).
func (r *Reactor) napLongest() time.Duration {
	if d := r.dir; d != nil && (len(d.ns.backlog) > 0 || len(d.held) > 0) {
		return 0
	}
	longest := time.Duration(math.MaxInt64)
	if t := r.timeout.Load(); t > 0 {
		longest = time.Duration(t)
		if r.pLen > 0 {
			// As parkMillis: the oldest READ's age subtracted from t.
			longest = time.Duration(t - (r.now() - r.postings[r.pHead].posted))
		}
	}
	if due, ok := r.eventsDue(); ok {
		longest = min(longest, time.Duration(due-r.now()))
	}
	return longest
}

// napOn reports whether a nap whose napTurn is up may go on: callers
// still step in (their streak stands and the last wish is within
// napTurn: a caller in a long step, or off its CPU for a moment, still
// counts), they may (fewInFlight), and nothing waits for the reactor
// thread. Without the token. Each turn of its own at a nap's end took
// the token from the caller, and on a small machine the thread could
// lose its CPU holding it, with nobody driving the engine meanwhile:
// across two namespaces the reactor thread held the token 2.3-2.7% of
// the time of the 880 x 32 KiB image rows (its start-up included), about
// four holds a second of 1-108 ms making nearly all of it, a quarter of
// it off its CPU (one run); napping on, 1.6%, one such hold a second.
// Five pairs of runs in turn with a build that napped on, in an hour
// of slow rounds (880 x 32 KiB rows, reads/s over locked's per
// round): lower quartile 0.81 and 0.92 against 0.56 and 0.58, ahead of
// locked in 18 and 18 rounds of 50 against 14 and 12, the whole run's
// ratio higher in 9 pairs of 10. Five more pairs in a calm hour, with
// this code, moved nothing beyond the spread (medians 0.96-0.98 either
// way).
func (r *Reactor) napOn() bool {
	if r.closing.Load() || r.streak.Load() < helpStreak || r.now()-r.helpWant.Load() >= int64(napTurn) || !r.fewInFlight() {
		return false
	}
	if r.sub.Len() > 0 || r.cancel.Len() > 0 || r.ctrl.Len() > 0 {
		return false
	}
	d := r.dir
	if d != nil && d.ns.rfd >= 0 && r.notifWaiters.Load() > 0 {
		// A caller blocks in WaitNotifs, and the notification socket is
		// read by the thread's turns (and callers of Notifs), not by
		// callers' steps: a turn every napTurn at least.
		return false
	}
	return d == nil || (d.finished.Len() == 0 && d.notifQ.Len() == 0 && len(d.overflow) == 0 && d.holding.Load() == 0)
}

// sleepNapping gives up the token and blocks the reactor thread's
// goroutine until napWake or for d, then lowers the napping flag and
// takes the token back (nap, copyNap). A nap whose d is napTurn sleeps d
// again while napOn says it may and its time in all stays within longest.
// The goroutine blocks, not the thread in a system call: a thread asleep
// in a system call keeps its P, and Go's sysmon takes it back only by
// looking every 20 µs or so, which it then keeps doing (on a 2-core
// machine, beside the caller and the peer that serves it).
func (r *Reactor) sleepNapping(d, longest time.Duration) {
	r.unlockEngine()
	start := r.now()
	if r.napTimer == nil {
		r.napTimer = time.NewTimer(d)
	} else {
		r.napTimer.Reset(d)
	}
	for {
		select {
		case <-r.napWake:
			r.napTimer.Stop()
		case <-r.napTimer.C:
			if d == napTurn && r.now()-start <= int64(longest-d) && r.napOn() {
				r.st.napTurnsSkipped.Add(1)
				r.napTimer.Reset(d)
				continue
			}
		}
		break
	}
	r.napping.Store(false)
	r.lockEngine()
}
