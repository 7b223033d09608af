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

// queue is the API MPSC and SPSC share; the tests below run against both.
type queue[T any] interface {
	TryPush(v T) bool
	Push(v T)
	TryPushBatch(vs []T) int
	Drain(dst []T) int
	Len() int
	Cap() int
}

var (
	_ queue[int] = (*MPSC[int])(nil)
	_ queue[int] = (*SPSC[int])(nil)
)

type kind struct {
	name string
	new  func(capacity int) queue[int]
}

var kinds = []kind{
	{"MPSC", func(c int) queue[int] { return NewMPSC[int](c) }},
	{"SPSC", func(c int) queue[int] { return NewSPSC[int](c) }},
}

func TestCapacityRounding(t *testing.T) {
	cases := []struct{ in, want int }{
		{1, 2}, {2, 2}, {3, 4}, {4, 4}, {5, 8}, {7, 8}, {8, 8}, {9, 16},
		{1000, 1024}, {1024, 1024}, {1025, 2048},
		{MaxCapacity/2 + 1, MaxCapacity},
	}
	for _, k := range kinds {
		for _, c := range cases {
			if c.in > 1<<20 {
				// Check the arithmetic without allocating a huge ring.
				if got := roundCapacity(k.name, c.in); got != c.want {
					t.Errorf("roundCapacity(%d) = %d, want %d", c.in, got, c.want)
				}
				continue
			}
			q := k.new(c.in)
			if got := q.Cap(); got != c.want {
				t.Errorf("%s: New(%d).Cap() = %d, want %d", k.name, c.in, got, c.want)
			}
			if got := q.Len(); got != 0 {
				t.Errorf("%s: New(%d).Len() = %d, want 0", k.name, c.in, got)
			}
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
	for _, k := range kinds {
		for _, c := range cases {
			msg := func() (msg string) {
				defer func() {
					if r := recover(); r != nil {
						msg = fmt.Sprint(r)
					}
				}()
				k.new(c.in)
				return ""
			}()
			if msg == "" {
				t.Errorf("%s: New(%d) did not panic", k.name, c.in)
				continue
			}
			if !strings.HasPrefix(msg, "ring: New"+k.name) || !strings.Contains(msg, c.want) {
				t.Errorf("%s: New(%d) panic %q, want it to name New%s and contain %q", k.name, c.in, msg, k.name, c.want)
			}
		}
	}
}

func TestFullRing(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			q := k.new(8)
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
			if n := q.TryPushBatch([]int{100, 101}); n != 0 {
				t.Fatalf("TryPushBatch on a full ring pushed %d", n)
			}
			if got := q.Len(); got != q.Cap() {
				t.Fatalf("Len of full ring = %d, want %d", got, q.Cap())
			}
			one := make([]int, 1)
			if n := q.Drain(one); n != 1 || one[0] != 0 {
				t.Fatalf("Drain(1) = %d, %v; want 1, [0]", n, one)
			}
			if !q.TryPush(8) {
				t.Fatal("TryPush failed after one slot was drained")
			}
			if q.TryPush(9) {
				t.Fatal("TryPush succeeded on a ring full again")
			}
			dst := make([]int, 16)
			n := q.Drain(dst)
			want := []int{1, 2, 3, 4, 5, 6, 7, 8}
			if !slices.Equal(dst[:n], want) {
				t.Fatalf("drained %v, want %v", dst[:n], want)
			}
		})
	}
}

func TestPushWaitsForConsumer(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			q := k.new(4)
			for i := 0; i < 4; i++ {
				q.Push(i)
			}
			done := make(chan struct{})
			go func() {
				q.Push(4)
				q.Push(5)
				close(done)
			}()
			select {
			case <-done:
				t.Fatal("Push returned while the ring was full")
			case <-time.After(20 * time.Millisecond):
			}
			var got []int
			buf := make([]int, 1)
			deadline := time.Now().Add(10 * time.Second)
			for len(got) < 6 && time.Now().Before(deadline) {
				// Drain one at a time so the ring stays near full and the
				// pusher has to wait again for the second item.
				if q.Drain(buf) == 1 {
					got = append(got, buf[0])
				} else {
					time.Sleep(100 * time.Microsecond)
				}
			}
			waitClosed(t, done, "Push")
			if want := []int{0, 1, 2, 3, 4, 5}; !slices.Equal(got, want) {
				t.Fatalf("drained %v, want %v", got, want)
			}
			if q.Len() != 0 {
				t.Fatalf("Len after draining everything = %d", q.Len())
			}
		})
	}
}

func TestTryPushBatchPartial(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			q := k.new(8)
			if n := q.TryPushBatch(nil); n != 0 {
				t.Fatalf("TryPushBatch(nil) = %d", n)
			}
			for i := 0; i < 3; i++ {
				q.Push(i)
			}
			if n := q.TryPushBatch([]int{3, 4, 5, 6, 7, 8, 9, 10, 11, 12}); n != 5 {
				t.Fatalf("TryPushBatch of 10 into 5 free slots pushed %d", n)
			}
			if n := q.TryPushBatch([]int{99}); n != 0 {
				t.Fatalf("TryPushBatch into a full ring pushed %d", n)
			}
			dst := make([]int, 4)
			if n := q.Drain(dst); n != 4 || !slices.Equal(dst, []int{0, 1, 2, 3}) {
				t.Fatalf("Drain = %d %v", n, dst)
			}
			// This batch wraps around the end of the slot array.
			if n := q.TryPushBatch([]int{8, 9, 10, 11, 12, 13}); n != 4 {
				t.Fatalf("TryPushBatch of 6 into 4 free slots pushed %d", n)
			}
			if q.Len() != 8 {
				t.Fatalf("Len = %d, want 8", q.Len())
			}
			all := make([]int, 20)
			n := q.Drain(all)
			if want := []int{4, 5, 6, 7, 8, 9, 10, 11}; !slices.Equal(all[:n], want) {
				t.Fatalf("drained %v, want %v", all[:n], want)
			}
			if n := q.TryPushBatch([]int{1, 2}); n != 2 {
				t.Fatalf("TryPushBatch into an empty ring pushed %d of 2", n)
			}
		})
	}
}

func TestDrainEdges(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			q := k.new(16)
			dst := []int{-1, -1, -1, -1, -1, -1, -1, -1, -1, -1}
			if n := q.Drain(dst); n != 0 {
				t.Fatalf("Drain of an empty ring = %d", n)
			}
			for _, v := range dst {
				if v != -1 {
					t.Fatalf("Drain of an empty ring wrote into dst: %v", dst)
				}
			}
			q.Push(10)
			q.Push(11)
			q.Push(12)
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
		})
	}
}

// TestWrapAroundSequential runs a capacity-4 ring through thousands of laps
// with uneven push and drain sizes and checks every value comes out in order.
func TestWrapAroundSequential(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			q := k.new(4)
			next, expect := 0, 0
			dst := make([]int, 3)
			batch := make([]int, 0, 4)
			for round := 0; round < 20000; round++ {
				switch round % 3 {
				case 0:
					for q.TryPush(next) {
						next++
					}
				case 1:
					batch = batch[:0]
					for i := 0; i < 1+round%4; i++ {
						batch = append(batch, next+i)
					}
					next += q.TryPushBatch(batch)
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
			if next < 5*4 || expect == 0 {
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
	s := NewSPSC[*int](4)
	// Advance both rings so the live region wraps: positions 2..5.
	for i := 0; i < 2; i++ {
		m.Push(vals[i])
		s.Push(vals[i])
	}
	m.Drain(dst[:2])
	s.Drain(dst[:2])
	m.TryPushBatch(vals[2:6])
	s.TryPushBatch(vals[2:6])
	// Drain three of four: slots of positions 2, 3, 4 (indices 2, 3, 0).
	if n := m.Drain(dst); n != 3 || *dst[0] != 2 || *dst[2] != 4 {
		t.Fatalf("MPSC Drain = %d", n)
	}
	if n := s.Drain(dst); n != 3 || *dst[0] != 2 || *dst[2] != 4 {
		t.Fatalf("SPSC Drain = %d", n)
	}
	// Index 1 still holds position 5; every other slot must be nil.
	for i := 0; i < 4; i++ {
		wantLive := i == 1
		if got := m.slots[i].val; (got != nil) != wantLive || (wantLive && got != vals[5]) {
			t.Errorf("MPSC slot %d = %v, want live=%v", i, got, wantLive)
		}
		if got := s.buf[i]; (got != nil) != wantLive || (wantLive && got != vals[5]) {
			t.Errorf("SPSC slot %d = %v, want live=%v", i, got, wantLive)
		}
	}
	m.Drain(dst)
	s.Drain(dst)
	for i := 0; i < 4; i++ {
		if m.slots[i].val != nil || s.buf[i] != nil {
			t.Errorf("slot %d still holds a pointer after a full drain", i)
		}
	}
}

// TestMPSCDrainStopsAtUnwrittenSlot plays a producer that has claimed a
// position but not yet written it, with a later producer already done: the
// consumer must stop at the gap rather than skip or read the empty slot.
func TestMPSCDrainStopsAtUnwrittenSlot(t *testing.T) {
	q := NewMPSC[int](8)
	q.Push(1)
	pos := q.tail.Load()
	if !q.tail.CompareAndSwap(pos, pos+1) { // the slow producer's claim
		t.Fatal("claim failed")
	}
	q.Push(3) // a fast producer behind it
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

// A Push that finds the ring full keeps the position it claimed: blocked
// Pushes complete in call order, nothing claimed later (TryPush,
// TryPushBatch) overtakes them, and Len never exceeds Cap meanwhile.
func TestMPSCPushKeepsItsPlace(t *testing.T) {
	q := NewMPSC[int](4)
	for i := 0; i < 4; i++ {
		q.Push(i)
	}
	waitTail := func(want uint64) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for q.tail.Load() != want {
			if time.Now().After(deadline) {
				t.Fatalf("tail = %d, want %d: a Push did not claim its place", q.tail.Load(), want)
			}
			time.Sleep(time.Millisecond)
		}
	}
	first, second := make(chan struct{}), make(chan struct{})
	go func() { q.Push(10); close(first) }()
	waitTail(5)
	go func() { q.Push(11); close(second) }()
	waitTail(6)
	if l := q.Len(); l != q.Cap() {
		t.Fatalf("Len with two Pushes waiting = %d, want Cap = %d", l, q.Cap())
	}
	one := make([]int, 1)
	if n := q.Drain(one); n != 1 || one[0] != 0 {
		t.Fatalf("Drain(1) = %d %v; want [0]", n, one)
	}
	// The first waiter's slot is free, but the ring is still full for
	// anyone who arrives now: the second waiter is ahead of them.
	if q.TryPush(99) {
		t.Fatal("TryPush overtook a waiting Push")
	}
	if n := q.TryPushBatch([]int{99, 98}); n != 0 {
		t.Fatalf("TryPushBatch overtook a waiting Push: pushed %d", n)
	}
	waitClosed(t, first, "first waiting Push")
	select {
	case <-second:
		t.Fatal("second Push returned before its slot was freed")
	default:
	}
	var got []int
	dst := make([]int, 8)
	deadline := time.Now().Add(20 * time.Second)
	for len(got) < 5 && time.Now().Before(deadline) {
		n := q.Drain(dst)
		got = append(got, dst[:n]...)
		if n == 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	waitClosed(t, second, "second waiting Push")
	if want := []int{1, 2, 3, 10, 11}; !slices.Equal(got, want) {
		t.Fatalf("drained %v, want %v", got, want)
	}
	if !q.TryPush(12) || q.Len() != 1 {
		t.Fatalf("after draining everything: Len = %d, want 1 after one TryPush", q.Len())
	}
}

// item identifies a value by producer, the producer's sequence number, and
// the push call that carried it (a batch call carries several items).
type item struct {
	producer, seq, call int
}

// mode says how a producer pushes.
type mode int

const (
	modePush mode = iota
	modeTryPush
	modeBatch
	modeMixed
)

func (m mode) String() string {
	return [...]string{"Push", "TryPush", "Batch", "Mixed"}[m]
}

// produce pushes items seq 0..count-1 for producer p into push/batch.
func produce(p, count int, m mode, push func(item), tryPush func(item) bool, batch func([]item) int) {
	buf := make([]item, 0, 7)
	call := 0
	for seq := 0; seq < count; {
		mm := m
		if m == modeMixed {
			mm = mode(seq % 3)
		}
		switch mm {
		case modePush:
			push(item{p, seq, call})
			seq++
		case modeTryPush:
			for !tryPush(item{p, seq, call}) {
				yieldNow()
			}
			seq++
		case modeBatch:
			buf = buf[:0]
			for i := 0; i < cap(buf) && seq+i < count; i++ {
				buf = append(buf, item{p, seq + i, call})
			}
			n := batch(buf)
			if n == 0 {
				yieldNow()
			}
			seq += n
		}
		call++
	}
}

// checker verifies, as items arrive, that each producer's items come in
// sequence order (so none is lost, duplicated or reordered) and that the
// items of one batch call arrive without any other item between them.
type checker struct {
	t        *testing.T
	next     []int
	last     item
	haveLast bool
	closed   map[[2]int]bool
}

func newChecker(t *testing.T, producers int) *checker {
	return &checker{t: t, next: make([]int, producers), closed: map[[2]int]bool{}}
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
	key := [2]int{it.producer, it.call}
	if c.haveLast && (c.last.producer != it.producer || c.last.call != it.call) {
		c.closed[[2]int{c.last.producer, c.last.call}] = true
		if c.closed[key] {
			c.t.Errorf("producer %d call %d: items of one push split by another producer's", it.producer, it.call)
			return false
		}
	}
	c.last, c.haveLast = it, true
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
		mode                                         mode
	}{
		{8, 1024, perProducer, 64, modePush},
		{8, 4, perProducer / 4, 3, modeMixed},
		{4, 16, perProducer / 4, 16, modeBatch},
		{3, 2, perProducer / 10, 1, modeTryPush},
		{64, 256, perProducer / 32, 128, modeMixed},
	}
	for _, c := range cases {
		name := fmt.Sprintf("p=%d/cap=%d/%v", c.producers, c.capacity, c.mode)
		t.Run(name, func(t *testing.T) {
			q := NewMPSC[item](c.capacity)
			var wg sync.WaitGroup
			var lenErr atomic.Value
			stop := make(chan struct{})
			for p := 0; p < c.producers; p++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					produce(p, c.perProducer, c.mode, q.Push, q.TryPush, q.TryPushBatch)
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

func TestSPSCConcurrent(t *testing.T) {
	const total = 400_000
	cases := []struct {
		capacity, count, drainBatch int
		mode                        mode
	}{
		{1024, total, 64, modePush},
		{4, total / 4, 3, modeMixed},
		{2, total / 10, 1, modeTryPush},
		{64, total, 100, modeBatch},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("cap=%d/%v", c.capacity, c.mode), func(t *testing.T) {
			q := NewSPSC[item](c.capacity)
			done := make(chan struct{})
			go func() {
				defer close(done)
				produce(0, c.count, c.mode, q.Push, q.TryPush, q.TryPushBatch)
			}()
			consume(t, 1, c.count, c.drainBatch, q.Drain)
			waitClosed(t, done, "producer")
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
	vs := []*int{v, v, v}
	dst := make([]*int, 4)
	m := NewMPSC[*int](8)
	s := NewSPSC[*int](8)
	cases := []struct {
		name string
		f    func()
	}{
		{"MPSC", func() { m.TryPush(v); m.Push(v); m.TryPushBatch(vs); m.Drain(dst); m.Drain(dst) }},
		{"SPSC", func() { s.TryPush(v); s.Push(v); s.TryPushBatch(vs); s.Drain(dst); s.Drain(dst) }},
	}
	for _, c := range cases {
		if a := testing.AllocsPerRun(1000, c.f); a != 0 {
			t.Errorf("%s: %v allocations per push/drain round, want 0", c.name, a)
		}
	}
	if m.Len() != 0 || s.Len() != 0 {
		t.Errorf("rings not empty after balanced rounds: %d, %d", m.Len(), s.Len())
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
