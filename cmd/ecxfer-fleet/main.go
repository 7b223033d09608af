// Command ecxfer-fleet measures ecxfer as a fleet uses it.
//
// Usage:
//
//	ecxfer-fleet peers [--agents 256] [--procs 8] [--block 4096] [--blocks 16]
//	ecxfer-fleet consumers [--consumers 1,4,16] [--block 32768] [--blocks 1024]
//	                       [--per-read 64] [--duration 3s] [--idle hybrid|spin|yield|park]
//	                       [--producer-netns NS --producer-dev DEV --consumer-netns NS --consumer-dev DEV]
//	ecxfer-fleet tcp-serve --listen HOST:PORT
//	ecxfer-fleet tcp-probe --connect HOST:PORT [--duration 2s]
//
// peers: one consumer (this process) and --agents producer agents spread
// over --procs processes: AddRemotePeer p50/p99, memory per peer (RSS and
// shared memory mapped, UCX's segments included) after adding and after
// one READ from each (bytes verified), then every peer removed: what is
// left mapped, descriptors, goroutines.
//
// consumers: one producer process and N consumer processes for each N of
// --consumers, each reading --per-read scattered blocks per READ with a
// notification: aggregate GB/s, the producer's notification latency
// (consumer saw DONE → producer's WaitNotifs returned it; p50, p99) and
// its reactor's CPU time per GB served. With the netns flags the producer
// and the consumers run in those network namespaces (which must exist)
// with UCX over TCP on the given devices.
//
// tcp-serve and tcp-probe measure a link's own TCP throughput (one
// stream, --duration) and round-trip time (1-byte ping-pong), the limit
// UCX over TCP is compared with.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ecxfer/ecxfer/internal/fleet"
	"github.com/ecxfer/ecxfer/reactor"
)

func main() {
	if code, ok := fleet.Child(); ok {
		os.Exit(code)
	}
	os.Exit(run(os.Args[1:]))
}

const usage = `usage: ecxfer-fleet peers|consumers|tcp-serve|tcp-probe [flags] (-h for each)
`

func run(args []string) int {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fs := flag.NewFlagSet("ecxfer-fleet "+args[0], flag.ContinueOnError)
	var err error
	switch args[0] {
	case "peers":
		err = peers(ctx, fs, args[1:])
	case "consumers":
		err = consumers(ctx, fs, args[1:])
	case "tcp-serve":
		listen := fs.String("listen", "", "address to listen on (host:port)")
		if err = parse(fs, args[1:]); err == nil && *listen == "" {
			err = usageError("--listen HOST:PORT is required")
		}
		if err == nil {
			err = fleet.TCPServe(ctx, *listen, os.Stderr)
		}
	case "tcp-probe":
		connect := fs.String("connect", "", "address of a tcp-serve (host:port)")
		dur := fs.Duration("duration", 2*time.Second, "how long to stream")
		if err = parse(fs, args[1:]); err == nil {
			switch {
			case *connect == "":
				err = usageError("--connect HOST:PORT is required")
			case *dur <= 0:
				err = usageError("--duration must be positive")
			}
		}
		if err == nil {
			var r *fleet.TCPResult
			if r, err = fleet.TCPProbe(ctx, *connect, *dur); err == nil {
				fmt.Printf("tcp link: %.2f GB/s (%.1f Gbit/s) one stream over %v; RTT p50 %.1f µs, p99 %.1f µs (%d ping-pongs)\n",
					r.GBps(), r.GBps()*8, r.Duration.Round(time.Millisecond), us(r.RTTP50), us(r.RTTP99), r.Pings)
			}
		}
	default:
		fmt.Fprint(os.Stderr, usage)
		return 2
	}
	if err == flag.ErrHelp {
		return 0
	}
	var ue usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(os.Stderr, "ecxfer-fleet %s: %v\n", args[0], err)
		return 2
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ecxfer-fleet %s: %v\n", args[0], err)
		return 1
	}
	return 0
}

// usageError is a bad command line: exit status 2.
type usageError string

func (e usageError) Error() string { return string(e) }

// parse parses args and refuses arguments left over. Flag errors are
// usage errors (the flag package has printed them).
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return err
		}
		return usageError(err.Error())
	}
	if fs.NArg() > 0 {
		return usageError(fmt.Sprintf("unexpected arguments %q", fs.Args()))
	}
	return nil
}

// positive refuses a flag value below 1.
func positive(name string, v int) error {
	if v < 1 {
		return usageError(fmt.Sprintf("--%s %d: must be at least 1", name, v))
	}
	return nil
}

func us(d time.Duration) float64 { return float64(d) / 1e3 }

func mib(b float64) float64 { return b / (1 << 20) }

func peers(ctx context.Context, fs *flag.FlagSet, args []string) error {
	var cfg fleet.PeersConfig
	fs.IntVar(&cfg.Agents, "agents", 256, "producer agents")
	fs.IntVar(&cfg.Procs, "procs", 8, "processes holding them")
	fs.IntVar(&cfg.BlockSize, "block", 4096, "block size")
	fs.IntVar(&cfg.NumBlocks, "blocks", 16, "blocks per agent")
	if err := parse(fs, args); err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"agents", cfg.Agents}, {"procs", cfg.Procs}, {"block", cfg.BlockSize}, {"blocks", cfg.NumBlocks}} {
		if err := positive(f.name, f.v); err != nil {
			return err
		}
	}
	if cfg.Procs > cfg.Agents {
		return usageError(fmt.Sprintf("--procs %d is more than --agents %d (each process holds at least one)", cfg.Procs, cfg.Agents))
	}
	r, err := fleet.Peers(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Printf("peers: %d agents in %d processes, one consumer\n", r.Agents, r.Procs)
	fmt.Printf("  AddRemotePeer          p50 %.0f µs, p99 %.0f µs, max %.0f µs (all %d in %v)\n",
		us(r.AddP50), us(r.AddP99), us(r.AddMax), r.Agents, r.AddAll.Round(time.Millisecond))
	row := func(what string, m fleet.Mem) {
		fmt.Printf("  %-22s RSS %7.1f MiB (%+7.1f KiB/peer), shared mapped %7.1f MiB in %4d maps (%+7.1f KiB/peer), fds %4d, goroutines %d\n",
			what, mib(float64(m.RSS)), r.PerPeer(r.Base.RSS, m.RSS)/1024, mib(float64(m.SharedSize)), m.SharedMaps,
			r.PerPeer(r.Base.SharedSize, m.SharedSize)/1024, m.FDs, m.Goroutines)
	}
	row("before", r.Base)
	row("all added", r.Added)
	row("one READ each", r.Read)
	row("all removed", r.Removed)
	fmt.Printf("  READs                  %d (one per agent, all in flight together, %d blocks verified) in %v\n",
		r.ReadsVerified, r.BlocksRead, r.ReadAll.Round(time.Microsecond))
	fmt.Printf("  RemoveRemotePeer       all %d in %v\n", r.Agents, r.RemoveAll.Round(time.Millisecond))
	var bad []string
	if r.LeakErr != nil {
		bad = append(bad, r.LeakErr.Error())
	}
	if r.Removed.SharedMaps > r.Base.SharedMaps || r.Removed.SharedSize > r.Base.SharedSize {
		bad = append(bad, fmt.Sprintf("%d shared maps (%d bytes) left", r.Removed.SharedMaps-r.Base.SharedMaps, r.Removed.SharedSize-r.Base.SharedSize))
	}
	if len(bad) > 0 {
		return fmt.Errorf("after removing every peer: %s", strings.Join(bad, "; "))
	}
	fmt.Println("  after removing every peer: nothing left mapped, no descriptor, no goroutine")
	return nil
}

func consumers(ctx context.Context, fs *flag.FlagSet, args []string) error {
	var cfg fleet.ConsumersConfig
	ns := fs.String("consumers", "1,4,16", "comma-separated consumer process counts")
	fs.IntVar(&cfg.BlockSize, "block", 32768, "block size")
	fs.IntVar(&cfg.NumBlocks, "blocks", 1024, "the producer's blocks")
	fs.IntVar(&cfg.BlocksPerRead, "per-read", 64, "scattered blocks per READ")
	fs.DurationVar(&cfg.Duration, "duration", 3*time.Second, "measured time per count")
	pns := fs.String("producer-netns", "", "network namespace of the producer")
	pdev := fs.String("producer-dev", "", "its network device for UCX")
	cns := fs.String("consumer-netns", "", "network namespace of the consumers")
	cdev := fs.String("consumer-dev", "", "their network device for UCX")
	idle := fs.String("idle", "hybrid", "every reactor's idle strategy: hybrid, spin, yield or park")
	if err := parse(fs, args); err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"block", cfg.BlockSize}, {"blocks", cfg.NumBlocks}, {"per-read", cfg.BlocksPerRead}} {
		if err := positive(f.name, f.v); err != nil {
			return err
		}
	}
	if cfg.BlocksPerRead > cfg.NumBlocks {
		return usageError(fmt.Sprintf("--per-read %d: more than the producer's %d blocks", cfg.BlocksPerRead, cfg.NumBlocks))
	}
	if cfg.Duration <= 0 {
		return usageError("--duration must be positive")
	}
	var err error
	if cfg.Idle, err = reactor.ParseIdle(*idle); err != nil {
		return usageError(err.Error())
	}
	var counts []int
	for _, s := range strings.Split(*ns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			return usageError(fmt.Sprintf("--consumers %q: positive counts, comma-separated", *ns))
		}
		counts = append(counts, n)
	}
	where := "same host (shared memory)"
	if *pns != "" || *cns != "" {
		if *pns == "" || *cns == "" || *pdev == "" || *cdev == "" {
			return usageError("--producer-netns, --producer-dev, --consumer-netns and --consumer-dev go together")
		}
		cfg.ProducerWrap = []string{"ip", "netns", "exec", *pns}
		cfg.ConsumerWrap = []string{"ip", "netns", "exec", *cns}
		cfg.ProducerEnv = []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=" + *pdev}
		cfg.ConsumerEnv = []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=" + *cdev}
		where = fmt.Sprintf("across namespaces %s → %s (UCX over TCP)", *pns, *cns)
	}
	fmt.Printf("consumers: one producer, %d × %d B scattered blocks per READ, each with a notification; %s; idle %s\n",
		cfg.BlocksPerRead, cfg.BlockSize, where, cfg.Idle)
	// The producer's reactor thread only: its WaitNotifs caller and the
	// Go runtime are not in it.
	fmt.Printf("  %9s  %8s  %7s  %12s  %12s  %22s  %9s\n", "consumers", "reads", "GB/s", "notif p50 µs", "notif p99 µs", "prod reactor CPU ms/GB", "verified")
	for _, n := range counts {
		cfg.Consumers = n
		r, err := fleet.Consumers(ctx, cfg)
		if err != nil {
			return fmt.Errorf("%d consumers: %w", n, err)
		}
		fmt.Printf("  %9d  %8d  %7.2f  %12.1f  %12.1f  %22.1f  %9d\n", n, r.Reads, r.GBps(), us(r.NotifP50), us(r.NotifP99),
			float64(r.ProducerCPUPerGB)/1e6, r.Verified)
		if r.Notifs != int(r.Reads) {
			fmt.Printf("  (%d of %d notifications matched)\n", r.Notifs, r.Reads)
		}
		if r.Early > 0 {
			fmt.Printf("  (%d notifications reached the producer before the consumer stamped DONE, counted as 0 µs)\n", r.Early)
		}
	}
	return nil
}
