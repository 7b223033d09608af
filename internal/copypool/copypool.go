// Package copypool runs large copies on a few worker threads.
//
// A direct READ of a same-host peer is a memcpy. A small one is cheapest
// done by the caller; a large one (an image is 4–30 MB) would make PostRead
// block for milliseconds and, done by one thread, leaves memory bandwidth
// unused: two threads copying halves of a 28.8 MB image beat one even on
// two cores. The pool splits a job into chunks, hands them to its workers
// (pinned, if asked, to the CPUs the reactor is told to use) and calls the
// job's Done once, from whoever finished the last chunk.
//
// Chunks are claimed, not handed out: a job's chunks are numbered, and a
// worker or any other goroutine takes the next one with a compare-and-swap
// on the job. A caller waiting for a job can therefore copy with the
// workers (Job.Help) instead of giving its CPU to the scheduler: on a
// machine whose cores are all busy (a reactor thread and a polling caller
// on two cores) the workers would otherwise wait for a time slice.
//
// A Job is owned by the caller and reused: submitting one allocates
// nothing.
package copypool

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ecxfer/ecxfer/internal/affinity"
)

// testHookOverflow, when set (tests), runs in Submit between the failed
// send of a job's first entry and its append to the overflow list.
var testHookOverflow func()

// ErrClosed is passed to Done for chunks a closed pool did not run.
var ErrClosed = errors.New("copypool: closed")

// Options size the pool.
type Options struct {
	// Workers is the number of copy threads (default 2).
	Workers int
	// CPUs, when not empty, pins worker i to CPUs[i%len(CPUs)].
	CPUs []int
	// Chunk is the smallest piece a job is cut into, in bytes (default
	// 256 KiB). A job is cut into at most 4 pieces per worker.
	Chunk int
	// Queue is how many chunks may wait (default 1024). A job that finds
	// the queue full goes on an overflow list the workers take from
	// between entries: Submit never copies on its caller (the reactor
	// thread) and never waits.
	Queue int
}

// Job is one copy. Set Run and Done before the first Submit; a Job may be
// submitted again once its Done has been called.
type Job struct {
	// Run copies bytes [lo, hi) of the job. Workers call it concurrently
	// for disjoint ranges.
	Run func(lo, hi int) error
	// Done is called exactly once per Submit, after every chunk has
	// returned, with the first error a chunk reported (or nil).
	Done func(err error)

	// claim is chunks<<32 | the next chunk to take. Submit stores it last,
	// after total and pending: whoever takes a chunk sees both.
	claim   atomic.Uint64
	total   atomic.Int64
	pending atomic.Int32
	failed  atomic.Bool
	err     error
}

// Pool is a set of copy workers.
type Pool struct {
	opts Options
	// ch has up to one entry per chunk: a worker that takes one copies
	// the job's chunks until none is left, and more entries let more
	// workers join in.
	ch chan *Job
	// over holds jobs that found ch full, under overMu; workers take them
	// between entries of ch and before blocking on it.
	overMu  sync.Mutex
	over    []*Job
	wg      sync.WaitGroup
	mu      sync.RWMutex // held shared by Submit, exclusively by Close
	closed  bool
	workers int
	busy    atomic.Int64 // nanoseconds the workers spent copying
}

// New starts the workers.
func New(o Options) (*Pool, error) {
	if o.Workers == 0 {
		o.Workers = 2
	}
	if o.Chunk == 0 {
		o.Chunk = 256 << 10
	}
	if o.Queue == 0 {
		o.Queue = 1024
	}
	switch {
	case o.Workers < 0 || o.Workers > 256:
		return nil, fmt.Errorf("copypool: %d workers (1..256)", o.Workers)
	case o.Chunk < 0 || o.Queue < 0:
		return nil, fmt.Errorf("copypool: chunk %d, queue %d", o.Chunk, o.Queue)
	}
	p := &Pool{opts: o, ch: make(chan *Job, o.Queue), workers: o.Workers}
	errs := make(chan error, o.Workers)
	for i := range o.Workers {
		p.wg.Add(1)
		go p.work(i, errs)
	}
	var first error
	for range o.Workers {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		p.Close()
		return nil, first
	}
	return p, nil
}

// Workers returns the number of workers.
func (p *Pool) Workers() int { return p.workers }

func (p *Pool) work(i int, ready chan<- error) {
	defer p.wg.Done()
	if len(p.opts.CPUs) > 0 {
		// Never unlocked: the pinned thread is retired with the worker.
		runtime.LockOSThread()
		if err := affinity.PinThread(p.opts.CPUs[i%len(p.opts.CPUs)]); err != nil {
			ready <- err
			return
		}
	}
	debug.SetPanicOnFault(true)
	ready <- nil
	for {
		// The overflow first: a job lands there only while ch is full,
		// so a worker is busy with ch's entries and looks here after
		// each; one that had looked and blocked before the job landed
		// is woken by Submit's second send.
		for j := p.takeOver(); j != nil; j = p.takeOver() {
			p.drain(j)
		}
		j, ok := <-p.ch
		if !ok {
			// Closed: Submit appended nothing since (Close waited for
			// it), so what is on the overflow now is the last of it.
			for j := p.takeOver(); j != nil; j = p.takeOver() {
				p.drain(j)
			}
			return
		}
		// An entry whose chunks others took already (or that outlived
		// its submission) finds nothing to claim.
		p.drain(j)
	}
}

// drain copies j's chunks until none is left to take.
func (p *Pool) drain(j *Job) {
	for {
		t0 := time.Now()
		if !j.runOne() {
			return
		}
		p.busy.Add(int64(time.Since(t0)))
	}
}

// takeOver pops the oldest job of the overflow list, nil when empty.
func (p *Pool) takeOver() *Job {
	p.overMu.Lock()
	defer p.overMu.Unlock()
	if len(p.over) == 0 {
		return nil
	}
	j := p.over[0]
	p.over[0] = nil
	p.over = p.over[1:]
	if len(p.over) == 0 {
		p.over = p.over[:0:0] // let the array go once drained
	}
	return j
}

// BusyTime returns the time the workers have spent copying, summed over
// the workers; its rate divided by Workers is their busy fraction. Chunks
// a helper copies are not in it.
func (p *Pool) BusyTime() time.Duration { return time.Duration(p.busy.Load()) }

// runOne takes the job's next chunk, copies it and finishes the job if it
// was the last. It reports false when no chunk was left to take.
//
// A job is reused only after its Done: until then no chunk of it is
// taken twice, and a claim that loads an exhausted word touches nothing
// of the job but that word. A claim racing a resubmission takes a chunk
// of the new submission, whose total and pending Submit stored before
// the claim word.
func (j *Job) runOne() bool {
	for {
		w := j.claim.Load()
		n, i := w>>32, w&(1<<32-1)
		if i >= n {
			return false
		}
		if !j.claim.CompareAndSwap(w, w+1) {
			continue
		}
		total := uint64(j.total.Load())
		if err := j.Run(int(total*i/n), int(total*(i+1)/n)); err != nil {
			j.fail(err)
		}
		j.chunkDone()
		return true
	}
}

// Help copies the chunks of j that nobody has taken yet, on the calling
// goroutine, and returns how many it copied. It is safe at any time, on a
// job in any state: on a finished job it copies nothing. The job's Done
// may run on the caller, if Help copies the last chunk.
func (j *Job) Help() int {
	n := 0
	for j.runOne() {
		n++
	}
	return n
}

// HelpOne is Help for at most one chunk: a caller that must not be held
// for a whole job (one that checks a transfer, or waits with a deadline)
// copies one chunk and reports whether it found one.
func (j *Job) HelpOne() bool { return j.runOne() }

func (j *Job) fail(err error) {
	if j.failed.CompareAndSwap(false, true) {
		j.err = err
	}
}

func (j *Job) chunkDone() {
	if j.pending.Add(-1) == 0 {
		err := j.err
		j.err = nil
		j.failed.Store(false)
		j.Done(err)
	}
}

// Chunks returns how many pieces Submit cuts a job of total bytes into.
func (p *Pool) Chunks(total int) int {
	n := (total + p.opts.Chunk - 1) / p.opts.Chunk
	return max(1, min(n, 4*p.workers))
}

// Submit cuts bytes [0, total) of j into chunks and queues them. It does
// not wait for the copy, nor copy anything itself; j.Done reports the end.
// On a closed pool Done is called at once with ErrClosed.
func (p *Pool) Submit(j *Job, total int) {
	n := p.Chunks(total)
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock() // Done may submit again
		j.fail(ErrClosed)
		j.pending.Store(1)
		j.chunkDone()
		return
	}
	j.pending.Store(int32(n))
	j.total.Store(int64(total))
	j.claim.Store(uint64(n) << 32)
	for i := range n {
		select {
		case p.ch <- j:
			continue
		default:
		}
		if i == 0 {
			if testHookOverflow != nil {
				testHookOverflow()
			}
			// Not one entry: the job waits on the overflow list. With
			// one or more, whoever takes an entry copies every chunk
			// left, so the job finishes without the rest.
			p.overMu.Lock()
			p.over = append(p.over, j)
			p.overMu.Unlock()
			// Every worker may have emptied ch, looked at the list
			// before the append and blocked since the send above
			// failed: one more try wakes one. If ch is still full, a
			// worker takes one of its entries and then looks at the
			// list, after the append.
			select {
			case p.ch <- j:
			default:
			}
		}
		break
	}
	p.mu.RUnlock()
}

// Close stops the workers after the queued chunks have run. Idempotent.
func (p *Pool) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.ch)
	}
	p.mu.Unlock()
	p.wg.Wait()
}
