// Command ecxfer-soak runs ecxfer's ucx transport under a long random load
// and checks that nothing is lost or leaked.
//
// The process is the consumer. It starts --producers producer processes
// (this same binary in a hidden role), each a UCX transport over blocks
// filled with a pattern it can recompute, and reads from them with
// --workers goroutines for --duration:
//
//   - most workers post READs of 1 to 880 random blocks, wait, and verify
//     every byte;
//   - a quarter of them ("chaos" workers) release their READs at random
//     moments, in flight or not, and check nothing but the bookkeeping;
//   - every --restart one producer is replaced by a new process under the
//     same name with new bytes (alternately SIGKILL and a clean exit), and
//     re-added with its new metadata; with --restarts N the run ends after
//     the Nth replacement instead of after --duration.
//
// Producer i's region is the i-th kind of --regions, round robin: "alloc"
// (engine-allocated), "mmap" (anonymous caller memory) or "shm" (caller
// memory, a MAP_SHARED mapping of a /dev/shm file, as vLLM's). --direct
// chooses the consumer's path to them (auto, on or off: the engine path).
// The engine path refuses caller memory over shared memory (ecxfer.DirectOff
// says why): with --direct off use --regions alloc, or UCX_TLS=tcp. On
// that path notifications longer than UCX's short path go in fragments
// (README, "Failure behaviour"), which the mapping check below covers.
//
// At the end: every accepted READ is accounted for (done + failed +
// released in flight == accepted), no READ is stuck and no verified block
// is wrong, the transport has no live handle and nothing in flight,
// goroutines and descriptors are back to their baseline, the resident set
// grew by less than --rss-bound MiB after warm-up, the consumer has no
// more shared-memory mappings at the end than after warm-up (one per
// producer and region: a replaced producer's must not stay mapped) and,
// after Deregister, none more than before the transport was made, and
// UCX's own teardown report (operations never flushed, requests never
// returned to their pools), which it prints on this process's standard
// output at UCX_LOG_LEVEL warn or above, has no line. The totals are
// printed; the exit status is 1 if any check failed.
//
// --metrics-addr HOST:PORT serves the consumer's Prometheus metrics
// (package metrics) on http://HOST:PORT/metrics while the soak runs;
// --events logs the consumer's structured events (ecxfer.Event*) to stderr.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/metrics"
	"github.com/ecxfer/ecxfer/nixl/ucx"
)

var (
	directMode  = ecxfer.DirectAuto
	regionKinds = []string{"alloc", "mmap"}
	maxRestarts int64 // end the run after this many replacements (0: --duration)
	notifBytes  int   // notification length (0: a short one), at most maxSoakNotif
	checkMaps   = true
	memProfile  string
	metricsAddr string // serve the consumer's metrics here
	logEvents   bool   // the consumer's structured events to stderr
	largeSegs   bool   // every agent with Config.LargeTCPSegments
)

const (
	roleEnv  = "ECXFER_SOAK_ROLE"
	maxRead  = 880 // blocks in the largest READ
	prodNB   = 1024
	waitSlow = 30 * time.Second // a READ in flight this long is stuck
	// maxSoakNotif is the longest notification the soak's transports
	// take (their default MaxNotif, nixl.DefaultMaxNotif).
	maxSoakNotif = 64 << 10
)

func main() {
	if os.Getenv(roleEnv) == "producer" {
		os.Exit(runProducer())
	}
	duration := flag.Duration("duration", 60*time.Second, "how long to run")
	producers := flag.Int("producers", 2, "producer processes")
	workers := flag.Int("workers", 16, "reading goroutines")
	restart := flag.Duration("restart", 3*time.Second, "replace a producer this often (0: never)")
	bs := flag.Int("block", 5120, "block size in bytes")
	rssBound := flag.Int("rss-bound", 64, "largest RSS growth after warm-up, MiB")
	flag.StringVar(&memProfile, "memprofile", "", "write a heap profile here at the end of the run")
	flag.StringVar(&metricsAddr, "metrics-addr", "", "serve the consumer's Prometheus metrics on http://ADDR/metrics (host:port)")
	flag.BoolVar(&logEvents, "events", false, "log the consumer's structured events (peers, timeouts, engine errors) to stderr")
	direct := flag.String("direct", "auto", "the consumer's path to its producers: auto, on (direct) or off (the engine)")
	regions := flag.String("regions", "alloc,mmap", "producers' region kinds, round robin: alloc, mmap, shm")
	flag.Int64Var(&maxRestarts, "restarts", 0, "end the run after this many producer replacements (0: run for --duration)")
	flag.IntVar(&notifBytes, "notif-bytes", 0, "length of each READ's notification (0: about 8 bytes; vLLM 0.33's are 101)")
	flag.BoolVar(&largeSegs, "large-tcp-segments", false, "every agent with Config.LargeTCPSegments (UCX tcp segments of 256 KiB; matters over tcp, UCX_TLS=tcp)")
	flag.BoolVar(&checkMaps, "check-maps", true, "fail if more shared memory is mapped at the end than after warm-up")
	hangLimit := flag.Duration("hang-limit", 2*time.Minute, "a run still going this long after --duration ended is hung: it prints its goroutines and exits 3")
	flag.Parse()
	var ok bool
	if directMode, ok = map[string]ecxfer.DirectMode{"auto": ecxfer.DirectAuto, "on": ecxfer.DirectOn, "off": ecxfer.DirectOff}[*direct]; !ok {
		fmt.Fprintf(os.Stderr, "ecxfer-soak: --direct %q: auto, on or off\n", *direct)
		os.Exit(2)
	}
	regionKinds = strings.Split(*regions, ",")
	for _, k := range regionKinds {
		if k != "alloc" && k != "mmap" && k != "shm" {
			fmt.Fprintf(os.Stderr, "ecxfer-soak: --regions: unknown kind %q\n", k)
			os.Exit(2)
		}
	}
	if maxRestarts < 0 || (maxRestarts > 0 && *restart <= 0) {
		fmt.Fprintln(os.Stderr, "ecxfer-soak: --restarts needs a positive count and --restart interval")
		os.Exit(2)
	}
	if *duration <= 0 || *restart < 0 || *rssBound < 0 || *hangLimit <= 0 {
		fmt.Fprintln(os.Stderr, "ecxfer-soak: --duration and --hang-limit must be positive, --restart and --rss-bound not negative")
		os.Exit(2)
	}
	if *producers < 1 || *workers < 1 || *bs < 8 {
		fmt.Fprintln(os.Stderr, "ecxfer-soak: need at least one producer, one worker and 8-byte blocks")
		os.Exit(2)
	}
	// Longer notifications are refused by PostRead (the transports' default
	// limit), and the soak counts refusals without failing: it would pass
	// without a READ carrying what was asked for.
	if notifBytes < 0 || notifBytes > maxSoakNotif {
		fmt.Fprintf(os.Stderr, "ecxfer-soak: --notif-bytes %d: want 0 to %d\n", notifBytes, maxSoakNotif)
		os.Exit(2)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "ecxfer-soak: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	watchdog(*duration, *hangLimit)
	if !soak(*duration, *producers, *workers, *restart, *bs, *rssBound) {
		os.Exit(1)
	}
}

// watchdog ends a run that is still going hangLimit after its duration
// (a teardown stuck inside UCX, a worker that never returns): it prints
// every goroutine's stack and exits 3, which closes the producers' stdin,
// so they go too and remove their region files. The limit follows
// --duration, so a long run needs no outside timeout that a longer
// --duration would outgrow.
func watchdog(duration, hangLimit time.Duration) {
	time.AfterFunc(duration+hangLimit, func() {
		fmt.Fprintf(os.Stderr, "ecxfer-soak: still running %v after --duration %v ended: hung; its goroutines:\n", hangLimit, duration)
		_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 2)
		os.Exit(3)
	})
}

// ---------------------------------------------------------------------------
// Producer role.

func runProducer() int {
	// UCX logs to stdout: keep the control channel off it.
	c, err := ctrl.ChildConn()
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak producer:", err)
		return 1
	}
	bs, _ := strconv.Atoi(os.Getenv("ECX_BS"))
	seed, _ := strconv.ParseUint(os.Getenv("ECX_SEED"), 10, 64)
	cfg := ecxfer.Config{AgentName: os.Getenv("ECX_NAME"), BlockSize: bs, NumBlocks: prodNB,
		LargeTCPSegments: os.Getenv("ECX_LARGE_SEGS") == "1"}
	switch os.Getenv("ECX_REGION") {
	case "mmap":
		region, err := unix.Mmap(-1, 0, bs*prodNB, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			return 1
		}
		cfg.Region = region
	case "shm":
		region, err := shmview.MapNewFile(os.Getenv("ECX_SHM_PATH"), bs*prodNB)
		if err != nil {
			_ = c.Send(ctrl.Message{Kind: "error", Strs: map[string]string{"error": err.Error()}})
			return 1
		}
		// However this process ends, short of being killed: a parent that
		// died cannot remove the file any more.
		defer func() { _ = os.Remove(os.Getenv("ECX_SHM_PATH")) }()
		cfg.Region = region
	}
	tr, err := ecxfer.New(cfg)
	if err != nil {
		_ = c.Send(ctrl.Message{Kind: "error", Strs: map[string]string{"error": err.Error()}})
		return 1
	}
	defer tr.Deregister()
	pattern.FillRegion(tr.Region(), seed, bs)
	if err := c.Send(ctrl.Message{Kind: "hello", Name: cfg.AgentName, Metadata: tr.AgentMetadata(), MemDesc: tr.MemDescriptor()}); err != nil {
		return 1
	}
	eof := make(chan struct{})
	go func() {
		for {
			if _, err := c.Recv(); err != nil {
				close(eof)
				return
			}
		}
	}()
	for {
		_ = tr.NewNotifs()
		select {
		case <-eof:
			if err := tr.Deregister(); err != nil {
				return 1
			}
			return 0
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// ---------------------------------------------------------------------------
// Consumer.

type producer struct {
	name   string
	mu     sync.RWMutex // held for writing while the incarnation changes
	seed   uint64
	region string
	child  // the incarnation
}

// child is one producer process.
type child struct {
	cmd           *exec.Cmd
	stdin, stdout io.Closer
	exited        chan struct{}
}

func startProducer(name string, seed uint64, bs int, region string) (child, ctrl.Message, error) {
	exe, err := os.Executable()
	if err != nil {
		return child{}, ctrl.Message{}, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), roleEnv+"=producer", "ECX_NAME="+name,
		"ECX_BS="+strconv.Itoa(bs), "ECX_SEED="+strconv.FormatUint(seed, 10), "ECX_REGION="+region,
		"ECX_SHM_PATH="+shmPath(name), "ECX_LARGE_SEGS="+map[bool]string{true: "1", false: "0"}[largeSegs])
	stdin, stdout, err := ctrl.StartPiped(cmd)
	if err != nil {
		return child{}, ctrl.Message{}, err
	}
	c := child{cmd: cmd, stdin: stdin, stdout: stdout, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.exited) }()
	// A producer that fails reports why and exits; Wait does not close
	// stdout, so the report is read even if the exit is seen first.
	hello, err := ctrl.New(stdout, stdin).Expect("hello")
	if err != nil {
		_ = cmd.Process.Kill()
		<-c.exited
		_ = stdout.Close()
		return child{}, ctrl.Message{}, fmt.Errorf("producer %s: %w", name, err)
	}
	return c, hello, nil
}

// shmPath is the /dev/shm file of a producer's "shm" region.
func shmPath(name string) string { return "/dev/shm/" + name + ".mmap" }

// stop ends the producer process, killing it (hard) or closing its stdin,
// and removes its region file.
func (p *producer) stop(hard bool) {
	defer func() { _ = os.Remove(shmPath(p.name)) }()
	if hard {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
	_ = p.stdin.Close()
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	_ = p.stdout.Close()
}

type totals struct {
	accepted, done, failed, releasedInFlight atomic.Int64
	verifiedBlocks, corrupt, stuck           atomic.Int64
	disconnect, timeout, canceled, otherErr  atomic.Int64
	rejected, refused, badRelease, restarts  atomic.Int64
	bytes                                    atomic.Int64
}

func (t *totals) classify(err error) {
	switch {
	case errors.Is(err, ecxfer.ErrRemoteDisconnect):
		t.disconnect.Add(1)
	case errors.Is(err, ecxfer.ErrTimeout):
		t.timeout.Add(1)
	case errors.Is(err, ecxfer.ErrCanceled):
		t.canceled.Add(1)
	default:
		t.otherErr.Add(1)
		fmt.Fprintf(os.Stderr, "ecxfer-soak: READ failed with an unexpected error: %v\n", err)
	}
}

// sharedMaps counts the process's shared-memory mappings (UCX attaches a
// peer's segments, the direct path maps a peer's region and lifeword
// page), and their size;
// lines are the mappings themselves.
func sharedMaps() (n int, size int64, lines []string) {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return 0, 0, nil
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		// memfd: the producers' lifeword pages the direct path maps, and
		// this process's own word.
		if len(f) < 6 || !(strings.Contains(f[5], "SYSV") || strings.HasPrefix(f[5], "/dev/shm/") || strings.HasPrefix(f[5], "/memfd:")) {
			continue
		}
		var lo, hi int64
		if _, err := fmt.Sscanf(f[0], "%x-%x", &lo, &hi); err == nil {
			n++
			size += hi - lo
			lines = append(lines, line)
		}
	}
	return n, size, lines
}

func rssBytes() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			f := strings.Fields(line)
			if len(f) >= 2 {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// soakRun is one soak: the consumer, its producers and the tallies.
type soakRun struct {
	duration, restart time.Duration
	nwork, chaos      int
	bs, rssBound      int

	cons    *ecxfer.Transport
	prods   []*producer
	seedSeq atomic.Uint64
	tot     totals
	stop    atomic.Bool
	// replacing is held by the restarter while it replaces a producer,
	// and by the monitor while it counts mappings: counts taken in the
	// middle of a replacement would miss the peer in between.
	replacing sync.Mutex
	failures  atomic.Int64 // fail is called from the restarter too
}

func (s *soakRun) fail(format string, args ...any) {
	s.failures.Add(1)
	fmt.Fprintf(os.Stderr, "ecxfer-soak: FAIL: "+format+"\n", args...)
}

// ucxLeakLine matches the lines of UCX's teardown report: operations
// never flushed, objects never returned to their memory pools.
var ucxLeakLine = regexp.MustCompile(`were not flushed|was not returned to mpool|was not released`)

// ucxReport captures this process's standard output, where UCX logs, and
// counts the lines of UCX's teardown report while passing everything on.
type ucxReport struct {
	orig  int      // the real standard output
	out   *os.File // owns orig
	w     *os.File
	done  chan struct{}
	lines atomic.Int64
}

func captureUCX() (*ucxReport, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	orig, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 0)
	if err == nil {
		if err = unix.Dup2(int(w.Fd()), 1); err != nil {
			_ = unix.Close(orig)
		}
	}
	if err != nil {
		_ = r.Close()
		_ = w.Close()
		return nil, err
	}
	// out owns orig and stop closes it, after fd 1 is a copy of it again:
	// closed any earlier, its number could be reused and stop would point
	// fd 1 at whatever took it.
	c := &ucxReport{orig: orig, out: os.NewFile(uintptr(orig), "stdout"), w: w, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		defer r.Close()
		// Lines pass on as they are, however long; a line longer than the
		// buffer goes out in pieces, none of them matched.
		br := bufio.NewReaderSize(r, 64<<10)
		whole := true // the next piece starts a line
		for {
			piece, err := br.ReadSlice('\n')
			if len(piece) > 0 {
				if whole && err != bufio.ErrBufferFull && bytes.Contains(piece, []byte("UCX")) && ucxLeakLine.Match(piece) {
					c.lines.Add(1)
				}
				_, _ = c.out.Write(piece)
				whole = piece[len(piece)-1] == '\n'
			}
			if err != nil && err != bufio.ErrBufferFull {
				return // EOF: stop closed the pipe
			}
		}
	}()
	return c, nil
}

// stop restores standard output and returns how many report lines UCX
// printed.
func (c *ucxReport) stop() int64 {
	// UCX's report lines are warnings, which its stdio stream holds back
	// while stdout is this pipe: out with them before the pipe goes.
	ucx.FlushCStdio()
	_ = unix.Dup2(c.orig, 1)
	_ = c.w.Close()
	<-c.done
	_ = c.out.Close()
	return c.lines.Load()
}

// ucxWarns reports whether UCX prints warnings (its teardown report) at
// the log level in the environment.
func ucxWarns() bool {
	switch strings.ToLower(os.Getenv("UCX_LOG_LEVEL")) {
	case "fatal", "error":
		return false
	}
	return true
}

// samples are the resource figures taken while the workers run.
type samples struct {
	rss0, rssMax, rssEnd int64
	maps0, maps1         int
	mapSize0, mapSize1   int64
	ucxLines             int64 // UCX teardown report lines; -1: not checked
	mapLines0, mapLines1 []string
	// Before the consumer was made and after its Deregister: nothing of
	// the transport or its peers may stay mapped.
	mapsBase, mapsTorn         int
	mapLinesBase, mapLinesTorn []string
}

func soak(duration time.Duration, nprod, nwork int, restart time.Duration, bs, rssBound int) bool {
	// The runtime opens its poller's descriptors on first use and keeps
	// them: open them before the baseline.
	if r, w, err := os.Pipe(); err == nil {
		_ = r.Close()
		_ = w.Close()
	}
	// SIGINT or SIGTERM ends the run early but through the same teardown,
	// so that the producers stop and their /dev/shm files go. Before the
	// baseline: the first Notify starts the signal package's goroutine.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sig)
	var ex *metrics.Exporter
	if metricsAddr != "" {
		var err error
		if ex, err = metrics.Listen(metricsAddr); err != nil {
			fmt.Fprintf(os.Stderr, "ecxfer-soak: --metrics-addr: %v\n", err)
			return false
		}
		fmt.Printf("ecxfer-soak: metrics on http://%s/metrics\n", ex.Addr())
	}
	base := leakcheck.Take()
	var mapsBase int
	var mapLinesBase []string
	mapsBase, _, mapLinesBase = sharedMaps()
	// Captured after the baseline: the pipe and the goroutine are gone
	// again when the leak check runs.
	report, err := captureUCX()
	if err != nil {
		fmt.Fprintf(os.Stderr, "ecxfer-soak: capturing UCX's output: %v\n", err)
		return false
	}
	s := &soakRun{duration: duration, restart: restart, nwork: nwork, chaos: max(1, nwork/4), bs: bs, rssBound: rssBound}
	if err := s.start(nprod); err != nil {
		report.stop()
		fmt.Fprintf(os.Stderr, "ecxfer-soak: %v\n", err)
		return false
	}
	if ex != nil {
		if err := ex.Add(s.cons, metrics.WithPeers(16)); err != nil {
			s.fail("metrics: %v", err)
		}
	}

	start := time.Now()
	interrupted := make(chan os.Signal, 1)
	runDone, watched := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case v := <-sig:
			fmt.Fprintf(os.Stderr, "ecxfer-soak: %v: stopping\n", v)
			s.stop.Store(true)
			interrupted <- v
		case <-runDone:
		}
	}()
	var wg sync.WaitGroup
	for w := 0; w < nwork; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			s.worker(w)
		}(w)
	}
	restartDone := make(chan struct{})
	go func() {
		defer close(restartDone)
		s.restarter(runDone)
	}()
	smp := s.monitor(start)
	if os.Getenv("ECX_SOAK_HANG_FOR_TEST") == "1" {
		select {} // a teardown that never ends (TestSoakHungRunEnds)
	}
	s.stop.Store(true)
	close(runDone)
	<-watched
	end := time.Now()
	wg.Wait()
	<-restartDone
	fmt.Printf("ecxfer-soak: workers and restarter stopped in %v\n", time.Since(end).Round(time.Millisecond))
	smp.rssEnd = rssBytes()
	// The last replaced producer's endpoint closes in the reactor's next
	// turns: give it a moment.
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		smp.maps1, smp.mapSize1, smp.mapLines1 = sharedMaps()
		if smp.maps1 <= smp.maps0 || time.Now().After(deadline) {
			break
		}
	}
	smp.rssMax = max(smp.rssMax, smp.rssEnd)

	st := s.teardown()
	smp.mapsBase, smp.mapLinesBase = mapsBase, mapLinesBase
	smp.mapsTorn, _, smp.mapLinesTorn = sharedMaps()
	// Deregister destroyed the UCX worker, which printed its report.
	smp.ucxLines = report.stop()
	if !ucxWarns() {
		smp.ucxLines = -1
	}
	if ex != nil {
		// Before the leak check: its connections are not the soak's.
		if err := ex.Close(); err != nil {
			s.fail("metrics: %v", err)
		}
	}
	leakErr := base.Wait(10 * time.Second)
	fmt.Printf("ecxfer-soak: torn down in %v\n", time.Since(end).Round(time.Millisecond))
	s.report(time.Since(start), st, smp)
	select {
	case v := <-interrupted:
		// A cut run's figures are not the soak's verdict, but what its
		// teardown left behind is.
		if leakErr != nil {
			fmt.Printf("ecxfer-soak: leak after the interrupted run: %v\n", leakErr)
		}
		fmt.Printf("ecxfer-soak: interrupted by %v after %v\n", v, time.Since(start).Round(time.Millisecond))
		return false
	default:
	}
	s.check(st, smp, leakErr)
	if n := s.failures.Load(); n > 0 {
		fmt.Printf("ecxfer-soak: FAIL (%d checks)\n", n)
		return false
	}
	fmt.Println("ecxfer-soak: ok")
	return true
}

// start creates the consumer and the first incarnation of every producer.
func (s *soakRun) start(nprod int) error {
	cfg := ecxfer.Config{AgentName: fmt.Sprintf("soak-consumer-%d", os.Getpid()), BlockSize: s.bs, NumBlocks: s.nwork * maxRead,
		Direct: directMode, LargeTCPSegments: largeSegs}
	if logEvents {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	cons, err := ecxfer.New(cfg)
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	s.cons = cons
	s.seedSeq.Store(uint64(time.Now().UnixNano()))
	s.prods = make([]*producer, nprod)
	for i := range s.prods {
		p := &producer{name: fmt.Sprintf("soak-producer-%d-%d", os.Getpid(), i), seed: s.seedSeq.Add(1), region: regionKinds[i%len(regionKinds)]}
		var hello ctrl.Message
		p.child, hello, err = startProducer(p.name, p.seed, s.bs, p.region)
		if err == nil {
			if _, err = cons.AddRemotePeer(hello.Metadata, hello.MemDesc); err != nil {
				p.stop(false)
			}
		} else {
			_ = os.Remove(shmPath(p.name)) // it may have got as far as creating it
		}
		if err != nil {
			for _, q := range s.prods[:i] {
				q.stop(false)
			}
			_ = cons.Deregister()
			return err
		}
		s.prods[i] = p
	}
	return nil
}

// restarter replaces one producer every s.restart, alternately killing it
// and letting it exit, and re-adds it under the same name, until the run
// ends (runDone: its duration is up, or it was stopped).
func (s *soakRun) restarter(runDone <-chan struct{}) {
	if s.restart <= 0 {
		return
	}
	tick := time.NewTicker(s.restart)
	defer tick.Stop()
	for k := 0; ; k++ {
		select {
		case <-tick.C:
		case <-runDone:
			return
		}
		if s.stop.Load() {
			return
		}
		p := s.prods[k%len(s.prods)]
		s.replacing.Lock()
		p.stop(k%2 == 0)
		seed := s.seedSeq.Add(1)
		c, hello, err := startProducer(p.name, seed, s.bs, p.region)
		if err != nil {
			s.replacing.Unlock()
			s.fail("restarting %s: %v", p.name, err)
			s.stop.Store(true)
			return
		}
		p.mu.Lock()
		p.child = c
		name, err := s.cons.AddRemotePeer(hello.Metadata, hello.MemDesc)
		if err == nil {
			p.seed = seed
		}
		p.mu.Unlock()
		s.replacing.Unlock()
		if err != nil || name != p.name {
			s.fail("re-adding %s: %q, %v", p.name, name, err)
			s.stop.Store(true)
			return
		}
		if n := s.tot.restarts.Add(1); maxRestarts > 0 && n >= maxRestarts {
			s.stop.Store(true)
			return
		}
	}
}

// monitor prints progress once a second until the run is over and returns
// the resource figures it sampled.
func (s *soakRun) monitor(start time.Time) samples {
	var smp samples
	warm := min(10*time.Second, s.duration/4)
	if maxRestarts > 0 {
		// Warm once every producer has been replaced at least once.
		for s.tot.restarts.Load() < int64(2*len(s.prods)) && !s.stop.Load() && time.Since(start) < s.duration {
			time.Sleep(10 * time.Millisecond)
		}
	} else {
		for time.Since(start) < warm && !s.stop.Load() {
			time.Sleep(10 * time.Millisecond)
		}
	}
	smp.rss0 = rssBytes()
	s.replacing.Lock()
	smp.maps0, smp.mapSize0, smp.mapLines0 = sharedMaps()
	s.replacing.Unlock()
	tot := &s.tot
	for time.Since(start) < s.duration && !s.stop.Load() {
		time.Sleep(min(time.Second, s.duration-time.Since(start)))
		smp.rssMax = max(smp.rssMax, rssBytes())
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		fmt.Printf("ecxfer-soak: %4.0fs accepted %d done %d failed %d released %d restarts %d; RSS %.1f MiB, Go %.1f MiB\n",
			time.Since(start).Seconds(), tot.accepted.Load(), tot.done.Load(), tot.failed.Load(), tot.releasedInFlight.Load(), tot.restarts.Load(),
			float64(rssBytes())/(1<<20), float64(ms.Sys-ms.HeapReleased)/(1<<20))
	}
	if memProfile != "" {
		runtime.GC()
		if out, err := os.Create(memProfile); err == nil {
			_ = pprof.WriteHeapProfile(out)
			_ = out.Close()
		}
	}
	return smp
}

// teardown waits for READs released in flight to be freed, deregisters the
// consumer and stops the producers. It returns the consumer's final stats.
func (s *soakRun) teardown() ecxfer.Stats {
	deadline := time.Now().Add(10 * time.Second)
	st := s.cons.Stats()
	for (st.LiveHandles != 0 || st.InFlight != 0) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
		st = s.cons.Stats()
	}
	if err := s.cons.Deregister(); err != nil {
		s.fail("Deregister: %v", err)
	}
	for _, p := range s.prods {
		p.stop(false)
	}
	return st
}

func (s *soakRun) report(elapsed time.Duration, st ecxfer.Stats, smp samples) {
	tot := &s.tot
	acc, done, failed, rel := tot.accepted.Load(), tot.done.Load(), tot.failed.Load(), tot.releasedInFlight.Load()
	fmt.Printf("\necxfer-soak: %v, %d producers (%d restarts), %d workers (%d releasing at random)\n",
		elapsed.Round(time.Millisecond), len(s.prods), tot.restarts.Load(), s.nwork, s.chaos)
	fmt.Printf("  READs accepted          %d\n", acc)
	fmt.Printf("    done                  %d (%d blocks verified, %.1f GiB)\n", done, tot.verifiedBlocks.Load(), float64(tot.bytes.Load())/(1<<30))
	fmt.Printf("    failed                %d (disconnect %d, timeout %d, canceled %d, other %d)\n", failed,
		tot.disconnect.Load(), tot.timeout.Load(), tot.canceled.Load(), tot.otherErr.Load())
	fmt.Printf("    released in flight    %d\n", rel)
	fmt.Printf("  PostRead rejected       %d\n", tot.rejected.Load())
	fmt.Printf("  reactor                 posted %d done %d failed %d canceled %d, live %d, in flight %d\n",
		st.ReadsPosted, st.ReadsDone, st.ReadsFailed, st.ReadsCanceled, st.LiveHandles, st.InFlight)
	fmt.Printf("  RSS                     %.1f MiB after warm-up, %.1f MiB peak, %.1f MiB at the end (bound +%d MiB)\n",
		float64(smp.rss0)/(1<<20), float64(smp.rssMax)/(1<<20), float64(smp.rssEnd)/(1<<20), s.rssBound)
	fmt.Printf("  shared mappings         %d (%.1f MiB) after warm-up, %d (%.1f MiB) at the end; %d after Deregister, %d before the transport\n",
		smp.maps0, float64(smp.mapSize0)/(1<<20), smp.maps1, float64(smp.mapSize1)/(1<<20), smp.mapsTorn, smp.mapsBase)
	if smp.ucxLines < 0 {
		fmt.Printf("  UCX teardown report     not checked (UCX_LOG_LEVEL=%s hides it)\n", os.Getenv("UCX_LOG_LEVEL"))
	} else {
		fmt.Printf("  UCX teardown report     %d lines\n", smp.ucxLines)
	}
}

// check applies the soak's pass criteria.
func (s *soakRun) check(st ecxfer.Stats, smp samples, leakErr error) {
	tot := &s.tot
	acc, done, failed, rel := tot.accepted.Load(), tot.done.Load(), tot.failed.Load(), tot.releasedInFlight.Load()
	if done+failed+rel != acc {
		s.fail("accounting: done %d + failed %d + released %d != accepted %d", done, failed, rel, acc)
	}
	if n := tot.stuck.Load(); n > 0 {
		s.fail("%d READs in flight after %v", n, waitSlow)
	}
	if n := tot.corrupt.Load(); n > 0 {
		s.fail("%d verified blocks held the wrong bytes", n)
	}
	if n := tot.otherErr.Load(); n > 0 {
		s.fail("%d READs failed with an unexpected error", n)
	}
	if n := tot.timeout.Load(); n > 0 {
		// XferTimeout (20 s) ends a READ that hangs before the check
		// for stuck READs (waitSlow) could see it: a READ of a killed
		// producer must fail with ErrRemoteDisconnect, not hang.
		s.fail("%d READs hung until XferTimeout", n)
	}
	if n := tot.refused.Load(); n > 0 {
		s.fail("PostRead refused %d READs with an error other than ErrBusy", n)
	}
	if posted := int64(st.ReadsPosted); posted != acc || st.ReadsPosted != st.ReadsDone+st.ReadsFailed+st.ReadsCanceled {
		s.fail("the reactor counts %d posted (%d done, %d failed, %d canceled), the workers %d accepted",
			st.ReadsPosted, st.ReadsDone, st.ReadsFailed, st.ReadsCanceled, acc)
	}
	if n := tot.badRelease.Load(); n > 0 {
		s.fail("%d releases failed", n)
	}
	if st.LiveHandles != 0 || st.InFlight != 0 {
		s.fail("%d live handles, %d in flight at the end", st.LiveHandles, st.InFlight)
	}
	if int64(st.ReadsDone) < done || int64(st.ReadsDone) > done+rel {
		s.fail("the reactor counts %d done, the workers %d (+%d released in flight)", st.ReadsDone, done, rel)
	}
	if acc == 0 || done == 0 {
		s.fail("nothing was read")
	}
	if growth := smp.rssMax - smp.rss0; growth > int64(s.rssBound)<<20 {
		s.fail("RSS grew by %.1f MiB after warm-up (bound %d MiB)", float64(growth)/(1<<20), s.rssBound)
	}
	if smp.ucxLines > 0 {
		s.fail("UCX's teardown report has %d lines: operations or requests it never got back", smp.ucxLines)
	}
	if checkMaps && smp.maps1 > smp.maps0 {
		s.fail("%d shared mappings at the end, %d after warm-up: replaced producers stay mapped\nafter warm-up:\n  %s\nat the end:\n  %s",
			smp.maps1, smp.maps0, strings.Join(smp.mapLines0, "\n  "), strings.Join(smp.mapLines1, "\n  "))
	}
	if smp.mapsTorn > smp.mapsBase {
		s.fail("%d shared mappings after Deregister, %d before the transport was made: the transport left memory mapped\nbefore:\n  %s\nafter Deregister:\n  %s",
			smp.mapsTorn, smp.mapsBase, strings.Join(smp.mapLinesBase, "\n  "), strings.Join(smp.mapLinesTorn, "\n  "))
	}
	if maxRestarts > 0 && tot.restarts.Load() < maxRestarts {
		s.fail("%d of %d restarts in %v", tot.restarts.Load(), maxRestarts, s.duration)
	}
	if leakErr != nil {
		s.fail("leak: %v", leakErr)
	}
}

// worker posts READs of random blocks of random producers until the run
// stops. A chaos worker releases most of its READs at random moments.
func (s *soakRun) worker(w int) {
	rng := rand.New(rand.NewSource(int64(w) + time.Now().UnixNano()))
	notif := []byte(fmt.Sprintf("soak-%d", w))
	if notifBytes > 0 {
		notif = []byte(fmt.Sprintf("soak-%d:%0*x", w, notifBytes, w))[:notifBytes]
	}
	chaos := w < s.chaos
	for !s.stop.Load() {
		p := s.prods[rng.Intn(len(s.prods))]
		n := 1 + rng.Intn(maxRead)
		if rng.Intn(4) == 0 {
			n = maxRead
		}
		local := make([]int, n)
		for i := range local {
			local[i] = w*maxRead + i
		}
		remote := rng.Perm(prodNB)[:n]
		var msg []byte
		if rng.Intn(2) == 0 {
			msg = notif
		}
		p.mu.RLock()
		seed := p.seed
		h, err := s.cons.PostRead(local, p.name, remote, msg)
		p.mu.RUnlock()
		if err != nil {
			s.tot.rejected.Add(1)
			if !errors.Is(err, ecxfer.ErrBusy) {
				// The peers are replaced in place and READs of dead ones
				// are accepted (they fail later): nothing else may refuse.
				s.tot.refused.Add(1)
				fmt.Fprintf(os.Stderr, "ecxfer-soak: PostRead: %v\n", err)
			}
			time.Sleep(time.Millisecond)
			continue
		}
		s.tot.accepted.Add(1)
		if chaos && rng.Intn(3) > 0 {
			s.releaseAtRandom(h, rng)
			continue
		}
		s.waitAndVerify(h, local, remote, seed, !chaos)
	}
}

// releaseAtRandom releases h at a random moment, in flight or not, and
// tallies the state it was in.
func (s *soakRun) releaseAtRandom(h ecxfer.Handle, rng *rand.Rand) {
	if d := rng.Intn(3); d > 0 {
		time.Sleep(time.Duration(rng.Intn(2000*d)) * time.Microsecond)
	}
	st, serr := s.cons.CheckXferState(h)
	switch st {
	case ecxfer.StateProc:
		s.tot.releasedInFlight.Add(1)
	case ecxfer.StateDone:
		s.tot.done.Add(1)
	default:
		s.tot.failed.Add(1)
		s.tot.classify(serr)
	}
	s.release(h)
}

// waitAndVerify waits for h, tallies its outcome and, when verify is set,
// checks every byte it read. A chaos worker's canceled gets may still land
// later in its own blocks, so only the others verify.
func (s *soakRun) waitAndVerify(h ecxfer.Handle, local, remote []int, seed uint64, verify bool) {
	ctx, cancel := context.WithTimeout(context.Background(), waitSlow)
	err := s.cons.Wait(ctx, h)
	cancel()
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		s.tot.stuck.Add(1)
		s.tot.releasedInFlight.Add(1)
	case err != nil:
		s.tot.failed.Add(1)
		s.tot.classify(err)
	default:
		s.tot.done.Add(1)
		s.tot.bytes.Add(int64(len(local) * s.bs))
		if verify {
			region, bs := s.cons.Region(), s.bs
			for i := range local {
				b := region[local[i]*bs : (local[i]+1)*bs]
				if ok, _ := pattern.Check(b, seed, remote[i]); !ok {
					s.tot.corrupt.Add(1)
				}
			}
			s.tot.verifiedBlocks.Add(int64(len(local)))
		}
	}
	s.release(h)
}

func (s *soakRun) release(h ecxfer.Handle) {
	if err := s.cons.ReleaseXferHandle(h); err != nil {
		s.tot.badRelease.Add(1)
		fmt.Fprintf(os.Stderr, "ecxfer-soak: release: %v\n", err)
	}
}
