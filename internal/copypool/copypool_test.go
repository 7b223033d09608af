package copypool

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer/internal/affinity"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// copyJob copies src into dst through the pool.
type copyJob struct {
	Job
	dst, src []byte
	done     chan error
	calls    int
}

// holdWorker keeps one of p's workers busy with the job holder until
// block is closed; it returns once that worker has started.
func holdWorker(p *Pool) (block chan struct{}, holder *copyJob) {
	block, started := make(chan struct{}), make(chan struct{})
	holder = newCopyJob(nil, nil)
	holder.Run = func(lo, hi int) error { close(started); <-block; return nil }
	p.Submit(&holder.Job, 1)
	<-started
	return block, holder
}

func newCopyJob(dst, src []byte) *copyJob {
	c := &copyJob{dst: dst, src: src, done: make(chan error, 1)}
	c.Run = func(lo, hi int) error { copy(c.dst[lo:hi], c.src[lo:hi]); return nil }
	c.Done = func(err error) { c.calls++; c.done <- err }
	return c
}

func TestCopy(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 3, Chunk: 1000})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, n := range []int{1, 999, 1000, 1001, 12345, 1 << 20} {
		src := bytes.Repeat([]byte{byte(n), 1, 2, 3, 4, 5, 6}, n/7+1)[:n]
		dst := make([]byte, n)
		j := newCopyJob(dst, src)
		for round := range 3 {
			clear(dst)
			p.Submit(&j.Job, n)
			if err := <-j.done; err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst, src) {
				t.Fatalf("%d bytes, round %d: copy differs", n, round)
			}
		}
		if j.calls != 3 {
			t.Fatalf("Done called %d times for 3 submits", j.calls)
		}
	}
	if got := p.Chunks(1 << 30); got != 12 {
		t.Fatalf("Chunks(1 GiB) = %d, want 4 per worker", got)
	}
}

func TestFirstErrorWins(t *testing.T) {
	p, err := New(Options{Workers: 2, Chunk: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	boom := errors.New("boom")
	j := newCopyJob(nil, nil)
	j.Run = func(lo, hi int) error {
		if lo == 0 {
			return boom
		}
		return nil
	}
	p.Submit(&j.Job, 100)
	if err := <-j.done; !errors.Is(err, boom) {
		t.Fatalf("Done(%v), want boom", err)
	}
	// The error does not stick to the next submit.
	j.Run = func(lo, hi int) error { return nil }
	p.Submit(&j.Job, 100)
	if err := <-j.done; err != nil {
		t.Fatalf("second submit: %v", err)
	}
}

// A job that finds the queue full is not copied by its submitter (the
// reactor thread, which must keep turning): it waits on the overflow
// list, and the worker copies all of it once free; a job with only some
// of its entries queued is finished by whoever takes them.
func TestQueueFullOverflows(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 1, Chunk: 1, Queue: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// Hold the only worker, then fill the queue's two places.
	block, started := make(chan struct{}), make(chan struct{})
	release := sync.OnceFunc(func() { close(block) })
	defer release() // before Close, which waits for the worker
	holder := newCopyJob(nil, nil)
	holder.Run = func(lo, hi int) error { close(started); <-block; return nil }
	p.Submit(&holder.Job, 1)
	<-started
	var submitter atomic.Bool // set while Submit runs on this goroutine
	var onSubmitter atomic.Int32
	count := func(ran *atomic.Int32) func(lo, hi int) error {
		return func(lo, hi int) error {
			if submitter.Load() {
				onSubmitter.Add(1)
			}
			ran.Add(1)
			return nil
		}
	}
	var ranPart, ranOver atomic.Int32
	part := newCopyJob(nil, nil) // 4 chunks, one place left: one entry
	part.Run = count(&ranPart)
	over := newCopyJob(nil, nil) // no place left: the overflow list
	over.Run = count(&ranOver)
	submitter.Store(true)
	p.Submit(&part.Job, 4)
	p.Submit(&over.Job, 3)
	submitter.Store(false)
	if n := onSubmitter.Load(); n != 0 {
		t.Fatalf("Submit copied %d chunks itself", n)
	}
	select {
	case <-part.done:
		t.Fatal("a job finished while the only worker was held")
	case <-over.done:
		t.Fatal("a job finished while the only worker was held")
	default:
	}
	release()
	<-holder.done
	for _, j := range []*copyJob{part, over} {
		if err := <-j.done; err != nil {
			t.Fatal(err)
		}
	}
	if ranPart.Load() != 4 || ranOver.Load() != 3 {
		t.Fatalf("chunks copied: %d of 4, %d of 3", ranPart.Load(), ranOver.Load())
	}
}

// Jobs on the overflow list when the pool closes are still copied.
func TestCloseRunsOverflow(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 1, Chunk: 1, Queue: 1})
	if err != nil {
		t.Fatal(err)
	}
	block, holder := holdWorker(p)
	filler := newCopyJob(nil, nil)
	filler.Run = func(lo, hi int) error { return nil }
	p.Submit(&filler.Job, 1)
	over := newCopyJob(nil, nil)
	var ran atomic.Int32
	over.Run = func(lo, hi int) error { ran.Add(1); return nil }
	p.Submit(&over.Job, 2)
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	close(block)
	<-closed
	if err := <-over.done; err != nil || ran.Load() != 2 {
		t.Fatalf("overflow job at Close: %v, %d of 2 chunks", err, ran.Load())
	}
	<-holder.done
	<-filler.done
}

func TestClosed(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	p.Close()
	j := newCopyJob(make([]byte, 10), make([]byte, 10))
	p.Submit(&j.Job, 10)
	if err := <-j.done; !errors.Is(err, ErrClosed) {
		t.Fatalf("submit after close: %v", err)
	}
}

func TestOptions(t *testing.T) {
	for _, o := range []Options{{Workers: -1}, {Workers: 1000}, {Chunk: -1}, {Queue: -1}, {CPUs: []int{1 << 20}}} {
		if p, err := New(o); err == nil {
			p.Close()
			t.Errorf("%+v accepted", o)
		}
	}
	cpus, err := affinity.Allowed()
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(Options{Workers: 2, CPUs: cpus[:1]})
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
}

func TestRace(t *testing.T) {
	p, err := New(Options{Workers: 2, Chunk: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			src := bytes.Repeat([]byte{byte(g)}, 10000)
			dst := make([]byte, len(src))
			j := newCopyJob(dst, src)
			for range 50 {
				clear(dst)
				p.Submit(&j.Job, len(src))
				if err := <-j.done; err != nil || !bytes.Equal(dst, src) {
					t.Errorf("goroutine %d: %v", g, err)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestZeroAllocs(t *testing.T) {
	p, err := New(Options{Workers: 2, Chunk: 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	src := make([]byte, 1<<20)
	dst := make([]byte, 1<<20)
	j := newCopyJob(dst, src)
	allocs := testing.AllocsPerRun(200, func() {
		p.Submit(&j.Job, len(src))
		<-j.done
	})
	if allocs != 0 {
		t.Fatalf("%.2f allocations per job, want 0", allocs)
	}
}

// BenchmarkImage copies an 880 x 32 KiB image through 1, 2 and 4 workers
// next to one plain copy; the source is larger than the caches.
func BenchmarkImage(b *testing.B) {
	const size = 880 * 32 << 10
	src := make([]byte, 8*size) // rotate through 8 images so none is cached
	for i := range src {
		src[i] = byte(i)
	}
	dst := make([]byte, size)
	b.Run("memcpy", func(b *testing.B) {
		b.SetBytes(size)
		i := 0
		for b.Loop() {
			copy(dst, src[i*size:(i+1)*size])
			i = (i + 1) % 8
		}
	})
	for _, w := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("workers=%d", w), func(b *testing.B) {
			p, err := New(Options{Workers: w})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			img := 0
			j := newCopyJob(dst, nil)
			j.Run = func(lo, hi int) error { copy(dst[lo:hi], src[img*size+lo:img*size+hi]); return nil }
			b.SetBytes(size)
			for b.Loop() {
				p.Submit(&j.Job, size)
				<-j.done
				img = (img + 1) % 8
			}
		})
	}
}

// TestBusyTime: the workers' copying time is counted, and only grows.
func TestBusyTime(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 2, Chunk: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if got := p.BusyTime(); got != 0 {
		t.Fatalf("BusyTime before any job = %v", got)
	}
	src := bytes.Repeat([]byte{7}, 8<<20)
	dst := make([]byte, len(src))
	j := newCopyJob(dst, src)
	var last time.Duration
	for round := range 3 {
		p.Submit(&j.Job, len(src))
		if err := <-j.done; err != nil {
			t.Fatal(err)
		}
		// The job's Done runs inside the last chunk's timing; wait for
		// that worker to add its time.
		deadline := time.Now().Add(10 * time.Second)
		for p.BusyTime() <= last && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		got := p.BusyTime()
		if got <= last {
			t.Fatalf("round %d: BusyTime %v did not grow from %v", round, got, last)
		}
		last = got
	}
}

// HelpOne copies one untaken chunk per call, in order, and reports false
// once none is left; Done runs on the call that copied the last.
func TestHelpOneCopiesOneChunk(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 1, Chunk: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	block, _ := holdWorker(p)
	defer close(block)

	src := bytes.Repeat([]byte("0123456789"), 40)
	dst := make([]byte, len(src))
	j := newCopyJob(dst, src)
	p.Submit(&j.Job, len(src))
	for k := 1; k <= 4; k++ {
		if !j.HelpOne() {
			t.Fatalf("call %d found no chunk", k)
		}
		if !bytes.Equal(dst[:100*k], src[:100*k]) || bytes.ContainsAny(dst[100*k:], "0123456789") {
			t.Fatalf("after %d calls: %q", k, dst)
		}
		select {
		case <-j.done:
			if k < 4 {
				t.Fatalf("Done after %d of 4 chunks", k)
			}
		default:
			if k == 4 {
				t.Fatal("Done did not run on the call that copied the last chunk")
			}
		}
	}
	if j.HelpOne() {
		t.Fatal("HelpOne on a finished job found a chunk")
	}
}

// A caller that helps copies the chunks no worker has taken: with the only
// worker held, Help copies the whole job and its Done runs on the caller.
// The queue entries left behind find nothing to take, and one that outlives
// its submission takes a chunk of the next at most once.
func TestHelpTakesUntakenChunks(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 1, Chunk: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var never Job
	if n := never.Help(); n != 0 {
		t.Fatalf("Help on a job never submitted copied %d chunks", n)
	}
	block, holder := holdWorker(p)

	src := bytes.Repeat([]byte("0123456789"), 40)
	dst := make([]byte, len(src))
	j := newCopyJob(dst, src)
	p.Submit(&j.Job, len(src))
	if n := j.Help(); n != 4 {
		t.Fatalf("Help copied %d chunks, want all 4", n)
	}
	select {
	case err := <-j.done:
		if err != nil || !bytes.Equal(dst, src) {
			t.Fatalf("helped job: %v, equal %v", err, bytes.Equal(dst, src))
		}
	default:
		t.Fatal("Done did not run on the helper that copied the last chunk")
	}
	if n := j.Help(); n != 0 {
		t.Fatalf("Help on a finished job copied %d chunks", n)
	}
	// Resubmit while the four stale entries still wait for the worker.
	clear(dst)
	var runs [4]int
	j.Run = func(lo, hi int) error {
		runs[lo/100]++
		copy(dst[lo:hi], src[lo:hi])
		return nil
	}
	p.Submit(&j.Job, len(src))
	close(block)
	<-holder.done
	if err := <-j.done; err != nil || !bytes.Equal(dst, src) {
		t.Fatalf("resubmitted job: %v, equal %v", err, bytes.Equal(dst, src))
	}
	if runs != [4]int{1, 1, 1, 1} {
		t.Fatalf("chunk runs %v, want each once", runs)
	}
	if j.calls != 2 {
		t.Fatalf("Done called %d times for 2 submits", j.calls)
	}
}

// Helpers and workers racing for the chunks of reused jobs copy every byte
// exactly once per submission.
func TestHelpRace(t *testing.T) {
	p, err := New(Options{Workers: 2, Chunk: 256})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Go(func() {
			src := bytes.Repeat([]byte{byte(g + 1)}, 4096)
			dst := make([]byte, len(src))
			var copied sync.Map // lo -> submission
			j := newCopyJob(dst, src)
			round := 0
			j.Run = func(lo, hi int) error {
				if prev, dup := copied.Swap(lo, round); dup && prev == round {
					t.Errorf("chunk at %d copied twice in round %d", lo, round)
				}
				copy(dst[lo:hi], src[lo:hi])
				return nil
			}
			stop := make(chan struct{})
			helper := make(chan struct{})
			go func() {
				defer close(helper)
				for {
					select {
					case <-stop:
						return
					default:
						j.Help()
					}
				}
			}()
			for round = 1; round <= 200; round++ {
				clear(dst)
				p.Submit(&j.Job, len(src))
				j.Help()
				if err := <-j.done; err != nil || !bytes.Equal(dst, src) {
					t.Errorf("goroutine %d round %d: %v", g, round, err)
					break
				}
			}
			close(stop)
			<-helper
		})
	}
	wg.Wait()
}

// A job that goes to the overflow list after every worker has looked at
// the list and blocked on the channel still runs: Submit wakes one. The
// hook holds Submit between the failed send and the append while the
// only worker empties the channel and blocks.
func TestOverflowAfterWorkersBlocked(t *testing.T) {
	leakcheck.Check(t)
	p, err := New(Options{Workers: 1, Chunk: 1, Queue: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	block, _ := holdWorker(p)
	filler := newCopyJob(nil, nil) // takes the channel's only place
	filler.Run = func(lo, hi int) error { return nil }
	p.Submit(&filler.Job, 1)
	testHookOverflow = func() {
		close(block)
		<-filler.done
		time.Sleep(20 * time.Millisecond) // the worker blocks on the channel
	}
	defer func() { testHookOverflow = nil }()
	late := newCopyJob(nil, nil)
	late.Run = func(lo, hi int) error { return nil }
	p.Submit(&late.Job, 1)
	testHookOverflow = nil
	select {
	case <-late.done:
	case <-time.After(5 * time.Second):
		p.overMu.Lock()
		n := len(p.over)
		p.overMu.Unlock()
		t.Fatalf("a job on the overflow list did not run in 5s with an idle worker (%d on the list)", n)
	}
}
