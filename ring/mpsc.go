package ring

import (
	"sync/atomic"

	"golang.org/x/sys/cpu"
)

// mpscSlot is one cell of an MPSC ring. seq == pos+1 means the producer that
// claimed position pos has finished writing val; any other value (zero, or
// the pos+1 of an earlier lap) means the slot does not yet hold position pos.
//
// The sequence lets a producer claim a position (move the shared tail) before
// it writes the value, without the consumer ever reading a claimed but
// unwritten slot: the consumer waits for seq to reach pos+1, not for tail.
// Whether a slot is free for a producer is decided from head instead (see
// TryPush), so the consumer writes no per-slot atomic: it reads a batch and
// then publishes its progress with a single store of head.
type mpscSlot[T any] struct {
	seq atomic.Uint64
	val T
}

// MPSC is a bounded lock-free queue for many producer goroutines and one
// consumer goroutine. TryPush may be called from any number of goroutines at
// once; Drain only from one goroutine at a time (the consumer). Len and Cap
// may be called from anywhere.
//
// Items pushed by one goroutine are drained in the order it pushed them.
// Items from different producers are ordered by the moment each claimed its
// position.
type MPSC[T any] struct {
	_ cpu.CacheLinePad
	// Read-only after construction; kept off the cursor lines so that cursor
	// writes do not invalidate the line every operation reads these from.
	slots []mpscSlot[T]
	mask  uint64
	_     cpu.CacheLinePad
	// tail is the next position a producer will claim. TryPush moves it
	// with a compare-and-swap, never past head+Cap; the consumer never
	// reads it except in Len.
	tail atomic.Uint64
	_    cpu.CacheLinePad
	// head is the next position the consumer will read. Only the consumer
	// writes it, once per Drain; producers read it to see how much room
	// there is. Between two Drains the line stays shared in every producer's
	// cache, so this read costs a cache miss per batch, not per item.
	head atomic.Uint64
	_    cpu.CacheLinePad
}

// NewMPSC returns an empty MPSC ring holding at least capacity items. The
// capacity is rounded up to a power of two. It panics if capacity is not
// positive or exceeds MaxCapacity.
func NewMPSC[T any](capacity int) *MPSC[T] {
	n := roundCapacity("MPSC", capacity)
	// Zeroed slots are correct: seq 0 never equals pos+1 for a position
	// pos >= 0, so every slot starts out "not yet written".
	return &MPSC[T]{
		slots: make([]mpscSlot[T], n),
		mask:  uint64(n - 1),
	}
}

// Cap returns the number of items the ring can hold.
func (q *MPSC[T]) Cap() int { return len(q.slots) }

// Len returns the number of items claimed by producers and not yet drained.
// Under concurrency it is a snapshot that may already be stale, but it is
// always between 0 and Cap.
func (q *MPSC[T]) Len() int {
	// head first: tail can only grow after it is read, and tail >= head holds
	// at every instant, so the later tail read cannot be behind this head.
	h := q.head.Load()
	t := q.tail.Load()
	return clampLen(int64(t-h), len(q.slots))
}

// TryPush appends v if there is room and reports whether it did. It never
// blocks; it returns false when the ring is full.
func (q *MPSC[T]) TryPush(v T) bool {
	capacity := int64(len(q.slots))
	pos := q.tail.Load()
	for {
		// Acquire: the consumer stores head = h only after it has read and
		// zeroed every slot below h (see Drain). Observing h therefore orders
		// the consumer's last accesses to position pos-cap's slot before our
		// write to it, for any pos < h+cap.
		//
		// tail is read before head: head only grows, so pos-h can only
		// overstate the free room if pos is stale, and then the CAS fails.
		h := q.head.Load()
		if int64(pos-h) >= capacity {
			// At the moment head was read, tail >= pos and head == h: full.
			return false
		}
		if q.tail.CompareAndSwap(pos, pos+1) {
			// pos is ours alone: no other producer can claim it, and the
			// consumer will not touch the slot until seq says pos+1.
			s := &q.slots[pos&q.mask]
			s.val = v
			// Publish: the consumer reads val only after it loads seq ==
			// pos+1, which orders our write of val before its read.
			s.seq.Store(pos + 1)
			return true
		}
		pos = q.tail.Load()
	}
}

// Drain moves up to len(dst) items into dst in FIFO order and returns how
// many it moved. It stops early at the first position whose producer has not
// finished writing it. The emptied slots are set to T's zero value so the
// ring keeps no references alive. Only the consumer goroutine may call Drain.
func (q *MPSC[T]) Drain(dst []T) int {
	if len(q.slots) == 0 {
		return 0 // a zero MPSC (not from NewMPSC): nothing was ever pushed
	}
	var zero T
	pos := q.head.Load() // only this goroutine writes head
	n := 0
	for n < len(dst) {
		p := pos + uint64(n)
		s := &q.slots[p&q.mask]
		// Acquire: seq == p+1 is stored by the producer of p after its write
		// of val (see TryPush), so once we observe it the read below is
		// ordered after that write. Any other value means p is unclaimed, or
		// claimed and not yet written: stop here, in order.
		if s.seq.Load() != p+1 {
			break
		}
		dst[n] = s.val
		s.val = zero
		n++
	}
	if n > 0 {
		// Release: our reads and zeroing of the n slots above happen before
		// any producer that observes this head value writes to them again.
		q.head.Store(pos + uint64(n))
	}
	return n
}

// clampLen turns a cursor difference into a length in [0, capacity].
func clampLen(d int64, capacity int) int {
	if d < 0 {
		return 0
	}
	if d > int64(capacity) {
		return capacity
	}
	return int(d)
}
