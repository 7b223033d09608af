package reactor

import (
	"math/bits"
	"sync/atomic"
	"time"
)

// Latency buckets: values in nanoseconds, grouped by power of two with 8
// linear sub-buckets each (about 12% resolution), up to 2^40 ns (18 min).
const (
	histSub     = 3
	histBuckets = (41 - histSub) << histSub
)

// Histogram counts latencies without locks. Add is called by the reactor
// and by callers that copy a small direct READ inside Post; atomics only,
// so any goroutine may add or read a snapshot.
type Histogram struct {
	counts [histBuckets]atomic.Uint64
	sum    atomic.Uint64 // of the values counted, in ns
}

func histIndex(ns int64) int {
	if ns < 1<<histSub {
		if ns < 0 {
			ns = 0
		}
		return int(ns)
	}
	u := uint64(ns)
	e := bits.Len64(u) - 1 - histSub // exponent above the sub-bucket bits
	i := (e+1)<<histSub | int((u>>uint(e))&(1<<histSub-1))
	if i >= histBuckets {
		return histBuckets - 1
	}
	return i
}

// histLower is the smallest value that falls into bucket i.
func histLower(i int) int64 {
	if i < 1<<histSub {
		return int64(i)
	}
	e := i>>histSub - 1
	return int64(1<<histSub|(i&(1<<histSub-1))) << uint(e)
}

// Add counts one latency.
func (h *Histogram) Add(d time.Duration) {
	h.counts[histIndex(int64(d))].Add(1)
	if d > 0 {
		h.sum.Add(uint64(d))
	}
}

// HistSnapshot is a copy of a Histogram's counts.
type HistSnapshot struct {
	counts [histBuckets]uint64
	total  uint64
	sum    uint64
}

// Snapshot copies the counts.
func (h *Histogram) Snapshot() HistSnapshot {
	var s HistSnapshot
	for i := range h.counts {
		c := h.counts[i].Load()
		s.counts[i] = c
		s.total += c
	}
	s.sum = h.sum.Load()
	return s
}

// Sum is the sum of the latencies counted. It is read after the counts,
// so it may include a few values the counts do not, and Add counts a
// value before it adds it to the sum, so it may miss a few they do; both
// only grow.
func (s HistSnapshot) Sum() time.Duration { return time.Duration(s.sum) }

// CountBelow is the number of latencies in buckets that lie wholly below
// d. For d a power of two nanoseconds (or any bucket's lower bound) that is
// exactly the number of latencies < d.
func (s HistSnapshot) CountBelow(d time.Duration) uint64 {
	var n uint64
	for i := 0; i < histBuckets-1 && histLower(i+1) <= int64(d); i++ {
		n += s.counts[i]
	}
	return n
}

// Count is the number of latencies counted.
func (s HistSnapshot) Count() uint64 { return s.total }

// Quantile returns the lower bound of the bucket holding quantile q
// (0 < q <= 1), or 0 when nothing was counted. A q above 1 is the
// largest latency counted; one at or below 0, or NaN, the smallest.
func (s HistSnapshot) Quantile(q float64) time.Duration {
	if s.total == 0 {
		return 0
	}
	var rank uint64
	switch {
	case !(q > 0): // NaN too
		rank = 1
	case q >= 1:
		rank = s.total
	default:
		rank = max(uint64(q*float64(s.total)+0.5), 1)
	}
	var seen uint64
	for i, c := range s.counts {
		seen += c
		if seen >= rank {
			return time.Duration(histLower(i))
		}
	}
	return time.Duration(histLower(histBuckets - 1))
}
