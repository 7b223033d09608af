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
// (step), and the reactor thread, seeing callers want to, naps after a
// turn that found no work instead of spinning. One token (r.engine) says
// who drives the engine and owns the loop's state: the reactor thread
// holds it whenever it is not idle; a caller takes it only with a
// compare-and-swap and never waits for it.

// helpNap is the longest nap while callers step in, and how recent a
// caller's wish to step in must be for the reactor thread to nap. What a
// step leaves to the loop (cancels, control operations, timeouts, held
// and direct READs) waits at most about this long, plus the kernel's
// timer slack; all but timeouts also wake the nap at once.
const helpNap = 100 * time.Microsecond

// lockEngine takes the token for the reactor thread. A caller's step
// holds it for microseconds; should its thread lose the CPU meanwhile,
// the reactor thread yields rather than spin against it.
func (r *Reactor) lockEngine() {
	for i := 0; !r.engine.CompareAndSwap(false, true); i++ {
		if i < 64 {
			continue
		}
		schedYield()
	}
}

func (r *Reactor) unlockEngine() { r.engine.Store(false) }

// help is a caller's turn at the engine: if the reactor thread is not in
// a turn and no other caller is stepping in, it takes a step of the
// loop's engine work on the calling goroutine. Either way it records the
// wish, which makes an idle reactor thread nap. It reports whether it
// took a step.
func (r *Reactor) help() bool {
	if !r.helpable {
		return false
	}
	r.helpWant.Store(r.now())
	if r.closing.Load() || !r.engine.CompareAndSwap(false, true) {
		return false
	}
	if !r.stop {
		r.step()
	}
	r.engine.Store(false)
	return true
}

// unhelp withdraws the callers' wish to step in (a caller about to block)
// and wakes a napping reactor thread, so that nothing the caller waits for
// waits for the nap's end.
func (r *Reactor) unhelp() {
	if !r.helpable {
		return
	}
	r.helpWant.Store(math.MinInt64 / 2)
	if r.napping.Load() {
		r.writeWake()
	}
}

// helpWanted reports whether a caller wanted to step in within the last
// helpNap.
func (r *Reactor) helpWanted() bool {
	return r.helpable && r.now()-r.helpWant.Load() < int64(helpNap)
}

// step is the engine part of a loop turn, run by a caller holding the
// token: post the queued READs, progress the engine, publish what ended,
// take the notifications that arrived, wake the blocked callers.
// Cancels, control operations, timeouts and the direct path stay with the
// reactor thread.
func (r *Reactor) step() {
	r.postClock = r.now()
	for {
		n := r.sub.Drain(r.batch)
		for _, h := range r.batch[:n] {
			r.submit(h)
		}
		if n < len(r.batch) {
			break
		}
	}
	if did, err := r.agent.Progress(); !did && err != nil {
		r.engineError("progress", err)
	}
	r.pollCompletions()
	r.takeNotifs()
	if r.ended {
		r.ended = false
		r.broadcast()
	}
	r.st.callerSteps.Add(1)
}

// nap is the reactor thread standing aside while callers step in: it
// gives up the token and sleeps on the wake-up fd for at most helpNap.
// The napping flag is raised before the last look at the rings, as park
// raises sleeping: a submitter that pushed before it is seen here, one
// that pushes after it sees the flag (and steps in, or wakes the nap).
func (r *Reactor) nap() {
	r.napping.Store(true)
	if r.sub.Len() > 0 || r.cancel.Len() > 0 || r.ctrl.Len() > 0 {
		r.napping.Store(false)
		return
	}
	if d := r.dir; d != nil && (d.finished.Len() > 0 || d.notifQ.Len() > 0) {
		r.napping.Store(false)
		return
	}
	r.st.naps.Add(1)
	r.unlockEngine()
	ts := unix.NsecToTimespec(int64(helpNap))
	fds := [1]unix.PollFd{{Fd: int32(r.wakeFD), Events: unix.POLLIN}}
	n, _ := unix.Ppoll(fds[:], &ts, nil)
	r.napping.Store(false)
	if n > 0 {
		var buf [8]byte
		_, _ = unix.Read(r.wakeFD, buf[:])
	}
	r.lockEngine()
}
