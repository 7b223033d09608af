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
// the same capacity; the batch-capable consumers take up to benchBatch items
// per call, the channel consumer receives one at a time as a channel must.
// Producers that find the queue full use the package's Push backoff (the
// channel blocks in the runtime instead).
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

// consumeBatches drains total items through drain in batches of benchBatch,
// yielding the processor whenever the queue is empty.
func consumeBatches(total int, drain func([]int) int) (sum, calls int) {
	dst := make([]int, benchBatch)
	for got := 0; got < total; {
		n := drain(dst)
		if n == 0 {
			runtime.Gosched()
			continue
		}
		calls++
		for _, v := range dst[:n] {
			sum += v
		}
		got += n
	}
	return sum, calls
}

func BenchmarkMPSC(b *testing.B) {
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			q := NewMPSC[int](benchCap)
			runBench(b, p, q.Push, func(total int) (int, int) {
				return consumeBatches(total, q.Drain)
			})
		})
	}
}

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

// mutexQueue is the baseline a ring replaces: a bounded circular buffer
// behind a sync.Mutex, drained in batches like the rings.
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

func (m *mutexQueue) push(v int) {
	var bo backoff
	for !m.tryPush(v) {
		bo.wait()
	}
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
			runBench(b, p, q.push, func(total int) (int, int) {
				return consumeBatches(total, q.drain)
			})
		})
	}
}

// BenchmarkSPSC is the one-producer case; compare it with
// BenchmarkChan/producers=1 and BenchmarkMPSC/producers=1.
func BenchmarkSPSC(b *testing.B) {
	q := NewSPSC[int](benchCap)
	runBench(b, 1, q.Push, func(total int) (int, int) {
		return consumeBatches(total, q.Drain)
	})
}

// BenchmarkMPSCBatch is BenchmarkMPSC with producers that submit 16 items
// per TryPushBatch call, to show what one claim per batch saves.
func BenchmarkMPSCBatch(b *testing.B) {
	const producerBatch = 16
	for _, p := range benchProducers {
		b.Run(fmt.Sprintf("producers=%d", p), func(b *testing.B) {
			q := NewMPSC[int](benchCap)
			b.ReportAllocs()
			start := make(chan struct{})
			var wg sync.WaitGroup
			for i := 0; i < p; i++ {
				n := b.N / p
				if i < b.N%p {
					n++
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					buf := make([]int, 0, producerBatch)
					<-start
					for next := 0; next < n; {
						buf = buf[:0]
						for j := next; j < n && len(buf) < producerBatch; j++ {
							buf = append(buf, j)
						}
						var bo backoff
						for sent := 0; sent < len(buf); {
							k := q.TryPushBatch(buf[sent:])
							if k == 0 {
								bo.wait()
							}
							sent += k
						}
						next += len(buf)
					}
				}()
			}
			b.ResetTimer()
			close(start)
			_, calls := consumeBatches(b.N, q.Drain)
			wg.Wait()
			b.StopTimer()
			if b.N > 0 {
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/item")
			}
			if calls > 0 {
				b.ReportMetric(float64(b.N)/float64(calls), "items/drain")
			}
		})
	}
}
