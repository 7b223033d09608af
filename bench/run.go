package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/internal/procinfo"
)

// readLimit is how long one READ may stay in flight before the run fails.
const readLimit = 10 * time.Second

// cell is one workload configuration; with a mode it makes a table row.
type cell struct {
	workload   string
	bs         int
	blocks     int // per READ; 0: 1..FaninMaxBlocks at random (fanin)
	contiguous bool
	subs       int
	notifMsg   bool // READs carry a notification
}

// cellsFor lists the cells of one block size and mode.
func cellsFor(cfg *Config, bs int, mode string) []cell {
	var cs []cell
	for _, w := range AllWorkloads {
		if !slices.Contains(cfg.Workloads, w) {
			continue
		}
		switch w {
		case "latency":
			cs = append(cs, cell{workload: w, bs: bs, blocks: 1, subs: 1})
		case "image":
			cs = append(cs, cell{workload: w, bs: bs, blocks: ImageBlocks, contiguous: true, subs: 1, notifMsg: true},
				cell{workload: w, bs: bs, blocks: ImageBlocks, subs: 1, notifMsg: true})
		case "fanin":
			if bs != SmallBlock {
				continue
			}
			for _, n := range FaninSubmitters {
				if mode == "raw" && n > 1 {
					continue // raw has no concurrency by definition
				}
				cs = append(cs, cell{workload: w, bs: bs, subs: n, notifMsg: true})
			}
		case "notif":
			if bs != SmallBlock || (cfg.Connect != "" && !cfg.sharedClock) {
				continue // another host's CLOCK_MONOTONIC is not ours
			}
			cs = append(cs, cell{workload: w, bs: bs, blocks: 1, subs: 1, notifMsg: true})
		}
	}
	return cs
}

var blockSizes = []int{SmallBlock, LargeBlock}

// session is one run: the control connection to the producer and the
// report being filled.
type session struct {
	cfg     Config
	send    func(ctrl.Message) error
	msgs    chan ctrl.Message
	recvErr error // set before msgs is closed
	rep     *Report
	total   int
	doneN   int
	start   time.Time
	// ctx ends the run: a pass in progress stops its submitters when it
	// is done (nil: never).
	ctx context.Context
	// peer is the producer process at --connect when it runs on this
	// machine's kernel, in another process: its CPU time is the run's
	// own, not a disturbance (producerCPU).
	peer struct {
		pid        int64
		cpu0, cpu1 int64 // ns: at its first hello, at its last bye
	}
}

// Run measures every configured cell and reference and returns the report.
// It fails on the first error, including any byte that does not verify.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := newSession(cfg)
	s.ctx = ctx
	// With --connect, notif runs only if the producer shares this clock,
	// which only the producer can say.
	if s.total == 0 && (cfg.Connect == "" || !slices.Contains(cfg.Workloads, "notif")) {
		return nil, fmt.Errorf("%w: nothing to run", ErrUsage)
	}
	cpu0 := sampleCPU()
	stop, err := s.startProducer(ctx)
	if err != nil {
		return nil, err
	}
	if s.total == 0 {
		_ = stop()
		return nil, fmt.Errorf("%w: nothing to run: notif needs a producer on this machine's clock", ErrUsage)
	}
	stopProf, err := startProfiles(&cfg)
	if err != nil {
		_ = stop()
		return nil, err
	}
	err = s.runAll(ctx)
	if perr := stopProf(); err == nil && perr != nil {
		err = perr
	}
	if serr := stop(); err == nil && serr != nil {
		err = serr
	}
	s.clearProgress()
	if ctx.Err() != nil {
		// Interrupted: whatever the cell in progress then reported (the
		// context's end, or, after a Ctrl-C to the whole process group,
		// a producer child that went), the run was interrupted.
		err = fmt.Errorf("bench: interrupted: %w", ctx.Err())
	}
	if err != nil {
		return s.rep, err
	}
	if cfg.References {
		s.references(ctx)
		if ctx.Err() != nil {
			// A reference cut short is a note, not a measurement: the run
			// as a whole did not finish.
			return s.rep, fmt.Errorf("bench: interrupted during the references: %w", ctx.Err())
		}
	}
	s.addNotes()
	sortResults(s.rep.Results)
	s.noteDisturbance(cpu0)
	return s.rep, writeOutputs(&cfg, s.rep)
}

// newSession starts a report with the machine and run settings and counts
// the cells to run.
func newSession(cfg Config) *session {
	m := machineInfo()
	m.Backend, m.Idle = cfg.Backend, cfg.Reactor.Idle.String()
	m.ReactorCPU = -1
	if cfg.Reactor.PinCPU {
		m.ReactorCPU = cfg.Reactor.CPU
	}
	m.Duration, m.Warmup, m.Rounds = cfg.Duration.String(), cfg.Warmup.String(), cfg.Rounds
	s := &session{cfg: cfg, start: time.Now()}
	m.Started = s.start.UTC().Format(time.RFC3339)
	s.rep = &Report{Machine: m}
	s.total = countCells(&cfg)
	return s
}

// countCells counts the cells a run of cfg measures, over its rounds.
func countCells(cfg *Config) int {
	n := 0
	for _, bs := range blockSizes {
		for _, mode := range cfg.Modes {
			n += len(cellsFor(cfg, bs, mode))
		}
	}
	return n * cfg.Rounds
}

// addNotes says in the report how the figures were taken.
func (s *session) addNotes() {
	cfg := &s.cfg
	callers := "callers poll the READ's state (256 checks back to back, then yielding between checks)"
	if cfg.Wait == "block" {
		callers = "reactor and direct callers block in Transport.Wait; locked and raw callers poll the READ's state (256 checks back to back, then yielding between checks)"
		if spin := cfg.Reactor.WaitSpin; spin > 0 {
			callers = fmt.Sprintf("reactor and direct callers block in Transport.Wait (checking for %v before they sleep); locked and raw callers poll the READ's state (256 checks back to back, then yielding between checks)", spin)
		}
	}
	s.rep.Notes = append(s.rep.Notes,
		"latency READs carry no notification; image, fanin and notif READs carry one (as vLLM's do)",
		fmt.Sprintf("locked: the producer takes notifications under its lock every %v (an engine step), its engine progressed as messages arrive (NIXL's progress thread); reactor, direct and raw producers poll back to back during notif", stepInterval),
		callers+"; p50/p99/p99.9 are post→DONE (notif: post → producer sees the notification), from at least 100 and 1,000 samples (else -)",
		fmt.Sprintf("verified: READ 0 and every %dth of each submitter, all blocks (their CPU time excluded from seconds)", VerifyEvery),
		"notif allocs/read include decoding the control message that brings the producer's timestamp")
	if slices.Contains(cfg.Modes, "reactor") {
		if cfg.Reactor.ReactorOnly {
			s.rep.Notes = append(s.rep.Notes, "reactor: -reactor-only: the reactor thread alone drives the engine; callers never step in")
		} else {
			s.rep.Notes = append(s.rep.Notes, "reactor: a caller polling one READ alone takes the engine's steps itself while the reactor thread stands aside (-reactor-only turns it off)")
		}
	}
	if cfg.LargeTCPSegments {
		s.rep.Notes = append(s.rep.Notes, "-large-tcp-segments: UCX tcp segments of 256 KiB at both ends, gathered READs answered in 252 KiB messages (Config.LargeTCPSegments)")
	}
	if cfg.Producer != "" {
		s.rep.Notes = append(s.rep.Notes, fmt.Sprintf(
			"producer: every reactor, locked and raw row read from a %s producer (--producer); direct rows from their own", cfg.Producer))
	}
	if cfg.Rounds > 1 {
		s.rep.Notes = append(s.rep.Notes, fmt.Sprintf(
			"each row: %d rounds of %v after a %v warm-up each, the modes in turn, in reverse order every other round", cfg.Rounds, cfg.Duration/time.Duration(cfg.Rounds), cfg.Warmup))
	}
	if slices.ContainsFunc(cfg.Workloads, func(w string) bool { return w != "latency" }) {
		s.rep.Notes = append(s.rep.Notes,
			"DONE: reactor and direct READs are DONE once their data has landed, and the notification is sent right after; "+
				"locked and raw READs are DONE once the engine's send of the notification has also completed (NIXL's order)")
	}
	if slices.Contains(cfg.Workloads, "notif") && (cfg.Connect == "" || cfg.sharedClock) {
		s.rep.Notes = append(s.rep.Notes, fmt.Sprintf(
			"notif: each READ is posted at a random point of the producer's %v step, so locked's latency is not tied to its phase; reads/s and GB/s include that wait and a control round trip, so are not shown", stepInterval))
		var early []string
		for _, r := range s.rep.Results {
			if r.Workload == "notif" && r.Early > 0 {
				early = append(early, fmt.Sprintf("%s %d of %d", r.Mode, r.Early, r.Reads))
			}
		}
		if len(early) > 0 {
			s.rep.Notes = append(s.rep.Notes, "notif: seen by the producer before the reader saw DONE: "+strings.Join(early, ", "))
		}
	}
	if cfg.Backend == "loopback" {
		s.rep.Notes = append(s.rep.Notes, "loopback: producer in this process; its allocations count in allocs/read")
	}
	if cfg.Connect != "" && slices.Contains(cfg.Workloads, "notif") {
		if cfg.sharedClock {
			s.rep.Notes = append(s.rep.Notes, "notif: the producer at --connect runs on this machine's kernel (same boot id and time namespace), so both read one CLOCK_MONOTONIC")
		} else {
			s.rep.Notes = append(s.rep.Notes, "notif skipped: the producer is on another host, CLOCK_MONOTONIC is not shared")
		}
	}
}

// notePeerCPU takes the producer's pid and CPU time from its hello (first)
// or bye: a producer at --connect that says it runs on this machine's
// kernel (its clock's id is this process's), in another process, uses the
// machine's CPU for the run (make bench-hosts: two network namespaces).
// Producers of older builds say nothing, and count as other processes.
func (s *session) notePeerCPU(m ctrl.Message, hello bool) {
	pid, cpu := m.Ints["pid"], m.Ints["cpu_ns"]
	if s.cfg.Connect == "" || pid <= 0 || pid == int64(os.Getpid()) {
		return
	}
	switch {
	case hello && s.peer.pid == 0:
		if id := clockID(); id == "" || m.Strs["clock"] != id {
			return
		}
		s.peer.pid, s.peer.cpu0, s.peer.cpu1 = pid, cpu, cpu
	case pid == s.peer.pid && cpu > s.peer.cpu1:
		s.peer.cpu1 = cpu
	}
}

// noteDisturbance records the run's wall time and the CPU time other
// processes took since cpu0 (the producer at --connect on this kernel is
// not one of them), and flags the report when that was more than 5% of
// the machine.
func (s *session) noteDisturbance(cpu0 cpuSample) {
	m := &s.rep.Machine
	m.WallSecs = time.Since(s.start).Seconds()
	cpu1 := sampleCPU()
	m.ProducerCPU = float64(s.peer.cpu1-s.peer.cpu0) / 1e9
	other := max(0, (cpu1.busy-cpu0.busy)-(cpu1.ours-cpu0.ours)-m.ProducerCPU)
	m.OtherCPU = other
	if share := other / (m.WallSecs * float64(m.Cores)); share > 0.05 {
		s.rep.Notes = append(s.rep.Notes, fmt.Sprintf("DISTURBED: other processes used %.1f CPU-seconds during the run (%.0f%% of the machine); rerun on a quiet machine", other, 100*share))
	}
}

// writeOutputs writes the report's JSON and SVG files, where configured.
func writeOutputs(cfg *Config, rep *Report) error {
	if cfg.JSONFile != "" {
		if err := writeFile(cfg.JSONFile, func(w io.Writer) error { return WriteJSON(w, rep) }); err != nil {
			return err
		}
	}
	if cfg.SVGFile != "" {
		if err := writeFile(cfg.SVGFile, func(w io.Writer) error { return WriteSVG(w, rep) }); err != nil {
			return err
		}
	}
	return nil
}

func sortResults(rs []Result) {
	idx := func(list []string, v string) int { return slices.Index(list, v) }
	slices.SortStableFunc(rs, func(a, b Result) int {
		switch {
		case a.Workload != b.Workload:
			return idx(AllWorkloads, a.Workload) - idx(AllWorkloads, b.Workload)
		case a.BlockSize != b.BlockSize:
			return a.BlockSize - b.BlockSize
		case a.Contiguous != b.Contiguous:
			if a.Contiguous {
				return -1
			}
			return 1
		case a.Submitters != b.Submitters:
			return a.Submitters - b.Submitters
		}
		return idx(AllModes, a.Mode) - idx(AllModes, b.Mode)
	})
}

// startProducer connects to or starts the producer and returns how to stop
// it.
func (s *session) startProducer(ctx context.Context) (func() error, error) {
	var c *ctrl.Conn
	var stop func() error
	var err error
	switch {
	case s.cfg.Connect != "":
		c, stop, err = dialProducer(ctx, s.cfg.Connect)
	case s.cfg.Backend == "loopback":
		c, stop = inProcessProducer()
	default:
		c, stop, err = forkProducer(s.cfg.ProducerExe, s.cfg.Backend)
	}
	if err != nil {
		return nil, err
	}
	s.attach(c)
	// Asked only for notif: a producer from before the question drops the
	// connection at a message it does not know.
	if s.cfg.Connect != "" && slices.Contains(s.cfg.Workloads, "notif") {
		shared, err := s.clockShared()
		if err != nil {
			_ = stop()
			return nil, err
		}
		if shared {
			s.cfg.sharedClock = true
			s.total = countCells(&s.cfg)
		}
	}
	return stop, nil
}

// clockShared asks the producer for its clock's identity (clockID) and
// compares it with this process's.
func (s *session) clockShared() (bool, error) {
	m, err := s.request(ctrl.Message{Kind: "clock"}, "clock")
	if err != nil {
		return false, err
	}
	mine := clockID()
	return mine != "" && m.Strs["id"] == mine, nil
}

// clockID names the CLOCK_MONOTONIC this process reads: the kernel's boot
// id and the time namespace ("" when either cannot be read). Two processes
// with the same id read the same clock, whatever their network namespaces.
func clockID() string {
	boot, err := procinfo.BootID(64)
	if err != nil {
		return ""
	}
	timeNS, err := procinfo.NSInode("time")
	if err != nil {
		return ""
	}
	return fmt.Sprintf("%s/%d", boot, timeNS)
}

// dialProducer connects to a producer served elsewhere (ecxfer-bench serve).
func dialProducer(ctx context.Context, addr string) (*ctrl.Conn, func() error, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	nc, err := d.DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to the producer: %w", err)
	}
	return ctrl.New(nc, nc), nc.Close, nil
}

// inProcessProducer serves a loopback producer on a goroutine of this
// process: loopback agents only reach each other within one process.
func inProcessProducer() (*ctrl.Conn, func() error) {
	cr, cw := io.Pipe() // consumer -> producer
	pr, pw := io.Pipe() // producer -> consumer
	done := make(chan error, 1)
	go func() {
		err := Serve(ctrl.New(cr, pw), "loopback")
		_ = pw.Close()
		done <- err
	}()
	return ctrl.New(pr, cw), func() error {
		_ = cw.Close()
		return <-done
	}
}

// forkProducer starts exe (this executable when empty) in the producer role
// with the control channel on descriptors 3 and 4.
func forkProducer(exe, backend string) (*ctrl.Conn, func() error, error) {
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, nil, fmt.Errorf("finding this executable: %w", err)
		}
	}
	cr, cw, err := os.Pipe()
	if err != nil {
		return nil, nil, err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		_ = cr.Close()
		_ = cw.Close()
		return nil, nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), RoleEnv+"=producer", BackendEnv+"="+backend)
	cmd.ExtraFiles = []*os.File{cr, pw}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	err = cmd.Start()
	_ = cr.Close()
	_ = pw.Close()
	if err != nil {
		_ = cw.Close()
		_ = pr.Close()
		return nil, nil, fmt.Errorf("starting the producer child: %w", err)
	}
	stop := func() error {
		_ = cw.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		var err error
		select {
		case err = <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			err = fmt.Errorf("producer child did not exit: %v", <-done)
		}
		_ = pr.Close()
		if err != nil {
			return fmt.Errorf("producer child: %w", err)
		}
		return nil
	}
	return ctrl.New(pr, cw), stop, nil
}

// attach makes c the session's control channel: sends are serialized and
// a goroutine forwards what the producer sends to s.msgs.
func (s *session) attach(c *ctrl.Conn) {
	var sendMu sync.Mutex
	s.send = func(m ctrl.Message) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return c.Send(m)
	}
	s.msgs = make(chan ctrl.Message, 64)
	go func() {
		for {
			m, err := c.Recv()
			if err != nil {
				s.recvErr = err
				close(s.msgs)
				return
			}
			s.msgs <- m
		}
	}()
}

// expect waits for a message of kind from the producer.
func (s *session) expect(kind string, timeout time.Duration) (ctrl.Message, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case m, ok := <-s.msgs:
		if !ok {
			return m, fmt.Errorf("producer connection lost: %v", s.recvErr)
		}
		if m.Kind == "error" {
			return m, fmt.Errorf("producer: %s", m.Strs["error"])
		}
		if m.Kind != kind {
			return m, fmt.Errorf("producer sent %q, want %q", m.Kind, kind)
		}
		return m, nil
	case <-t.C:
		return ctrl.Message{}, fmt.Errorf("producer: no %q within %v", kind, timeout)
	}
}

func (s *session) request(m ctrl.Message, reply string) (ctrl.Message, error) {
	if err := s.send(m); err != nil {
		return ctrl.Message{}, fmt.Errorf("producer: %w", err)
	}
	return s.expect(reply, 60*time.Second)
}

// runAll runs every cell in Config.Rounds rounds, the modes in their order
// in even rounds and reversed in odd ones, and merges each row's rounds.
func (s *session) runAll(ctx context.Context) error {
	for round := range s.cfg.Rounds {
		modes := slices.Clone(s.cfg.Modes)
		if round%2 == 1 {
			slices.Reverse(modes)
		}
		for bi, bs := range blockSizes {
			for _, mode := range modes {
				cells := cellsFor(&s.cfg, bs, mode)
				if len(cells) == 0 {
					continue
				}
				seed := int64(1000 + 10*bi + slices.Index(s.cfg.Modes, mode))
				if err := s.runMode(ctx, mode, bs, seed, round, cells); err != nil {
					// The rows measured so far are printed (the caller does
					// on error), merged and in order like a whole run's.
					s.rep.Results = mergeRounds(s.rep.Results)
					sortResults(s.rep.Results)
					return fmt.Errorf("%s, %d B blocks: %w", mode, bs, err)
				}
			}
		}
	}
	s.rep.Results = mergeRounds(s.rep.Results)
	return nil
}

func (s *session) runMode(ctx context.Context, mode string, bs int, seed int64, round int, cells []cell) error {
	s.progress(fmt.Sprintf("setting up %s, %d B blocks", mode, bs))
	kind := s.cfg.producerFor(mode)
	strs := map[string]string{"mode": mode}
	if kind != mode {
		strs["producer"] = kind
	}
	h, err := s.request(ctrl.Message{Kind: "setup", Strs: strs,
		Ints: map[string]int64{"block": int64(bs), "blocks": int64(s.cfg.remoteBlocks(bs)), "seed": seed,
			"idle": int64(s.cfg.ProducerIdle), "batch": int64(s.cfg.Reactor.BatchSize),
			"large_tcp_segments": b2i(s.cfg.LargeTCPSegments)}}, "hello")
	if err != nil {
		return err
	}
	s.notePeerCPU(h, true)
	if h.Name != kind {
		// A producer of an older build ignores "producer" and opens the
		// mode's own: the rows would not be what --producer says.
		_, _ = s.request(ctrl.Message{Kind: "teardown"}, "bye")
		return fmt.Errorf("asked the producer for a %s producer and it opened a %q one (a build without --producer?)", kind, h.Name)
	}
	opts := ecxfer.Config{Reactor: s.cfg.Reactor, CopyWorkers: s.cfg.CopyWorkers, InlineBytes: s.cfg.InlineBytes,
		LargeTCPSegments: s.cfg.LargeTCPSegments}
	d, err := openDriver(mode, s.cfg.Backend, bs, opts, s.cfg.Wait == "block", helloMsg{md: h.Metadata, memDesc: h.MemDesc})
	if err != nil {
		_, _ = s.request(ctrl.Message{Kind: "teardown"}, "bye")
		return err
	}
	var runErr error
	for _, c := range cells {
		if err := ctx.Err(); err != nil {
			runErr = err
			break
		}
		s.doneN++
		s.progress(fmt.Sprintf("[%d/%d] %s %s %d B %s", s.doneN, s.total, c.workload, mode, bs, cellDesc(c)))
		r, err := s.runCell(d, mode, c, uint64(seed), round)
		if err != nil {
			runErr = fmt.Errorf("%s %s: %w", c.workload, cellDesc(c), err)
			break
		}
		s.rep.Results = append(s.rep.Results, r)
	}
	cerr := d.close()
	bye, err := s.request(ctrl.Message{Kind: "teardown"}, "bye")
	if err == nil {
		s.notePeerCPU(bye, false)
	} else if runErr == nil {
		runErr = err
	}
	if runErr == nil && cerr != nil {
		runErr = fmt.Errorf("closing the consumer: %w", cerr)
	}
	return runErr
}

func cellDesc(c cell) string {
	switch {
	case c.workload == "fanin":
		return fmt.Sprintf("%d submitters", c.subs)
	case c.blocks > 1 && c.contiguous:
		return fmt.Sprintf("%d blocks contiguous", c.blocks)
	case c.blocks > 1:
		return fmt.Sprintf("%d blocks scattered", c.blocks)
	}
	return "1 block"
}

// subStats is one submitter's tally for one pass.
type subStats struct {
	lat    []time.Duration
	reads  int64
	blocks int64
	verify time.Duration // CPU time of the checks (cpuSince)
	early  int64         // notif: seen before the reader saw DONE
}

// runCell measures one round of a cell: Duration/Rounds after a warm-up.
func (s *session) runCell(d driver, mode string, c cell, seed uint64, round int) (Result, error) {
	if c.workload == "notif" {
		if _, err := s.request(ctrl.Message{Kind: "timing", Ints: map[string]int64{"on": 1}}, "ok"); err != nil {
			return Result{}, err
		}
		defer func() { _, _ = s.request(ctrl.Message{Kind: "timing", Ints: map[string]int64{"on": 0}}, "ok") }()
	}
	if s.cfg.Warmup > 0 {
		if _, _, err := s.pass(d, c, seed, s.cfg.Warmup, 0, nil); err != nil {
			return Result{}, fmt.Errorf("warmup: %w", err)
		}
	}
	runtime.GC()
	var ms [2]runtime.MemStats
	subs, wall, err := s.pass(d, c, seed, s.cfg.Duration/time.Duration(s.cfg.Rounds), int64(1+round), &ms)
	m0, m1 := &ms[0], &ms[1]
	if err != nil {
		return Result{}, err
	}
	r := Result{Workload: c.workload, Mode: mode, Backend: s.cfg.Backend, BlockSize: c.bs,
		Contiguous: c.contiguous, Submitters: c.subs}
	var lat []time.Duration
	var blocks int64
	var verify time.Duration
	for _, st := range subs {
		r.Reads += st.reads
		blocks += st.blocks
		verify += st.verify
		r.Early += st.early
		lat = append(lat, st.lat...)
	}
	if r.Reads == 0 {
		return r, errors.New("no READ completed")
	}
	// The checks' CPU time came out of the submitters' share of the
	// machine: with more submitters than Ps they all ran all along, and
	// the checks took verify/Ps of the wall time, else verify/submitters.
	// The same for every mode (it once gave the reactor's submitters one
	// P less, for its thread, so twice the deduction of the others' with
	// 2 Ps: an estimate that favoured the mode under test).
	ps := runtime.GOMAXPROCS(0)
	r.Seconds = (wall - verify/time.Duration(min(len(subs), ps))).Seconds()
	r.ReadsPerSec = float64(r.Reads) / r.Seconds
	r.GBPerSec = float64(blocks) * float64(c.bs) / r.Seconds / 1e9
	r.BlocksPerRead = float64(blocks) / float64(r.Reads)
	if c.blocks > 0 {
		r.BlocksPerRead = float64(c.blocks)
	}
	r.AllocsPerRead = float64(m1.Mallocs-m0.Mallocs) / float64(r.Reads)
	summarize(&r, lat)
	return r, nil
}

// pass runs the cell's submitters for dur and returns their tallies and the
// wall time. Each submitter's random source, index plan and buffers are
// made before the clock starts and, with ms, before the allocation count
// is taken in ms[0] (ms[1] after the submitters have stopped).
func (s *session) pass(d driver, c cell, seed uint64, dur time.Duration, passNo int64, ms *[2]runtime.MemStats) ([]*subStats, time.Duration, error) {
	subs := make([]*subStats, c.subs)
	preps := make([]subPrep, c.subs)
	est := max(1024, (1<<17)/c.subs)
	for g := range subs {
		subs[g] = &subStats{lat: make([]time.Duration, 0, est)}
		rng := rand.New(rand.NewSource(int64(seed)*1000 + int64(g) + passNo*7777))
		preps[g] = subPrep{rng: rng, plan: newIndexPlan(c, g, s.cfg.remoteBlocks(c.bs), rng),
			local: make([]int, 0, max(c.blocks, FaninMaxBlocks)), remote: make([]int, 0, max(c.blocks, FaninMaxBlocks))}
	}
	var stop atomic.Bool
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	if ms != nil {
		runtime.ReadMemStats(&ms[0])
	}
	if s.ctx != nil {
		// An interrupt ends the pass at once, not when its time is up (a
		// cell may last an hour).
		defer context.AfterFunc(s.ctx, func() { stop.Store(true) })()
	}
	start := time.Now()
	end := start.Add(dur)
	for g := range subs {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			if err := s.submitter(d, c, g, seed, &preps[g], end, &stop, subs[g]); err != nil {
				errOnce.Do(func() { firstErr = fmt.Errorf("submitter %d: %w", g, err) })
				stop.Store(true)
			}
		}(g)
	}
	wg.Wait()
	wall := time.Since(start)
	if ms != nil {
		runtime.ReadMemStats(&ms[1])
	}
	if firstErr == nil && s.ctx != nil && s.ctx.Err() != nil {
		firstErr = s.ctx.Err() // cut short: not a measurement
	}
	return subs, wall, firstErr
}

// subPrep is what a submitter needs that pass makes before the clock
// starts.
type subPrep struct {
	rng           *rand.Rand
	plan          *indexPlan
	local, remote []int
}

// scatterSets is how many random index sets the scattered image READs
// cycle through: together they touch most of the producer's region
// (64 x 880 blocks of its 26,214 at 5,120 B), not a few that stay in the
// last-level cache between READs.
const scatterSets = 64

// indexPlan builds the index lists of a cell's READs.
type indexPlan struct {
	c    cell
	g    int // the submitter
	nrem int // blocks at the producer
	sets [scatterSets][2][]int
}

func newIndexPlan(c cell, g, nrem int, rng *rand.Rand) *indexPlan {
	p := &indexPlan{c: c, g: g, nrem: nrem}
	if c.workload == "image" && !c.contiguous {
		for i := range p.sets {
			p.sets[i][0] = rng.Perm(LocalBlocks)[:c.blocks]
			p.sets[i][1] = rng.Perm(nrem)[:c.blocks]
		}
	}
	return p
}

// next appends READ k's local and remote indices.
func (p *indexPlan) next(k int64, rng *rand.Rand, local, remote []int) ([]int, []int) {
	c := p.c
	switch {
	case c.workload == "fanin":
		n := 1 + rng.Intn(FaninMaxBlocks)
		for i := 0; i < n; i++ {
			local = append(local, p.g*FaninMaxBlocks+i)
			remote = append(remote, rng.Intn(p.nrem))
		}
	case c.blocks == 1:
		local = append(local, int(k%LocalBlocks))
		remote = append(remote, rng.Intn(p.nrem))
	case c.contiguous:
		base := int(k*int64(c.blocks)) % (p.nrem - c.blocks + 1)
		for i := 0; i < c.blocks; i++ {
			local = append(local, i)
			remote = append(remote, base+i)
		}
	default:
		set := &p.sets[k%scatterSets]
		local = append(local, set[0]...)
		remote = append(remote, set[1]...)
	}
	return local, remote
}

// submitter posts the cell's READs one after another until end or stop,
// each waited for and released; every VerifyEvery-th READ is checked
// byte for byte (outside the timed part).
func (s *session) submitter(d driver, c cell, g int, seed uint64, prep *subPrep, end time.Time, stop *atomic.Bool, st *subStats) error {
	rng, plan, local, remote := prep.rng, prep.plan, prep.local, prep.remote
	var notif [16]byte
	isNotif := c.workload == "notif"
	if isNotif {
		copy(notif[:8], timedMagic)
	} else {
		binary.LittleEndian.PutUint64(notif[:8], uint64(g))
	}
	region := d.region()
	for k := int64(0); !stop.Load() && time.Now().Before(end); k++ {
		if c.workload == "notif" {
			// Posted right after the producer reported the last one, the
			// READ would always reach a locked producer just after its
			// step and wait the whole step: a random phase instead. The
			// thread sleeps in nanosleep, which keeps microseconds (Go's
			// timers round short sleeps up towards a millisecond) and,
			// unlike a polling wait, leaves the CPU to the others.
			ts := unix.NsecToTimespec(rng.Int63n(int64(stepInterval)))
			_ = unix.Nanosleep(&ts, nil)
		}
		local, remote = plan.next(k, rng, local[:0], remote[:0])
		check := k%VerifyEvery == 0
		if check {
			t := cpuStart()
			for _, l := range local {
				clear(region[l*c.bs : (l+1)*c.bs])
			}
			st.verify += cpuSince(t)
		}
		var msg []byte
		if c.notifMsg {
			binary.LittleEndian.PutUint64(notif[8:], uint64(k))
			msg = notif[:]
		}
		// The clock the producer shares is read only for notif: it is a
		// system call (x/sys has no vDSO path), which in every READ's
		// timer added 0.2-0.4 µs to every mode's one-block figures.
		var postAt, doneAt int64
		t0 := time.Now()
		if isNotif {
			postAt = monoNow()
		}
		id, err := d.post(local, remote, msg)
		if err != nil {
			return fmt.Errorf("post: %w", err)
		}
		if err := waitDone(d, id, readLimit); err != nil {
			_ = d.release(id)
			return err
		}
		lat := time.Since(t0)
		if isNotif {
			doneAt = monoNow()
		}
		if check {
			// Before the release, untimed: bytes that land only after
			// DONE was published are caught here, not after the fact.
			t := cpuStart()
			err := verifyRead(region, c.bs, seed, k, local, remote)
			st.verify += cpuSince(t)
			if err != nil {
				_ = d.release(id)
				return err
			}
		}
		if err := d.release(id); err != nil {
			return fmt.Errorf("release: %w", err)
		}
		if isNotif {
			if lat, err = s.notifLatency(msg, postAt, doneAt, st); err != nil {
				return err
			}
		}
		if c.subs > 1 {
			// Between READs, untimed: with more submitters than Ps, a
			// goroutine whose READs never yield (direct READs end inside
			// PostRead) runs until Go preempts it, and the preemption
			// (every 10 ms) would land inside some READ's time.
			runtime.Gosched()
		}
		st.lat = append(st.lat, lat)
		st.reads++
		st.blocks += int64(len(local))
	}
	return nil
}

// cpuStart and cpuSince time the harness's own work between READs in CPU
// time: cpuStart locks the goroutine to its thread and reads the thread's
// CPU clock, cpuSince reads it again and unlocks. The thread's clock then
// counts that work alone, also when it is descheduled (with many
// submitters a check's wall time is several times its CPU time), and
// runCell takes the CPU time out of the pass's wall time.
func cpuStart() time.Duration {
	runtime.LockOSThread()
	return threadCPU()
}

func cpuSince(t time.Duration) time.Duration {
	d := threadCPU() - t
	runtime.UnlockOSThread()
	return d
}

func threadCPU() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	return time.Duration(ts.Nano())
}

// notifLatency waits for the producer to report msg and returns how long
// after postAt (this process's monotonic clock, shared with the producer
// on one host) it saw it: post → producer notified, the time until the
// producer may reuse its blocks. (From the reader's DONE it cannot be
// measured for every mode: the direct path sends an inline READ's
// notification inside PostRead, before the reader can see DONE.) Seen
// before doneAt counts in st.early.
func (s *session) notifLatency(msg []byte, postAt, doneAt int64, st *subStats) (time.Duration, error) {
	m, err := s.expect("seen", readLimit)
	if err != nil {
		return 0, err
	}
	if !bytes.Equal(m.Data, msg) {
		return 0, fmt.Errorf("notification %x, want %x", m.Data, msg)
	}
	seen := m.Ints["t"]
	if seen < doneAt {
		st.early++
	}
	return time.Duration(max(seen-postAt, 0)), nil
}

// verifyRead checks the blocks READ k landed in local against the pattern
// of the producer's remote blocks.
func verifyRead(region []byte, bs int, seed uint64, k int64, local, remote []int) error {
	for i, l := range local {
		if ok, off := pattern.Check(region[l*bs:(l+1)*bs], seed, remote[i]); !ok {
			return fmt.Errorf("VERIFY FAILED: READ %d, local block %d (remote block %d) differs at byte %d", k, l, remote[i], off)
		}
	}
	return nil
}

// references measures memcpy and ucx_perftest for the block sizes run.
func (s *session) references(ctx context.Context) {
	d := min(max(s.cfg.Duration/2, 100*time.Millisecond), 2*time.Second)
	for _, bs := range blockSizes {
		s.progress(fmt.Sprintf("reference: memcpy %d B", bs))
		workers := s.cfg.CopyWorkers
		if workers == 0 {
			workers = ecxfer.DefaultCopyWorkers
		}
		if refs, err := memcpyRefs(bs, d, workers); err == nil {
			s.rep.References = append(s.rep.References, refs...)
		} else {
			s.rep.Notes = append(s.rep.Notes, err.Error())
		}
	}
	for _, bs := range blockSizes {
		s.progress(fmt.Sprintf("reference: ucx_perftest ucp_get %d B", bs))
		ref, err := perftestRef(ctx, bs, 100000)
		if errors.Is(err, errNoPerftest) {
			s.rep.Notes = append(s.rep.Notes, "ucx_perftest not installed (Debian: ucx-utils): its reference is skipped")
			break
		}
		if err != nil {
			s.rep.Notes = append(s.rep.Notes, fmt.Sprintf("ucx_perftest %d B skipped: %v", bs, err))
			continue
		}
		s.rep.References = append(s.rep.References, ref)
	}
	s.clearProgress()
}

func (s *session) progress(msg string) {
	if s.cfg.Progress == nil || s.cfg.Quiet {
		return
	}
	fmt.Fprintf(s.cfg.Progress, "\r\033[K%5.1fs  %s", time.Since(s.start).Seconds(), msg)
}

func (s *session) clearProgress() {
	if s.cfg.Progress == nil || s.cfg.Quiet {
		return
	}
	fmt.Fprint(s.cfg.Progress, "\r\033[K")
}

// ProgressTo returns w when it is a terminal, nil otherwise: the progress
// line is for people watching, not for logs.
func ProgressTo(f *os.File) io.Writer {
	if f != nil && isTerminal(f.Fd()) {
		return f
	}
	return nil
}

// startProfiles starts the pprof profiles cfg asks for and returns how to
// finish them.
func startProfiles(cfg *Config) (func() error, error) {
	if cfg.MemProfile != "" {
		runtime.MemProfileRate = 4096
	}
	var cpu *os.File
	if cfg.CPUProfile != "" {
		var err error
		if cpu, err = os.Create(cfg.CPUProfile); err != nil {
			return nil, err
		}
		if err := pprof.StartCPUProfile(cpu); err != nil {
			cpu.Close()
			return nil, err
		}
	}
	return func() error {
		var err error
		if cpu != nil {
			pprof.StopCPUProfile()
			err = cpu.Close()
		}
		if cfg.MemProfile != "" {
			if werr := writeFile(cfg.MemProfile, func(w io.Writer) error { return pprof.Lookup("allocs").WriteTo(w, 0) }); err == nil {
				err = werr
			}
		}
		return err
	}, nil
}

// b2i is 1 for true, for control messages' ints.
func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
