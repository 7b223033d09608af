package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// memcpySpan is how much source memory the memcpy reference rotates
// through: far more than any cache, like a producer's region.
const memcpySpan = 256 << 20

// memcpyRefs measures copy bandwidth for one block size, the source
// rotating through memcpySpan (colder than any cache, like a producer's
// region): "memcpy" copies each round of ImageBlocks blocks with one copy,
// as a merged contiguous READ moves it; "memcpy per block" copies blocks
// from random places of the source, one by one, into scattered places, as
// a scattered READ does. Both are
// measured with one thread and, when workers > 1, with workers threads
// that each copy their share of every round (as the direct path's copy
// workers do). Their p50 is one block's copy, timed one by one, from a
// cold source block into the next of the LocalBlocks destination blocks,
// as the one-block cells' READs land.
func memcpyRefs(bs int, d time.Duration, workers int) ([]Reference, error) {
	src, err := unix.Mmap(-1, 0, memcpySpan, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("memcpy reference: mmap: %w", err)
	}
	defer unix.Munmap(src)
	dst, err := unix.Mmap(-1, 0, LocalBlocks*bs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("memcpy reference: mmap: %w", err)
	}
	defer unix.Munmap(dst)
	for i := 0; i < len(src); i += 4096 {
		src[i] = byte(i >> 12)
	}
	touch(dst)
	round := ImageBlocks * bs
	nrounds := memcpySpan / round
	nblk := memcpySpan / bs
	rng := rand.New(rand.NewSource(1))
	perm := rng.Perm(LocalBlocks)[:ImageBlocks]
	// A scattered READ's blocks come from random places of the producer's
	// region: so do the per-block copies' (read in order, the hardware
	// would prefetch them).
	from := rng.Perm(nblk)
	// part copies blocks [lo, hi) of round k.
	part := func(whole bool, k, lo, hi int) {
		if whole {
			off := (k % nrounds) * round
			copy(dst[lo*bs:hi*bs], src[off+lo*bs:off+hi*bs])
			return
		}
		for b := lo; b < hi; b++ {
			l, s := perm[b], from[(k*ImageBlocks+b)%nblk]
			copy(dst[l*bs:(l+1)*bs], src[s*bs:(s+1)*bs])
		}
	}
	measure := func(whole bool, threads int) float64 {
		var bytes int64
		var wg sync.WaitGroup
		start := time.Now()
		for k := 0; time.Since(start) < d/4 || k < nrounds; k++ {
			if threads == 1 {
				part(whole, k, 0, ImageBlocks)
			} else {
				for w := range threads {
					wg.Go(func() { part(whole, k, ImageBlocks*w/threads, ImageBlocks*(w+1)/threads) })
				}
				wg.Wait()
			}
			bytes += int64(round)
		}
		return float64(bytes) / time.Since(start).Seconds() / 1e9
	}
	whole, scattered := measure(true, 1), measure(false, 1)
	// One-block copies as the one-block cells make them: a cold source
	// block, and the destination rotating through the local region
	// (READ k lands in local block k mod LocalBlocks).
	lat := make([]time.Duration, 0, 20000)
	for i := 0; i < cap(lat); i++ {
		off := ((i * 7919) % nblk) * bs
		to := (i % LocalBlocks) * bs
		t0 := time.Now()
		copy(dst[to:to+bs], src[off:off+bs])
		lat = append(lat, time.Since(t0))
	}
	var r Result
	summarize(&r, lat)
	note := fmt.Sprintf("1 thread, %d-block rounds from a %d MiB source", ImageBlocks, memcpySpan>>20)
	refs := []Reference{
		{Name: "memcpy", BlockSize: bs, GBPerSec: whole, P50us: r.P50us, Note: note + ", one copy per round"},
		{Name: "memcpy per block", BlockSize: bs, GBPerSec: scattered, P50us: r.P50us, Note: note + ", block by block, both ends scattered"},
	}
	if workers > 1 {
		note := fmt.Sprintf("%d threads, a share of each %d-block round each", workers, ImageBlocks)
		refs = append(refs,
			Reference{Name: fmt.Sprintf("memcpy %dT", workers), BlockSize: bs, GBPerSec: measure(true, workers), P50us: r.P50us, Note: note + ", one copy per share"},
			Reference{Name: fmt.Sprintf("memcpy per block %dT", workers), BlockSize: bs, GBPerSec: measure(false, workers), P50us: r.P50us, Note: note + ", block by block, both ends scattered"})
	}
	return refs, nil
}

// perftestCmd is a ucx_perftest command that dies with this process: a
// harness killed during the references (SIGKILL, the OOM killer) used to
// leave the server listening on every interface. (The signal comes when
// the thread that started it ends, which in Go is the process, or a
// goroutine that exits locked to its thread; the reference goroutines do
// not lock theirs.)
func perftestCmd(ctx context.Context, exe string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// errNoPerftest says ucx_perftest is not installed.
var errNoPerftest = errors.New("ucx_perftest not installed")

// perftestRef runs ucx_perftest's ucp_get for one message size, server and
// client as child processes on 127.0.0.1, and parses the client's final line.
func perftestRef(ctx context.Context, bs int, iters int) (Reference, error) {
	exe, err := exec.LookPath("ucx_perftest")
	if err != nil {
		return Reference{}, errNoPerftest
	}
	port, err := freePort()
	if err != nil {
		return Reference{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	args := []string{"-t", "ucp_get", "-s", strconv.Itoa(bs), "-n", strconv.Itoa(iters), "-p", strconv.Itoa(port)}
	srv := perftestCmd(ctx, exe, args...)
	if err := srv.Start(); err != nil {
		return Reference{}, fmt.Errorf("ucx_perftest server: %w", err)
	}
	defer func() {
		_ = srv.Process.Kill()
		_ = srv.Wait()
	}()
	// The server needs a moment to listen; retry the client until it connects.
	var out []byte
	for attempt := 0; ; attempt++ {
		time.Sleep(100 * time.Millisecond)
		cli := perftestCmd(ctx, exe, append([]string{"127.0.0.1"}, args...)...)
		out, err = cli.CombinedOutput()
		if err == nil || attempt >= 20 || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return Reference{}, fmt.Errorf("ucx_perftest client: %v: %s", err, lastLines(string(out), 3))
	}
	return parsePerftest(string(out), bs)
}

// parsePerftest reads the "Final:" line: iterations, latency p50, average,
// overall (µs), bandwidth average, overall (MB/s, 2^20 bytes), message
// rate average, overall.
func parsePerftest(out string, bs int) (Reference, error) {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 9 || f[0] != "Final:" {
			continue
		}
		p50, err1 := strconv.ParseFloat(f[2], 64)
		bw, err2 := strconv.ParseFloat(f[6], 64)
		if err1 != nil || err2 != nil {
			return Reference{}, fmt.Errorf("ucx_perftest: cannot parse %q", sc.Text())
		}
		// The p50 of a pipelined bandwidth test is the time between gets
		// issued back to back, not one get's latency: not shown beside
		// the READs' p50.
		_ = p50
		return Reference{Name: "ucx_perftest ucp_get", BlockSize: bs, GBPerSec: bw * (1 << 20) / 1e9,
			Note: "pipelined gets, same buffer (in cache), 127.0.0.1; no latency"}, nil
	}
	return Reference{}, fmt.Errorf("ucx_perftest: no Final line in output: %s", lastLines(out, 3))
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, " | ")
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
