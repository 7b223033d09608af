package reactor

import (
	"math"
	"runtime"
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
// turns it naps on its wake-up fd instead of spinning. One token
// (r.engine) says who drives the engine and owns the loop's state: the
// reactor thread holds it whenever it is not sleeping; a caller takes it
// only with a compare-and-swap and never waits for it, and does not try
// while the reactor thread waits for it.

// A caller's wish to step in counts (helpWanted) once callers have
// wished helpStreak times in a row, each within helpGap of the one
// before, and the last within helpGap: a caller polling in a loop, not
// one that checks once in a while (as vLLM's scheduler does once a step),
// whose READ would otherwise wait for the nap's end.
const (
	helpGap    = 200 * time.Microsecond
	helpStreak = 8
)

// napTurn is the longest the reactor thread stands aside without a turn
// of its own while callers step in.
const napTurn = time.Millisecond

// lockEngine takes the token for the reactor thread. A caller's step
// holds it for microseconds; should its thread lose the CPU meanwhile,
// the reactor thread yields rather than spin against it, and then gives
// up its P: a goroutine whose engine call outlasted sysmon's patience
// comes back without a P and queues for one behind every runnable
// goroutine.
func (r *Reactor) lockEngine() {
	if !r.engine.CompareAndSwap(false, true) {
		// Callers stop stepping in until the reactor thread has the
		// token: it waits for one step at most.
		r.wantEngine.Store(true)
		for i := 0; !r.engine.CompareAndSwap(false, true); i++ {
			switch {
			case i < 64:
			case i < 4096:
				schedYield()
			default:
				// The holder may be a goroutine that lost its P in a
				// long engine call and waits for one: give this
				// thread's up.
				runtime.Gosched()
			}
		}
		r.wantEngine.Store(false)
	}
}

func (r *Reactor) unlockEngine() { r.engine.Store(false) }

// help is a caller's turn at the engine: if the reactor thread is not in
// a turn and no other caller is stepping in, it takes a step of the
// loop's engine work on the calling goroutine, and reports whether it
// did. Either way it records the wish (helpWanted). Only while at most
// helpMax READs are in flight or queued: with many callers polling at
// once, a step's goroutine that lost its P in a long engine call queues
// behind all of them for another while the reactor thread waits for the
// token (measured before this bound: waits of up to 124 ms with 64
// polling callers on 2 cores), and the reactor thread serves many
// callers better anyway.
func (r *Reactor) help() bool {
	if !r.helpable || r.inflight.Load()+int64(r.sub.Len()) > r.helpMax {
		return false
	}
	now := r.now()
	if now-r.helpWant.Swap(now) < int64(helpGap) {
		if r.streak.Load() < helpStreak {
			r.streak.Add(1)
		}
	} else {
		r.streak.Store(0)
	}
	if r.closing.Load() || r.wantEngine.Load() || !r.engine.CompareAndSwap(false, true) {
		return false
	}
	if !r.stop {
		r.step()
		// The next wish is measured from here: a step can take longer
		// than helpGap (an image's gets posted and their data taken in).
		r.helpWant.Store(r.now())
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
	r.streak.Store(0)
	if r.napping.Load() {
		r.writeWake()
	}
}

// helpWanted reports whether callers poll in a loop and want to step in
// (see helpStreak).
func (r *Reactor) helpWanted() bool {
	return r.helpable && r.streak.Load() >= helpStreak && r.now()-r.helpWant.Load() < int64(helpGap)
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
// gives up the token and sleeps on the wake-up fd for up to napTurn. It
// does not wake to see whether callers still step in (on a small machine
// every such wake-up takes the core from the caller or the peer): what a
// step leaves to it (cancels, control operations, direct READs, a READ
// posted while the token was taken, a caller that stops to block in
// Wait) wakes it; anything else (timeouts, a READ whose caller stopped
// polling it) waits for the loop's next turn, at most napTurn away. The
// napping flag is raised before the last look at the rings, as park
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
	ts := unix.NsecToTimespec(int64(napTurn))
	fds := [1]unix.PollFd{{Fd: int32(r.wakeFD), Events: unix.POLLIN}}
	if n, _ := unix.Ppoll(fds[:], &ts, nil); n > 0 {
		var buf [8]byte
		_, _ = unix.Read(r.wakeFD, buf[:])
	}
	r.napping.Store(false)
	r.lockEngine()
}
