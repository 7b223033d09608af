package ring

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
)

// The benchmarks move b.N ints from N producer goroutines to one consumer
// goroutine (the benchmark goroutine) through a queue of benchCap slots, and
// report the wall time per item. Every variant moves the same items through
// the same capacity. The ring is used as the reactor uses it: producers call
// TryPush, and one that finds the ring full yields the processor and tries
// again (what Post does with WaitWhenBusy before it starts sleeping); the
// consumer drains up to benchBatch items per loop turn. The mutex slice is
// used the same way. BenchmarkChan's producers block in a channel send and
// its consumer receives one item at a time, as a blocking receive must.
const (
	benchCap   = 1024
	benchBatch = 128
)

var benchProducers = []int{1, 2, 8, 64}

// runBench starts producers that each call push for their share of b.N items
// and runs consume (which must receive exactly b.N items and return how many
// receive or drain calls it made) on the benchmark goroutine, timing both
// together.
func runBench(b *testing.B, producers int, push func(v int), consume func(total int) (sum, calls int)) {
	b.ReportAllocs()
	start := make(chan struct{})
	var wg sync.WaitGroup
	for p := 0; p < producers; p++ {
		n := b.N / producers
		if p < b.N%producers {
			n++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := 0; i < n; i++ {
				push(i)
			}
		}()
	}
	b.ResetTimer()
	close(start)
	sum, calls := consume(b.N)
	wg.Wait()
	b.StopTimer()
	if b.N > 0 {
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/item")
	}
	if calls > 0 {
		// How full the consumer found the queue: near benchBatch means the
		// producers were ahead, near 1 that the consumer chased them.
		b.ReportMetric(float64(b.N)/float64(calls), "items/drain")
	}
	// Producer p sends 0..n-1, so the sum is known; checking it also keeps
	// the consumer's reads from being optimised away.
	want := 0
	for p := 0; p < producers; p++ {
		n := b.N / producers
		if p < b.N%producers {
			n++
		}
		want += n * (n - 1) / 2
	}
	if sum != want {
		b.Fatalf("consumer summed %d, want %d", sum, want)
	}
}

// The ring's consumer stands in for the reactor: a locked thread that,
// each loop turn, drains what is queued and then does its own work (polls
// the transfer engine), yielding the processor only after a long idle
// stretch. Polling an empty ring in a tight loop would instead keep pulling
// the cache line a producer is writing; giving up the processor on every
// empty poll would hand the consumer's core to producers, which then race
// each other for the tail across both cores. BenchmarkMPSCYieldingConsumer
// measures that second consumer too.
const (
	// turnWork is the spin count of the stand-in for one engine poll,
	// about 0.1µs here (BenchmarkTurnWork measures it).
	turnWork = 400
	// idleTurns empty turns in a row (about 50µs, the reactor's default
	// SpinFor) before the consumer yields once.
	idleTurns = 500
)

// spinSink keeps the stand-in work from being optimised away.
var spinSink int

//go:noinline
func spin(n int) {
	s := 0
	for i := 0; i < n; i++ {
		s += i
	}
	spinSink += s
}

func BenchmarkTurnWork(b *testing.B) {
	for i := 0; i < b.N; i++ {
		spin(turnWork)
	}
}

// consumeBatches drains total items through drain in batches of benchBatch
// the way the reactor does (see turnWork).
func consumeBatches(total int, drain func([]int) int) (sum, calls int) {
	return consumeIdling(total, drain, func(empty int) {
		spin(turnWork)
		if empty%idleTurns == 0 {
			runtime.Gosched()
		}
	})
}

// consumeIdling drains total items through drain in batches of benchBatch,
// calling idle after every poll that found the queue empty with the number
// of empty polls in a row.
func consumeIdling(total int, drain func([]int) int, idle func(empty int)) (sum, calls int) {
	dst := make([]int, benchBatch)
	empty := 0
	for got := 0; got < total; {
		n := drain(dst)
		if n == 0 {
			empty++
			idle(empty)
			continue
		}
		empty = 0
		calls++
		for _, v := range dst[:n] {
			sum += v
		}
		got += n
	}
	return sum, calls
}

// tryPushing turns a TryPush into a push that yields the processor while
// the queue is full.
func tryPushing(tryPush func(int) bool) func(int) {
	return func(v int) {
		for !tryPush(v) {
			runtime.Gosched()
		}
	}
}

func BenchmarkMPSC(b *testing.B) {
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			q := NewMPSC[int](benchCap)
			runBench(b, p, tryPushing(q.TryPush), func(total int) (int, int) {
				return consumeBatches(total, q.Drain)
			})
		})
	}
}

// BenchmarkMPSCYieldingConsumer is BenchmarkMPSC with a consumer that
// yields the processor whenever the ring is empty.
func BenchmarkMPSCYieldingConsumer(b *testing.B) {
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			q := NewMPSC[int](benchCap)
			runBench(b, p, tryPushing(q.TryPush), func(total int) (int, int) {
				return consumeIdling(total, q.Drain, func(int) { runtime.Gosched() })
			})
		})
	}
}

// BenchmarkChan is the channel with its natural consumer, a blocking
// receive per item. BenchmarkChanPolling drains it like the ring instead.
func BenchmarkChan(b *testing.B) {
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			ch := make(chan int, benchCap)
			runBench(b, p, func(v int) { ch <- v }, func(total int) (sum, calls int) {
				for got := 0; got < total; got++ {
					sum += <-ch
				}
				return sum, total
			})
		})
	}
}

// BenchmarkChanPolling drains the channel with the ring's consumer, taking
// up to benchBatch items per turn with non-blocking receives.
func BenchmarkChanPolling(b *testing.B) {
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			ch := make(chan int, benchCap)
			drain := func(dst []int) int {
				for n := range dst {
					select {
					case dst[n] = <-ch:
					default:
						return n
					}
				}
				return len(dst)
			}
			runBench(b, p, func(v int) { ch <- v }, func(total int) (int, int) {
				return consumeBatches(total, drain)
			})
		})
	}
}

// mutexQueue is the baseline a ring replaces: a bounded circular buffer
// behind a sync.Mutex, drained in batches like the ring.
type mutexQueue struct {
	mu   sync.Mutex
	buf  []int
	head int
	n    int
}

func (m *mutexQueue) tryPush(v int) bool {
	m.mu.Lock()
	if m.n == len(m.buf) {
		m.mu.Unlock()
		return false
	}
	m.buf[(m.head+m.n)%len(m.buf)] = v
	m.n++
	m.mu.Unlock()
	return true
}

func (m *mutexQueue) drain(dst []int) int {
	m.mu.Lock()
	n := min(m.n, len(dst))
	for i := 0; i < n; i++ {
		dst[i] = m.buf[(m.head+i)%len(m.buf)]
	}
	m.head = (m.head + n) % len(m.buf)
	m.n -= n
	m.mu.Unlock()
	return n
}

func BenchmarkMutexSlice(b *testing.B) {
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			q := &mutexQueue{buf: make([]int, benchCap)}
			runBench(b, p, tryPushing(q.tryPush), func(total int) (int, int) {
				return consumeBatches(total, q.drain)
			})
		})
	}
}
