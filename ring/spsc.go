package ring

import (
	"sync/atomic"

	"golang.org/x/sys/cpu"
)

// SPSC is a bounded lock-free queue for exactly one producer goroutine and
// one consumer goroutine. TryPush, Push and TryPushBatch must only be called
// by the producer (one goroutine at a time), Drain only by the consumer. Len
// and Cap may be called from anywhere.
//
// With a single writer per cursor no CAS is needed: the producer publishes
// items by storing tail, the consumer frees slots by storing head. Each side
// keeps a private copy of the other side's cursor and rereads the shared one
// only when the copy says the ring is full (producer) or empty (consumer), so
// in steady state each side touches the other's cache line once per lap or
// per batch rather than once per item.
type SPSC[T any] struct {
	_ cpu.CacheLinePad
	// Read-only after construction.
	buf  []T
	mask uint64
	_    cpu.CacheLinePad
	// Producer line: tail is written only by the producer; headCache is the
	// producer's private, possibly stale copy of head.
	tail      atomic.Uint64
	headCache uint64
	_         cpu.CacheLinePad
	// Consumer line: head is written only by the consumer; tailCache is the
	// consumer's private, possibly stale copy of tail.
	head      atomic.Uint64
	tailCache uint64
	_         cpu.CacheLinePad
}

// NewSPSC returns an empty SPSC ring holding at least capacity items. The
// capacity is rounded up to a power of two, minimum 2. It panics if capacity
// is not positive or exceeds MaxCapacity.
func NewSPSC[T any](capacity int) *SPSC[T] {
	n := roundCapacity("SPSC", capacity)
	return &SPSC[T]{buf: make([]T, n), mask: uint64(n - 1)}
}

// Cap returns the number of items the ring can hold.
func (q *SPSC[T]) Cap() int { return len(q.buf) }

// Len returns the number of items pushed and not yet drained. Under
// concurrency it is a snapshot, always between 0 and Cap.
func (q *SPSC[T]) Len() int {
	// head before tail, as in MPSC.Len: tail >= head at every instant.
	h := q.head.Load()
	t := q.tail.Load()
	return clampLen(int64(t-h), len(q.buf))
}

// room returns how many items the producer may write starting at position t,
// rereading head only if the cached copy does not show want free slots.
func (q *SPSC[T]) room(t uint64, want int) int {
	capacity := int64(len(q.buf))
	free := capacity - int64(t-q.headCache)
	if free < int64(want) {
		// Acquire: the consumer stores head = h after reading and zeroing
		// every slot below h (see Drain). Observing h orders those accesses
		// before the writes we are about to make to the same slots.
		q.headCache = q.head.Load()
		free = capacity - int64(t-q.headCache)
	}
	return int(max(free, 0))
}

// TryPush appends v if there is room and reports whether it did. It never
// blocks.
func (q *SPSC[T]) TryPush(v T) bool {
	t := q.tail.Load() // only this goroutine writes tail
	if q.room(t, 1) == 0 {
		return false
	}
	q.buf[t&q.mask] = v
	// Publish: the consumer reads slots below the tail it loads, so this
	// store orders the write of v before the consumer's read of it.
	q.tail.Store(t + 1)
	return true
}

// Push appends v, waiting while the ring is full, with the same backoff as
// MPSC.Push: tight retries, then runtime.Gosched, then short doubling sleeps
// (1µs up to 100µs).
func (q *SPSC[T]) Push(v T) {
	var b backoff
	for !q.TryPush(v) {
		b.wait()
	}
}

// TryPushBatch appends the longest prefix of vs that fits, publishing it with
// one store, and returns how many items it pushed.
func (q *SPSC[T]) TryPushBatch(vs []T) int {
	if len(vs) == 0 {
		return 0
	}
	t := q.tail.Load()
	n := min(q.room(t, len(vs)), len(vs))
	if n == 0 {
		return 0
	}
	// At most two contiguous pieces: up to the end of buf, then from 0.
	start := int(t & q.mask)
	k := copy(q.buf[start:], vs[:n])
	copy(q.buf, vs[k:n])
	// Publish all n slots at once (see TryPush).
	q.tail.Store(t + uint64(n))
	return n
}

// Drain moves up to len(dst) items into dst in FIFO order and returns how
// many it moved. The emptied slots are set to T's zero value so the ring
// keeps no references alive. Only the consumer goroutine may call Drain.
func (q *SPSC[T]) Drain(dst []T) int {
	if len(dst) == 0 {
		return 0
	}
	h := q.head.Load() // only this goroutine writes head
	avail := int64(q.tailCache - h)
	if avail < int64(len(dst)) {
		// Acquire: the producer stores tail = t after writing every slot
		// below t, so observing t orders those writes before our reads.
		q.tailCache = q.tail.Load()
		avail = int64(q.tailCache - h)
	}
	n := int(min(max(avail, 0), int64(len(dst))))
	if n == 0 {
		return 0
	}
	// At most two contiguous pieces: up to the end of buf, then from 0.
	start := int(h & q.mask)
	first := q.buf[start:min(start+n, len(q.buf))]
	k := copy(dst, first)
	clear(first)
	if k < n {
		k2 := copy(dst[k:n], q.buf)
		clear(q.buf[:k2])
	}
	// Release: the reads and zeroing above happen before any producer write
	// to these slots, because the producer only writes slots below the head
	// it has loaded plus the capacity.
	q.head.Store(h + uint64(n))
	return n
}
