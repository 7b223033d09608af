package bench

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/affinity"
	"github.com/ecxfer/ecxfer/reactor"
)

// explicit reports whether the flag name was given on the command line.
func explicit(fs *flag.FlagSet, name string) bool {
	found := false
	fs.Visit(func(f *flag.Flag) { found = found || f.Name == name })
	return found
}

// The workloads, modes and backends a run can name.
var (
	AllWorkloads = []string{"latency", "image", "fanin", "notif"}
	AllModes     = []string{"reactor", "direct", "locked", "raw"}
	AllBackends  = []string{"ucx", "loopback", "nixl"}
)

// producerKinds are the producers --producer may name.
var producerKinds = []string{"reactor", "locked", "raw"}

// Block sizes: one token's embedding for a 2,560-wide bf16 model, and for
// Qwen3-VL-8B with deepstack.
const (
	SmallBlock = 5120
	LargeBlock = 32768
)

// Shape of the workloads.
const (
	ImageBlocks    = 880       // blocks per image READ
	FaninMaxBlocks = 16        // fanin READs take 1..FaninMaxBlocks blocks
	LocalBlocks    = 1024      // the consumer's region, in blocks
	RemoteRegion   = 128 << 20 // default producer region in bytes: far beyond the caches
	VerifyEvery    = 64        // every VerifyEvery-th READ of a submitter is verified
)

// FaninSubmitters are the goroutine counts of the fanin workload.
var FaninSubmitters = []int{1, 4, 16, 64}

// ErrUsage reports a bad flag or argument.
var ErrUsage = errors.New("usage")

// Config is one harness run.
type Config struct {
	Workloads []string
	Modes     []string
	Backend   string
	// LargeTCPSegments: the ucx engines of both ends with
	// Config.LargeTCPSegments.
	LargeTCPSegments bool
	// Duration is measured per workload×mode cell, after Warmup.
	Duration time.Duration
	Warmup   time.Duration
	// Rounds splits each cell's Duration into this many rounds, the
	// modes run in turn within a round and in the reverse order in the
	// next, and each row merges its rounds. The machine's speed drifts
	// (a shared VM can run at half speed for minutes): modes measured in
	// one block each would see different machines; in alternating rounds
	// they see the same mix. Each round warms up (Warmup) again.
	Rounds int
	// Connect, when set, is the address of an `ecxfer-bench serve`
	// producer; otherwise the harness starts its own (ucx: a child
	// process, loopback: in-process).
	Connect string
	// sharedClock: the producer at Connect reads the same CLOCK_MONOTONIC
	// as this process (another network namespace of this machine), so the
	// notif workload can run across it. Run finds it out.
	sharedClock bool
	// Reactor tunes both sides' reactors in reactor mode (the producer
	// child is never pinned: pinning is for the consumer's reactor).
	Reactor reactor.Options
	// CopyWorkers and InlineBytes tune the direct mode (ecxfer.Config's
	// fields of those names; 0: ecxfer's defaults).
	CopyWorkers int
	InlineBytes int
	// Wait is how reactor-mode callers wait for a READ: "poll"
	// (CheckXferState in a loop, as vLLM's interface is used; the default)
	// or "block" (Transport.Wait). Locked and raw callers always poll.
	Wait string
	// RemoteRegion is the size of the producer's region in bytes; it
	// holds max(LocalBlocks, RemoteRegion/block size) blocks. Larger than
	// the caches by default, so READs come from memory, as the memcpy
	// reference's copies do.
	RemoteRegion int
	// ProducerIdle is the producer reactor's idle strategy (flag
	// --producer-idle), hybrid by default like the consumer's. Gets of the
	// producer's memory are one-sided, but every notification sent to a
	// parked UCX worker costs the sender a wake-up, which slows the READs
	// that carry notifications (run fanin with --producer-idle park to
	// compare).
	ProducerIdle reactor.IdleStrategy
	// Producer is the producer every reactor, locked and raw row reads
	// from (flag --producer): "reactor", "locked" or "raw"; empty for each
	// mode's own (a reactor consumer reads from a reactor producer, a
	// locked one from a locked producer, a raw one from a raw producer).
	// Direct rows always read from their own. With one producer for all,
	// the rows compare the consumers alone: across hosts, where the
	// producer serves every get, a mode's figures are as much its
	// producer's as its consumer's.
	Producer string
	// References turns the memcpy and ucx_perftest references on.
	References bool
	// CPUProfile and MemProfile, when set, receive pprof profiles of the
	// consumer process over the measured cells.
	CPUProfile string
	MemProfile string
	JSONFile   string
	SVGFile    string
	Quiet      bool
	// Progress receives the progress line; nil for none.
	Progress io.Writer
	// ProducerExe is the binary re-executed as the producer child; empty
	// means this process's own executable.
	ProducerExe string
}

// DefaultConfig is the short default run: every workload and mode on ucx,
// one second per cell.
func DefaultConfig() Config {
	return Config{
		Workloads:    append([]string(nil), AllWorkloads...),
		Modes:        append([]string(nil), AllModes...),
		Backend:      "ucx",
		Duration:     time.Second,
		Warmup:       200 * time.Millisecond,
		Rounds:       2,
		References:   true,
		ProducerIdle: reactor.IdleHybrid,
		RemoteRegion: RemoteRegion,
		Wait:         "poll",
	}
}

// parseList splits a comma-separated list and checks each item against
// allowed, dropping duplicates.
func parseList(what, s string, allowed []string) ([]string, error) {
	var out []string
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f != "" && !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	if err := checkNames(what, out, allowed); err != nil {
		return nil, err
	}
	return out, nil
}

// checkNames reports an empty list or the first name in it that allowed
// lacks.
func checkNames(what string, list, allowed []string) error {
	if len(list) == 0 {
		return fmt.Errorf("%w: no %s given (want %s)", ErrUsage, what, strings.Join(allowed, ", "))
	}
	for _, v := range list {
		if !slices.Contains(allowed, v) {
			return fmt.Errorf("%w: unknown %s %q (want %s)", ErrUsage, what, v, strings.Join(allowed, ", "))
		}
	}
	return nil
}

// Validate checks a Config and reports the first problem.
func (c *Config) Validate() error {
	if err := checkNames("workload", c.Workloads, AllWorkloads); err != nil {
		return err
	}
	if err := checkNames("mode", c.Modes, AllModes); err != nil {
		return err
	}
	if err := checkNames("backend", []string{c.Backend}, AllBackends); err != nil {
		return err
	}
	if c.LargeTCPSegments && c.Backend != "ucx" {
		return fmt.Errorf("%w: --large-tcp-segments needs --backend ucx", ErrUsage)
	}
	if slices.Contains(c.Modes, "direct") && c.Backend == "nixl" {
		return fmt.Errorf("%w: mode direct needs --backend ucx or loopback (NIXL's metadata cannot carry the region's advertisement)", ErrUsage)
	}
	if slices.Contains(c.Modes, "direct") && c.Connect != "" {
		return fmt.Errorf("%w: mode direct reads a producer on this host; drop it with --connect", ErrUsage)
	}
	if c.CopyWorkers < 0 || c.CopyWorkers > 256 {
		return fmt.Errorf("%w: --copy-workers %d out of range 0..256", ErrUsage, c.CopyWorkers)
	}
	if c.Connect != "" && c.Backend == "loopback" {
		return fmt.Errorf("%w: --connect needs --backend ucx or nixl (loopback runs in one process)", ErrUsage)
	}
	if c.Duration <= 0 {
		return fmt.Errorf("%w: --duration %v must be positive", ErrUsage, c.Duration)
	}
	if c.Duration > time.Hour {
		return fmt.Errorf("%w: --duration %v is more than an hour per cell", ErrUsage, c.Duration)
	}
	if c.Rounds < 1 || c.Rounds > 100 {
		return fmt.Errorf("%w: --rounds %d out of range 1..100", ErrUsage, c.Rounds)
	}
	if c.Duration/time.Duration(max(c.Rounds, 1)) < time.Millisecond {
		return fmt.Errorf("%w: --duration %v split in %d rounds leaves less than 1ms per round", ErrUsage, c.Duration, c.Rounds)
	}
	if c.Warmup < 0 {
		return fmt.Errorf("%w: --warmup %v must not be negative", ErrUsage, c.Warmup)
	}
	if c.Producer != "" && !slices.Contains(producerKinds, c.Producer) {
		return fmt.Errorf("%w: --producer %q (want %s)", ErrUsage, c.Producer, strings.Join(producerKinds, ", "))
	}
	if c.Wait != "poll" && c.Wait != "block" {
		return fmt.Errorf("%w: --wait %q (want poll or block)", ErrUsage, c.Wait)
	}
	if s := c.Reactor.WaitSpin; s < 0 || s > time.Second {
		return fmt.Errorf("%w: --wait-spin %v out of range 0..1s", ErrUsage, s)
	}
	if c.Reactor.WaitSpin > 0 && c.Wait != "block" {
		return fmt.Errorf("%w: --wait-spin is for --wait block (polling callers never sleep)", ErrUsage)
	}
	if c.RemoteRegion < 0 || c.RemoteRegion > 1<<34 {
		return fmt.Errorf("%w: producer region of %d bytes (want 0..16 GiB)", ErrUsage, c.RemoteRegion)
	}
	// Output files are written at the end: a path that cannot take one
	// would waste the whole run.
	for _, out := range []struct{ flag, path string }{
		{"json", c.JSONFile}, {"svg", c.SVGFile}, {"cpuprofile", c.CPUProfile}, {"memprofile", c.MemProfile},
	} {
		if err := checkOutPath(out.path); err != nil {
			return fmt.Errorf("%w: --%s %s: %v", ErrUsage, out.flag, out.path, err)
		}
	}
	if o := c.Reactor; o.PinCPU && (o.CPU < 0 || o.CPU >= runtime.NumCPU()) {
		return fmt.Errorf("%w: --reactor-cpu %d out of range 0..%d", ErrUsage, o.CPU, runtime.NumCPU()-1)
	}
	if o := c.Reactor; o.BindNUMA && o.NUMANode < 0 {
		return fmt.Errorf("%w: --numa-node %d must not be negative", ErrUsage, o.NUMANode)
	}
	if o := c.Reactor; o.BindNUMA {
		// A node this machine lacks failed only once a transport was made,
		// and modes without one (locked, raw) ignored it.
		if _, err := affinity.PickCPU(o.NUMANode); err != nil {
			return fmt.Errorf("%w: --numa-node %d: %v", ErrUsage, o.NUMANode, err)
		}
	}
	if b := c.Reactor.BatchSize; b < 0 || b > 1<<16 {
		return fmt.Errorf("%w: --batch %d out of range 0..65536 (0: the reactor's default)", ErrUsage, b)
	}
	return nil
}

// ParseRunFlags parses the arguments of `ecxfer-bench run` into a Config.
// Errors wrap ErrUsage (or flag.ErrHelp for -h).
func ParseRunFlags(args []string, stderr io.Writer) (Config, error) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("ecxfer-bench run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	workloads := fs.String("workloads", strings.Join(AllWorkloads, ","), "comma-separated workloads: "+strings.Join(AllWorkloads, ", "))
	modes := fs.String("modes", strings.Join(AllModes, ","), "comma-separated modes: "+strings.Join(AllModes, ", "))
	fs.StringVar(&c.Backend, "backend", c.Backend, "transfer engine: ucx or nixl (the NIXL library; producer in a child process), or loopback (one process)")
	fs.DurationVar(&c.Duration, "duration", c.Duration, "measured time per workload×mode cell")
	fs.DurationVar(&c.Warmup, "warmup", c.Warmup, "unmeasured time before each cell, in each round")
	fs.IntVar(&c.Rounds, "rounds", c.Rounds, "split each cell's --duration into this many rounds, modes in alternating order, merged per row")
	fs.StringVar(&c.Connect, "connect", "", "`host:port` of an ecxfer-bench serve producer; default: start one here")
	cpu := fs.Int("reactor-cpu", -1, "pin the consumer's reactor thread to this CPU (-1: not pinned)")
	node := fs.Int("numa-node", -1, "bind the consumer's reactor and region to this NUMA node (-1: no binding)")
	idle := fs.String("idle", "hybrid", "reactor idle strategy: hybrid, spin, yield or park")
	fs.StringVar(&c.Producer, "producer", "", "the producer every reactor, locked and raw row reads from: "+strings.Join(producerKinds, ", ")+" (default: each mode's own; direct rows always read from their own)")
	pidle := fs.String("producer-idle", "hybrid", "the producer reactor's idle strategy: hybrid, spin, yield or park")
	fs.IntVar(&c.Reactor.BatchSize, "batch", 0, "reactor batch size, submissions per loop turn (0: the reactor's default)")
	fs.IntVar(&c.CopyWorkers, "copy-workers", 0, fmt.Sprintf("direct mode: copy threads for READs above --inline-bytes (0: %d)", ecxfer.DefaultCopyWorkers))
	fs.IntVar(&c.InlineBytes, "inline-bytes", 0, fmt.Sprintf("direct mode: largest READ copied inside PostRead (0: %d, -1: none)", ecxfer.DefaultInlineBytes))
	fs.StringVar(&c.Wait, "wait", c.Wait, "how reactor-mode callers wait: poll (CheckXferState loop) or block (Transport.Wait)")
	fs.BoolVar(&c.LargeTCPSegments, "large-tcp-segments", false, "ucx: UCX tcp segments of 256 KiB at both ends and 252 KiB answers to gathered READs (Config.LargeTCPSegments; the producer is told to use them too)")
	fs.BoolVar(&c.Reactor.ReactorOnly, "reactor-only", false, "the consumer's engine is driven by its reactor thread alone: polling callers never step in for it")
	fs.DurationVar(&c.Reactor.WaitSpin, "wait-spin", 0, "with --wait block: how long Transport.Wait checks the READ before it sleeps (0: the reactor's default, 50µs)")
	noRefs := fs.Bool("no-refs", false, "skip the memcpy and ucx_perftest references")
	fs.StringVar(&c.JSONFile, "json", "", "write results as JSON to this file")
	fs.StringVar(&c.SVGFile, "svg", "", "write latency CDFs and throughput charts as SVG to this file")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the consumer process to this file")
	fs.StringVar(&c.MemProfile, "memprofile", "", "write an allocation profile of the consumer process to this file")
	fs.BoolVar(&c.Quiet, "quiet", false, "no progress line")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, fmt.Errorf("%w: %v", ErrUsage, err)
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("%w: unexpected argument %q", ErrUsage, fs.Arg(0))
	}
	var err error
	if c.Workloads, err = parseList("workload", *workloads, AllWorkloads); err != nil {
		return c, err
	}
	if c.Modes, err = parseList("mode", *modes, AllModes); err != nil {
		return c, err
	}
	if !explicit(fs, "modes") && (c.Backend == "nixl" || c.Connect != "") {
		// The direct path needs the producer on this host and ecxfer's
		// metadata: by default it is left out where it cannot run.
		c.Modes = slices.DeleteFunc(c.Modes, func(m string) bool { return m == "direct" })
	}
	if c.Reactor.Idle, err = reactor.ParseIdle(*idle); err != nil {
		return c, fmt.Errorf("%w: --idle %q (want hybrid, spin, yield or park)", ErrUsage, *idle)
	}
	if c.ProducerIdle, err = reactor.ParseIdle(*pidle); err != nil {
		return c, fmt.Errorf("%w: --producer-idle %q (want hybrid, spin, yield or park)", ErrUsage, *pidle)
	}
	if *cpu < -1 {
		return c, fmt.Errorf("%w: --reactor-cpu %d (want a CPU number, or -1)", ErrUsage, *cpu)
	}
	if *cpu >= 0 {
		c.Reactor.PinCPU, c.Reactor.CPU = true, *cpu
	}
	if *node < -1 {
		return c, fmt.Errorf("%w: --numa-node %d (want a node number, or -1)", ErrUsage, *node)
	}
	if *node >= 0 {
		c.Reactor.BindNUMA, c.Reactor.NUMANode = true, *node
	}
	if c.Connect != "" {
		if _, _, err := net.SplitHostPort(c.Connect); err != nil {
			return c, fmt.Errorf("%w: --connect %q: %v", ErrUsage, c.Connect, err)
		}
	}
	c.References = !*noRefs
	return c, c.Validate()
}

// remoteBlocks is how many blocks of bs bytes the producer's region holds.
func (c *Config) remoteBlocks(bs int) int { return max(LocalBlocks, c.RemoteRegion/bs) }

// checkOutPath reports why a file could not be written at path, if it can
// tell before writing: a directory there, or a parent directory that is
// missing or not writable. "" is no file.
func checkOutPath(path string) error {
	if path == "" {
		return nil
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return errors.New("is a directory")
	}
	dir := filepath.Dir(path)
	fi, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return fmt.Errorf("cannot write in %s: %w", dir, err)
	}
	return nil
}

// producerFor is the producer a mode's rows read from: --producer, or the
// mode's own.
func (c *Config) producerFor(mode string) string {
	if c.Producer == "" || mode == "direct" {
		return mode
	}
	return c.Producer
}
