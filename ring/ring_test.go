package ring

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// newInt is the ring the single-goroutine tests use.
func newInt(capacity int) *MPSC[int] { return NewMPSC[int](capacity) }

func TestCapacityRounding(t *testing.T) {
	cases := []struct{ in, want int }{
		{1, 1}, {2, 2}, {3, 4}, {4, 4}, {5, 8}, {7, 8}, {8, 8}, {9, 16},
		{1000, 1024}, {1024, 1024}, {1025, 2048},
		{MaxCapacity/2 + 1, MaxCapacity},
	}
	for _, c := range cases {
		if c.in > 1<<20 {
			// Check the arithmetic without allocating a huge ring.
			if got := roundCapacity("MPSC", c.in); got != c.want {
				t.Errorf("roundCapacity(%d) = %d, want %d", c.in, got, c.want)
			}
			continue
		}
		q := newInt(c.in)
		if got := q.Cap(); got != c.want {
			t.Errorf("NewMPSC(%d).Cap() = %d, want %d", c.in, got, c.want)
		}
		if got := q.Len(); got != 0 {
			t.Errorf("NewMPSC(%d).Len() = %d, want 0", c.in, got)
		}
	}
}

func TestCapacityPanics(t *testing.T) {
	cases := []struct {
		in   int
		want string
	}{
		{0, "must be positive, got 0"},
		{-5, "must be positive, got -5"},
		{MaxCapacity + 1, "exceeds the maximum"},
		{int(^uint(0) >> 1), "exceeds the maximum"},
	}
	for _, c := range cases {
		msg := func() (msg string) {
			defer func() {
				if r := recover(); r != nil {
					msg = fmt.Sprint(r)
				}
			}()
			newInt(c.in)
			return ""
		}()
		if msg == "" {
			t.Errorf("NewMPSC(%d) did not panic", c.in)
			continue
		}
		if !strings.HasPrefix(msg, "ring: NewMPSC") || !strings.Contains(msg, c.want) {
			t.Errorf("NewMPSC(%d) panic %q, want it to name NewMPSC and contain %q", c.in, msg, c.want)
		}
	}
}

func TestFullRing(t *testing.T) {
	for _, capacity := range []int{1, 8} {
		t.Run(fmt.Sprint(capacity), func(t *testing.T) {
			q := newInt(capacity)
			for i := 0; i < q.Cap(); i++ {
				if !q.TryPush(i) {
					t.Fatalf("TryPush #%d reported full, Cap = %d", i, q.Cap())
				}
				if got := q.Len(); got != i+1 {
					t.Fatalf("Len after %d pushes = %d", i+1, got)
				}
			}
			if q.TryPush(100) {
				t.Fatal("TryPush succeeded on a full ring")
			}
			if got := q.Len(); got != q.Cap() {
				t.Fatalf("Len of full ring = %d, want %d", got, q.Cap())
			}
			one := make([]int, 1)
			if n := q.Drain(one); n != 1 || one[0] != 0 {
				t.Fatalf("Drain(1) = %d, %v; want 1, [0]", n, one)
			}
			if !q.TryPush(capacity) {
				t.Fatal("TryPush failed after one slot was drained")
			}
			if q.TryPush(capacity + 1) {
				t.Fatal("TryPush succeeded on a ring full again")
			}
			dst := make([]int, 16)
			n := q.Drain(dst)
			var want []int
			for i := 1; i <= capacity; i++ {
				want = append(want, i)
			}
			if !slices.Equal(dst[:n], want) {
				t.Fatalf("drained %v, want %v", dst[:n], want)
			}
		})
	}
}

func TestDrainEdges(t *testing.T) {
	q := newInt(16)
	dst := []int{-1, -1, -1, -1, -1, -1, -1, -1, -1, -1}
	if n := q.Drain(dst); n != 0 {
		t.Fatalf("Drain of an empty ring = %d", n)
	}
	for _, v := range dst {
		if v != -1 {
			t.Fatalf("Drain of an empty ring wrote into dst: %v", dst)
		}
	}
	for _, v := range []int{10, 11, 12} {
		if !q.TryPush(v) {
			t.Fatal("TryPush failed on a ring with room")
		}
	}
	if n := q.Drain(nil); n != 0 || q.Len() != 3 {
		t.Fatalf("Drain(nil) = %d, Len = %d; want 0, 3", n, q.Len())
	}
	n := q.Drain(dst)
	want := []int{10, 11, 12, -1, -1, -1, -1, -1, -1, -1}
	if n != 3 || !slices.Equal(dst, want) {
		t.Fatalf("Drain into a larger dst = %d %v; want 3 %v", n, dst, want)
	}
	if n := q.Drain(dst); n != 0 || q.Len() != 0 {
		t.Fatalf("second Drain = %d, Len = %d", n, q.Len())
	}
}

// TestZeroMPSC: an MPSC not made by NewMPSC takes nothing and drains
// nothing; its Drain used to panic.
func TestZeroMPSC(t *testing.T) {
	var q MPSC[int]
	if q.TryPush(1) {
		t.Fatal("TryPush into a zero MPSC succeeded")
	}
	dst := []int{-1, -1}
	if n := q.Drain(dst); n != 0 || dst[0] != -1 {
		t.Fatalf("Drain of a zero MPSC = %d %v", n, dst)
	}
	if q.Len() != 0 || q.Cap() != 0 {
		t.Fatalf("zero MPSC: Len %d Cap %d", q.Len(), q.Cap())
	}
}

// TestWrapAroundSequential runs small rings (down to one slot) through
// thousands of laps with uneven push and drain sizes and checks every value
// comes out in order.
func TestWrapAroundSequential(t *testing.T) {
	for _, capacity := range []int{1, 2, 4} {
		t.Run(fmt.Sprint(capacity), func(t *testing.T) {
			q := newInt(capacity)
			next, expect := 0, 0
			dst := make([]int, 3)
			for round := 0; round < 20000; round++ {
				for i := 0; i < 1+round%4 && q.TryPush(next); i++ {
					next++
				}
				if l := q.Len(); l != next-expect {
					t.Fatalf("round %d: Len = %d, want %d", round, l, next-expect)
				}
				n := q.Drain(dst[:1+round%3])
				for _, v := range dst[:n] {
					if v != expect {
						t.Fatalf("round %d: got %d, want %d", round, v, expect)
					}
					expect++
				}
			}
			if next < 5*capacity || expect == 0 {
				t.Fatalf("too few laps: pushed %d drained %d", next, expect)
			}
		})
	}
}

func TestDrainZeroesSlots(t *testing.T) {
	vals := make([]*int, 8)
	for i := range vals {
		vals[i] = new(int)
		*vals[i] = i
	}
	dst := make([]*int, 3)
	m := NewMPSC[*int](4)
	push := func(vs ...*int) {
		for _, v := range vs {
			if !m.TryPush(v) {
				t.Fatal("TryPush failed on a ring with room")
			}
		}
	}
	// Advance the ring so the live region wraps: positions 2..5.
	push(vals[:2]...)
	m.Drain(dst[:2])
	push(vals[2:6]...)
	// Drain three of four: slots of positions 2, 3, 4 (indices 2, 3, 0).
	if n := m.Drain(dst); n != 3 || *dst[0] != 2 || *dst[2] != 4 {
		t.Fatalf("Drain = %d", n)
	}
	// Index 1 still holds position 5; every other slot must be nil.
	for i := 0; i < 4; i++ {
		wantLive := i == 1
		if got := m.slots[i].val; (got != nil) != wantLive || (wantLive && got != vals[5]) {
			t.Errorf("slot %d = %v, want live=%v", i, got, wantLive)
		}
	}
	m.Drain(dst)
	for i := 0; i < 4; i++ {
		if m.slots[i].val != nil {
			t.Errorf("slot %d still holds a pointer after a full drain", i)
		}
	}
}

// TestMPSCDrainStopsAtUnwrittenSlot plays a producer that has claimed a
// position but not yet written it, with a later producer already done: the
// consumer must stop at the gap rather than skip or read the empty slot.
func TestMPSCDrainStopsAtUnwrittenSlot(t *testing.T) {
	q := NewMPSC[int](8)
	q.TryPush(1)
	pos := q.tail.Load()
	if !q.tail.CompareAndSwap(pos, pos+1) { // the slow producer's claim
		t.Fatal("claim failed")
	}
	q.TryPush(3) // a fast producer behind it
	dst := make([]int, 8)
	if n := q.Drain(dst); n != 1 || dst[0] != 1 {
		t.Fatalf("Drain = %d %v; want only the item before the gap", n, dst[:n])
	}
	if n := q.Drain(dst); n != 0 {
		t.Fatalf("Drain past an unwritten slot returned %d", n)
	}
	if q.Len() != 2 {
		t.Fatalf("Len = %d, want 2 (claimed + written)", q.Len())
	}
	s := &q.slots[pos&q.mask]
	s.val = 2
	s.seq.Store(pos + 1)
	if n := q.Drain(dst); n != 2 || dst[0] != 2 || dst[1] != 3 {
		t.Fatalf("Drain after publish = %d %v; want [2 3]", n, dst[:n])
	}
}

// item identifies a value by producer and the producer's sequence number.
type item struct {
	producer, seq int
}

// produce pushes items seq 0..count-1 for producer p, yielding the
// processor while the ring is full.
func produce(q *MPSC[item], p, count int) {
	for seq := 0; seq < count; seq++ {
		for !q.TryPush(item{p, seq}) {
			yieldNow()
		}
	}
}

// checker verifies, as items arrive, that each producer's items come in
// sequence order, so none is lost, duplicated or reordered.
type checker struct {
	t    *testing.T
	next []int
}

func newChecker(t *testing.T, producers int) *checker {
	return &checker{t: t, next: make([]int, producers)}
}

func (c *checker) add(it item) bool {
	if it.producer < 0 || it.producer >= len(c.next) {
		c.t.Errorf("item from unknown producer %d", it.producer)
		return false
	}
	if want := c.next[it.producer]; it.seq != want {
		c.t.Errorf("producer %d: got seq %d, want %d", it.producer, it.seq, want)
		return false
	}
	c.next[it.producer]++
	return true
}

func (c *checker) finish(perProducer int) {
	for p, n := range c.next {
		if n != perProducer {
			c.t.Errorf("producer %d: received %d items, want %d", p, n, perProducer)
		}
	}
}

func TestMPSCConcurrent(t *testing.T) {
	const perProducer = 100_000
	cases := []struct {
		producers, capacity, perProducer, drainBatch int
	}{
		{8, 1024, perProducer, 64},
		{8, 4, perProducer / 4, 3},
		{3, 2, perProducer / 10, 1},
		{2, 1, perProducer / 10, 1},
		{64, 256, perProducer / 32, 128},
	}
	for _, c := range cases {
		name := fmt.Sprintf("p=%d/cap=%d", c.producers, c.capacity)
		t.Run(name, func(t *testing.T) {
			q := NewMPSC[item](c.capacity)
			var wg sync.WaitGroup
			var lenErr atomic.Value
			stop := make(chan struct{})
			for p := 0; p < c.producers; p++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					produce(q, p, c.perProducer)
				}()
			}
			// A bystander samples Len while everything runs.
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					if l := q.Len(); l < 0 || l > q.Cap() {
						lenErr.Store(fmt.Sprintf("Len = %d outside [0, %d]", l, q.Cap()))
					}
					yieldNow()
				}
			}()
			all := make(chan struct{})
			go func() { wg.Wait(); close(all) }()
			defer close(stop)
			consume(t, c.producers, c.perProducer, c.drainBatch, q.Drain)
			stop <- struct{}{} // the sampler has seen the last Len
			waitClosed(t, all, "producers")
			if e := lenErr.Load(); e != nil {
				t.Error(e)
			}
			if q.Len() != 0 {
				t.Errorf("Len after all items drained = %d", q.Len())
			}
		})
	}
}

// consume drains until every producer's items have arrived (or a check
// fails, or a generous deadline passes) and verifies them.
func consume(t *testing.T, producers, perProducer, batch int, drain func([]item) int) {
	t.Helper()
	c := newChecker(t, producers)
	dst := make([]item, batch)
	want := producers * perProducer
	deadline := time.Now().Add(20 * time.Second)
	got := 0
	for got < want {
		n := drain(dst)
		if n > len(dst) {
			t.Fatalf("Drain returned %d > len(dst) %d", n, len(dst))
		}
		for _, it := range dst[:n] {
			if !c.add(it) {
				t.FailNow()
			}
		}
		got += n
		if n == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("timed out with %d of %d items", got, want)
			}
			yieldNow()
		}
	}
	if n := drain(dst); n != 0 {
		t.Fatalf("Drain after the last item returned %d more", n)
	}
	c.finish(perProducer)
}

func TestNoAllocsPerItem(t *testing.T) {
	v := new(int)
	dst := make([]*int, 4)
	m := NewMPSC[*int](8)
	round := func() { m.TryPush(v); m.TryPush(v); m.TryPush(v); m.Drain(dst); m.Drain(dst) }
	if a := testing.AllocsPerRun(1000, round); a != 0 {
		t.Errorf("%v allocations per push/drain round, want 0", a)
	}
	if m.Len() != 0 {
		t.Errorf("ring not empty after balanced rounds: %d", m.Len())
	}
}

// waitClosed fails the test instead of hanging if ch is not closed soon.
func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(20 * time.Second):
		t.Fatalf("%s still blocked after 20s", what)
	}
}
