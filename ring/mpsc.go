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
// consumer goroutine. TryPush, Push and TryPushBatch may be called from any
// number of goroutines at once; Drain only from one goroutine at a time (the
// consumer). Len and Cap may be called from anywhere.
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
	// tail is the next position a producer will claim. Push moves it with
	// an atomic add, TryPush and TryPushBatch with CAS; the consumer never
	// reads it except in Len. It can run ahead of head+Cap by the number of
	// Pushes waiting on a full ring.
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
// capacity is rounded up to a power of two, minimum 2. It panics if capacity
// is not positive or exceeds MaxCapacity.
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
// always between 0 and Cap: Pushes waiting on a full ring hold positions
// beyond Cap, and Len does not count them.
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

// Push appends v, waiting while the ring is full. It never gives up, so the
// consumer must keep draining.
//
// Unlike TryPush, Push takes its position with one atomic add, which cannot
// fail, instead of a compare-and-swap that producers racing for the same
// position must retry: under contention every Push costs one transfer of
// the tail's cache line, not one per attempt. Since an add cannot be taken
// back, a Push that finds the ring full keeps its position and waits for
// that position's slot to be freed, first retrying in a tight loop, then
// yielding the processor with runtime.Gosched, then sleeping for short
// doubling intervals (1µs up to 100µs). Two consequences:
//
//   - Pushes blocked on a full ring are served in the order of their
//     claims, and TryPush and TryPushBatch report full while any of them
//     waits, so a waiting Push is neither overtaken nor starved.
//   - While a blocked Push waits, the consumer can drain every item before
//     its position but none after it. Once the consumer frees its slot, the
//     item appears about one backoff interval later at most (a sleep of up
//     to 100µs; usually far less, as a Push spins and yields first).
func (q *MPSC[T]) Push(v T) {
	capacity := uint64(len(q.slots))
	pos := q.tail.Add(1) - 1
	// Acquire, as in TryPush: observing head = h with pos-h < capacity means
	// the consumer has read and zeroed the slot's previous occupant
	// (position pos-capacity) before storing h, so our write below is
	// ordered after its last access. The difference cannot underflow: head
	// never passes a position whose item is not yet written, so h <= pos.
	if pos-q.head.Load() >= capacity {
		var b backoff
		for pos-q.head.Load() >= capacity {
			b.wait()
		}
	}
	// pos is ours alone, and the consumer does not touch the slot until seq
	// says pos+1.
	s := &q.slots[pos&q.mask]
	s.val = v
	// Publish, as in TryPush.
	s.seq.Store(pos + 1)
}

// TryPushBatch appends a prefix of vs, as long as fits, with a single claim
// of the shared cursor, and returns how many items it pushed. The pushed
// items are contiguous in the ring and in their original order, with no item
// of another producer between them.
func (q *MPSC[T]) TryPushBatch(vs []T) int {
	if len(vs) == 0 {
		return 0
	}
	capacity := int64(len(q.slots))
	for {
		pos := q.tail.Load()
		// Acquire, as in TryPush: seeing head = h means positions up to
		// h+cap-1 are free and the consumer is done with their slots.
		h := q.head.Load()
		free := capacity - int64(pos-h)
		// free > capacity happens when pos is stale (the consumer has passed
		// it); the CAS below then fails, but keep n in range regardless.
		free = min(free, capacity)
		if free <= 0 {
			return 0
		}
		n := int(min(free, int64(len(vs))))
		if !q.tail.CompareAndSwap(pos, pos+uint64(n)) {
			continue
		}
		for i := 0; i < n; i++ {
			p := pos + uint64(i)
			s := &q.slots[p&q.mask]
			s.val = vs[i]
			// Publish each slot on its own, in order: the consumer stops at
			// the first slot whose seq is not yet p+1, so it can start on the
			// front of the batch while the rest is being written.
			s.seq.Store(p + 1)
		}
		return n
	}
}

// Drain moves up to len(dst) items into dst in FIFO order and returns how
// many it moved. It stops early at the first position whose producer has not
// finished writing it. The emptied slots are set to T's zero value so the
// ring keeps no references alive. Only the consumer goroutine may call Drain.
func (q *MPSC[T]) Drain(dst []T) int {
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
