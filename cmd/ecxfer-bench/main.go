package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/bench"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/metrics"
)

func main() {
	if os.Getenv(bench.RoleEnv) == "producer" {
		os.Exit(bench.ProducerMain())
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `usage:
  ecxfer-bench run [flags]            measure (see ecxfer-bench run -h)
  ecxfer-bench serve --listen ADDR    be the producer for a run --connect on another host
                     [--metrics-addr ADDR]  and serve its Prometheus metrics
`

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "run":
		return runCmd(args[1:], stdout, stderr)
	case "serve":
		return serveCmd(args[1:], stderr)
	case "producer":
		// Hidden: the child role run starts (by hand it says what it is).
		return bench.ProducerMain()
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "ecxfer-bench: unknown command %q\n%s", args[0], usage)
	return 2
}

func runCmd(args []string, stdout, stderr io.Writer) int {
	cfg, err := bench.ParseRunFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "ecxfer-bench run: %v\n", err)
		return 2
	}
	if !cfg.Quiet {
		cfg.Progress = bench.ProgressTo(os.Stderr)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	rep, err := bench.Run(ctx, cfg)
	if rep != nil && len(rep.Results) > 0 {
		if werr := bench.WriteTable(stdout, rep); werr != nil && err == nil {
			err = werr
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "ecxfer-bench run: %v\n", err)
		return 1
	}
	prod := ""
	if rep.Machine.ProducerCPU > 0 {
		prod = fmt.Sprintf(" (the producer at --connect, on this kernel, used %.1f and is not counted)", rep.Machine.ProducerCPU)
	}
	fmt.Fprintf(stdout, "wall time %.1fs; other processes used %.1f CPU-s meanwhile%s (%s, %s, %d cores, ucx %s, %s)\n", time.Since(start).Seconds(),
		rep.Machine.OtherCPU, prod, rep.Machine.CPUModel, rep.Machine.Kernel, rep.Machine.Cores, rep.Machine.UCXVersion, rep.Machine.GoVersion)
	return 0
}

func serveCmd(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("ecxfer-bench serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "", "address to listen on for the control connection (host:port)")
	once := fs.Bool("once", false, "exit after serving one run")
	backend := fs.String("backend", "ucx", "transfer engine: ucx or nixl (the consumer must use the same)")
	metricsAddr := fs.String("metrics-addr", "", "serve the producer's Prometheus metrics on http://ADDR/metrics (host:port)")
	handshake := fs.Duration("handshake-wait", 30*time.Second, "drop a client that has not sent its first control frame within this time (runs are served one at a time)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *handshake <= 0 {
		fmt.Fprintf(stderr, "ecxfer-bench serve: --handshake-wait %v: want a positive duration\n", *handshake)
		return 2
	}
	if *backend != "ucx" && *backend != "nixl" {
		fmt.Fprintf(stderr, "ecxfer-bench serve: --backend %q: want ucx or nixl\n", *backend)
		return 2
	}
	if *listen == "" || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "ecxfer-bench serve: --listen HOST:PORT is required (and nothing else)")
		return 2
	}
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "ecxfer-bench serve: %v\n", err)
		return 1
	}
	defer l.Close()
	var hook bench.TransportHook
	if *metricsAddr != "" {
		ex, err := metrics.Listen(*metricsAddr)
		if err != nil {
			fmt.Fprintf(stderr, "ecxfer-bench serve: --metrics-addr: %v\n", err)
			return 1
		}
		defer ex.Close()
		hook = followTransport(ex, stderr)
		fmt.Fprintf(stderr, "ecxfer-bench serve: metrics on http://%s/metrics\n", ex.Addr())
	}
	// SIGINT or SIGTERM closes the listener and the run's connection, so
	// the run's producer is closed and the exporter shut down on the way
	// out, as after --once.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var mu sync.Mutex
	var cur net.Conn
	go func() {
		<-ctx.Done()
		mu.Lock()
		defer mu.Unlock()
		_ = l.Close()
		if cur != nil {
			_ = cur.Close()
		}
	}()
	fmt.Fprintf(stderr, "ecxfer-bench serve: listening on %s\n", l.Addr())
	for {
		c, err := l.Accept()
		if ctx.Err() != nil {
			if c != nil {
				_ = c.Close()
			}
			fmt.Fprintln(stderr, "ecxfer-bench serve: interrupted")
			return 0
		}
		if err != nil {
			fmt.Fprintf(stderr, "ecxfer-bench serve: %v\n", err)
			return 1
		}
		mu.Lock()
		if ctx.Err() != nil { // the signal came after Accept
			mu.Unlock()
			_ = c.Close()
			fmt.Fprintln(stderr, "ecxfer-bench serve: interrupted")
			return 0
		}
		cur = c
		mu.Unlock()
		fmt.Fprintf(stderr, "ecxfer-bench serve: run from %s\n", c.RemoteAddr())
		// One run at a time: two runs at once would measure each other. So
		// a client must send its first frame within --handshake-wait, or a
		// connection that sends nothing (or a trickle) would hold the
		// producer from every other client.
		hc := newHandshakeConn(c, *handshake)
		err = bench.ServeHooked(ctrl.New(hc, c), *backend, hook)
		mu.Lock()
		cur = nil
		mu.Unlock()
		_ = c.Close()
		if ctx.Err() != nil {
			fmt.Fprintln(stderr, "ecxfer-bench serve: interrupted")
			return 0
		}
		if err != nil {
			fmt.Fprintf(stderr, "ecxfer-bench serve: %v\n", err)
		} else {
			fmt.Fprintf(stderr, "ecxfer-bench serve: run from %s done\n", c.RemoteAddr())
		}
		if *once && hc.done {
			if err != nil {
				return 1
			}
			return 0
		}
		// (--once counts a run only once its client sent a frame: a port
		// scan or a stray connection does not end the serve.)
	}
}

// handshakeConn reads from a connection with a read deadline that lasts
// until the first whole control frame (a 4-byte big-endian length, then
// that many bytes) has been read; done says it has.
type handshakeConn struct {
	c    net.Conn
	hdr  [4]byte
	got  int // header bytes read
	left int // body bytes of the first frame still to read, once got == 4
	done bool
}

func newHandshakeConn(c net.Conn, wait time.Duration) *handshakeConn {
	_ = c.SetReadDeadline(time.Now().Add(wait))
	return &handshakeConn{c: c}
}

func (h *handshakeConn) Read(p []byte) (int, error) {
	n, err := h.c.Read(p)
	for b := p[:n]; len(b) > 0 && !h.done; {
		if h.got < len(h.hdr) {
			k := copy(h.hdr[h.got:], b)
			h.got += k
			b = b[k:]
			if h.got == len(h.hdr) {
				h.left = int(binary.BigEndian.Uint32(h.hdr[:]))
			}
		} else {
			k := min(len(b), h.left)
			h.left -= k
			b = b[k:]
		}
		if h.got == len(h.hdr) && h.left == 0 {
			h.done = true
			_ = h.c.SetReadDeadline(time.Time{})
		}
	}
	return n, err
}

// followTransport exports the metrics of the producer's current Transport.
// A closed transport stays exported (its counters are final) until the
// next one opens, so a scrape after a run still sees the run's last cell.
func followTransport(ex *metrics.Exporter, stderr io.Writer) bench.TransportHook {
	var cur *ecxfer.Transport
	return func(t *ecxfer.Transport, open bool) {
		if !open {
			return
		}
		if cur != nil {
			ex.Remove(cur)
		}
		cur = t
		if err := ex.Add(t, metrics.WithPeers(16)); err != nil {
			fmt.Fprintf(stderr, "ecxfer-bench serve: metrics: %v\n", err)
		}
	}
}
