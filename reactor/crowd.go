package reactor

import "time"

// Polling callers in a crowd.
//
// A caller that polls its READ's state in a loop spends a core on checks
// that find nothing; one such caller beside the reactor thread is what
// polling costs (and it may step in for the reactor, help.go). Many of
// them, each polling its own READ, more than there are processors, keep
// every core of a small machine busy where the locked design's callers
// sleep on its mutex: across hosts on 2 cores, 64 polling callers took
// the core the producer needs for every get, and the reactor did 0.80-0.93x
// the locked design's reads/s (1.29x with the same callers blocked in
// Wait). So while more READs are in flight or queued than twice the
// process's processors (GOMAXPROCS), a check of an engine READ that its caller
// polls in a loop sleeps until some READ ends (the broadcast that wakes
// Wait) or crowdSleep passes, and then reports the state as usual.
// The reactor thread that wakes them hands its processor over right
// after (broadcast's caller in turn): Go queues a goroutine it wakes on
// the waker's processor, and a reactor thread that spins keeps it until
// Go preempts it, every 10 ms, while polling callers keep the other
// processors busy (with 8 callers across hosts, READs had a p99 of
// 12-13 ms against 8-10 ms without sleeping, before that hand-over).
//
// "Polls in a loop" is told per READ: its check came within crowdGap of
// its previous one. A caller that checks many READs in turn on one
// goroutine (a sweep) must not sleep on each: its next check of this
// READ comes only after it slept on all the others. So once a READ has
// slept, its checks sleep again only within crowdGap of the last sleep's
// end, which only a sleep moves: a READ checked later than that once
// never sleeps again. A sweep pays one sleep
// per READ, until the next READ ends; a caller that checks each READ once
// per step of its own (vLLM's scheduler) never checks within crowdGap and
// never sleeps.
const (
	crowdGap   = 200 * time.Microsecond
	crowdSleep = 200 * time.Microsecond
)

// crowdCheck is the sleep above, for the engine READ h in slot s that a
// check found in flight (and did not step in for).
func (r *Reactor) crowdCheck(h uint64, s *slot) {
	if r.inflight.Load()+int64(r.sub.Len()) <= r.crowdMin {
		return
	}
	now := r.now()
	prev := s.polled.Swap(now)
	if pe := s.parkEnd.Load(); pe > 0 {
		if now-pe > int64(crowdGap) {
			return // swept: and parkEnd stays where it is
		}
	} else if prev == 0 || now-prev > int64(crowdGap) {
		return // not polled in a loop (yet)
	}
	w := r.addWaiter(true)
	defer r.dropWaiter(w)
	// Checked after the waiter is on the list: an end published before
	// that is seen here, one published after it wakes the sleep.
	if s2, word := r.tab.lookup(h); s2 == nil || wordState(word) != stProc {
		return
	}
	if w.t == nil {
		w.t = time.NewTimer(crowdSleep)
	} else {
		w.t.Reset(crowdSleep)
	}
	r.st.crowdSleeps.Add(1)
	// Nobody steps in for the reactor while callers sleep: a reactor
	// thread napping for callers that did takes over now (as for Wait).
	r.unhelp()
	select {
	case <-w.ch:
	case <-w.t.C:
	case <-r.done:
	}
	w.t.Stop()
	// Only if the slot is still h's: released meanwhile, it may already
	// be another READ's (the table hands out the slot freed last first),
	// whose first check would then sleep though nobody polls it.
	if s2, _ := r.tab.lookup(h); s2 == s {
		s.parkEnd.Store(r.now())
	}
}
