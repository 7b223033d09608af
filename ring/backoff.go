package ring

import (
	"runtime"
	"time"
)

// Backoff schedule used by Push when the ring is full. The consumer is a
// single goroutine that may itself be waiting for a CPU, so a producer first
// retries a few times (cheap when the consumer is draining on another core),
// then yields its P so a runnable consumer can be scheduled on this one, and
// only then sleeps, with a doubling delay capped at maxSleep so that a slow
// consumer is not hammered while a fast one is not waited on for long.
const (
	spinTries  = 64
	yieldTries = 64
	minSleep   = time.Microsecond
	maxSleep   = 100 * time.Microsecond
)

// backoff tracks one blocked Push. Its zero value starts at the spin phase.
type backoff struct {
	n     int
	sleep time.Duration
}

// wait is called after each failed attempt and pauses for the current phase.
func (b *backoff) wait() {
	switch {
	case b.n < spinTries:
		// Busy retry: the caller loops straight back to its TryPush.
	case b.n < spinTries+yieldTries:
		runtime.Gosched()
	default:
		if b.sleep == 0 {
			b.sleep = minSleep
		}
		time.Sleep(b.sleep)
		if b.sleep < maxSleep {
			b.sleep *= 2
			if b.sleep > maxSleep {
				b.sleep = maxSleep
			}
		}
	}
	b.n++
}
