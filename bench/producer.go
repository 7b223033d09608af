package bench

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/reactor"
)

// RoleEnv set to "producer" makes a process started by the harness run
// ProducerMain instead of its usual main.
const RoleEnv = "ECXFER_BENCH_ROLE"

// BackendEnv tells a producer child which engine to use ("ucx" when unset).
const BackendEnv = "ECXFER_BENCH_BACKEND"

// stepInterval is the locked producer's poll period: one engine step of a
// vLLM-style scheduler, which takes its lock and polls notifications once
// per step. Raw and reactor producers use it too outside the notif
// workload, when nobody is timing notifications.
const stepInterval = time.Millisecond

// ProducerMain serves one consumer on file descriptors 3 (commands in) and
// 4 (replies out), as the harness starts its producer child, and returns
// the process exit code.
func ProducerMain() int {
	// A Ctrl-C at the terminal reaches the whole process group: the run
	// that started this producer ends it (it closes the control pipe)
	// once it has stopped its cells, instead of finding it gone.
	signal.Ignore(os.Interrupt)
	if !isPipe(3) || !isPipe(4) {
		// Run by hand: a message that says what this is, not a "bad
		// frame" from reading whatever descriptor 3 happens to be.
		fmt.Fprintln(os.Stderr, "ecxfer-bench producer: this is the producer process `ecxfer-bench run` starts, "+
			"with its control pipes on file descriptors 3 and 4; it is not run by hand "+
			"(a producer of your own for run --connect: ecxfer-bench serve --listen ADDR)")
		return 2
	}
	in, out := os.NewFile(3, "ctrl-in"), os.NewFile(4, "ctrl-out")
	backend := os.Getenv(BackendEnv)
	if backend == "" {
		backend = "ucx"
	}
	if err := Serve(ctrl.New(in, out), backend); err != nil {
		fmt.Fprintln(os.Stderr, "ecxfer-bench producer:", err)
		return 1
	}
	return 0
}

type helloMsg struct {
	name    string
	md      []byte
	memDesc []byte
}

// producer is the data owner's side of one (mode, block size) setup.
type producer struct {
	mode string
	tr   *ecxfer.Transport // reactor mode
	side *bareSide         // locked and raw modes
	mu   sync.Mutex        // locked mode: the engine lock
	// held: the notifications the locked producer's progress goroutine
	// took from the engine, until poll's next step hands them out (under
	// mu).
	held   map[string][][]byte
	timing atomic.Bool // notif workload: report each notification
	stop   chan struct{}
	done   chan struct{}
	// progDone closes when the locked producer's progress goroutine has
	// stopped (nil in other modes).
	progDone chan struct{}
	send     func(ctrl.Message) error
	pollErr  atomic.Pointer[error]
	hook     TransportHook
}

// Serve answers one consumer's commands on c until it closes the
// connection: setup (open a producer for a mode and block size and send its
// metadata), timing (report notifications), teardown.
func Serve(c *ctrl.Conn, backend string) error { return ServeHooked(c, backend, nil) }

// TransportHook is told when a reactor-mode producer's Transport opens
// (open true) and just before it closes; a metrics exporter follows the
// producer with it.
type TransportHook func(t *ecxfer.Transport, open bool)

// ServeHooked is Serve with a hook on every Transport it opens (nil: none).
func ServeHooked(c *ctrl.Conn, backend string, hook TransportHook) error {
	var sendMu sync.Mutex
	send := func(m ctrl.Message) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return c.Send(m)
	}
	var p *producer
	defer func() {
		if p != nil {
			_ = p.close()
		}
	}()
	for {
		m, err := c.Recv()
		if errors.Is(err, io.EOF) {
			if p != nil {
				// A consumer tears down every producer it set up, also
				// after an error: this one died or dropped the connection
				// in the middle of a run.
				return fmt.Errorf("producer: the consumer went away in the middle of a run (%s producer set up, no teardown)", p.mode)
			}
			return nil
		}
		if err != nil {
			return err
		}
		switch m.Kind {
		case "setup":
			if p != nil {
				_ = p.close()
				p = nil
			}
			var hello helloMsg
			p, hello, err = openProducer(m, backend, send)
			if err == nil {
				p.hook = hook
				if hook != nil && p.tr != nil {
					hook(p.tr, true)
				}
			}
			if err != nil {
				p = nil
				if err := send(ctrl.Message{Kind: "error", Strs: map[string]string{"error": err.Error()}}); err != nil {
					return err
				}
				continue
			}
			if err := send(ctrl.Message{Kind: "hello", Name: hello.name, Metadata: hello.md, MemDesc: hello.memDesc,
				Strs: map[string]string{"clock": clockID()}, Ints: selfCPUInts()}); err != nil {
				return err
			}
		case "clock":
			if err := send(ctrl.Message{Kind: "clock", Strs: map[string]string{"id": clockID()}}); err != nil {
				return err
			}
		case "timing":
			if p != nil {
				p.timing.Store(m.Ints["on"] != 0)
			}
			if err := send(ctrl.Message{Kind: "ok"}); err != nil {
				return err
			}
		case "teardown":
			var cerr error
			if p != nil {
				cerr = p.close()
				p = nil
			}
			reply := ctrl.Message{Kind: "bye", Ints: selfCPUInts()}
			if cerr != nil {
				reply = ctrl.Message{Kind: "error", Strs: map[string]string{"error": cerr.Error()}}
			}
			if err := send(reply); err != nil {
				return err
			}
		default:
			return fmt.Errorf("producer: unknown command %q", m.Kind)
		}
	}
}

func openProducer(m ctrl.Message, backend string, send func(ctrl.Message) error) (*producer, helloMsg, error) {
	mode := m.Strs["mode"]
	bs, nb, seed := int(m.Ints["block"]), int(m.Ints["blocks"]), uint64(m.Ints["seed"])
	// The consumer may be anything: sizes are bounded before they are
	// multiplied (a product that wraps could pass) and before a block
	// list of nb entries is built (every mode's region has at most
	// DefaultMaxDescs blocks, as ecxfer.New requires).
	if bs <= 0 || nb <= 0 || bs > 1<<31 || nb > descriptors.DefaultMaxDescs || bs*nb > 1<<31 {
		return nil, helloMsg{}, fmt.Errorf("producer: bad region %d×%d (at most %d blocks, 2 GiB)", nb, bs, descriptors.DefaultMaxDescs)
	}
	if k, ok := m.Strs["producer"]; ok {
		// The consumer's --producer: one producer for every mode it
		// compares (a direct consumer needs a direct producer).
		if !slices.Contains(producerKinds, k) || mode == "direct" {
			return nil, helloMsg{}, fmt.Errorf("producer: a %q producer for %s READs: want one of %s, for reactor, locked or raw READs", k, mode, strings.Join(producerKinds, ", "))
		}
		mode = k
	}
	p := &producer{mode: mode, stop: make(chan struct{}), done: make(chan struct{}), send: send}
	// The consumer's -large-tcp-segments: both ends need the same.
	large := m.Ints["large_tcp_segments"] != 0
	var hello helloMsg
	switch mode {
	case "reactor", "direct":
		opts := reactor.Options{Idle: reactor.IdleStrategy(m.Ints["idle"]), BatchSize: int(m.Ints["batch"])}
		dm := ecxfer.DirectOff
		if mode == "direct" {
			dm = ecxfer.DirectOn // advertise the region to same-host consumers
		}
		tr, err := ecxfer.New(ecxfer.Config{AgentName: agentName("prod"), Backend: backend, BlockSize: bs, NumBlocks: nb, Reactor: opts, Direct: dm,
			LargeTCPSegments: large})
		if err != nil {
			return nil, hello, err
		}
		pattern.FillRegion(tr.Region(), seed, bs)
		p.tr = tr
		hello = helloMsg{md: tr.AgentMetadata(), memDesc: tr.MemDescriptor()}
	case "locked", "raw":
		side, err := openBare(backend, agentName("prod"), bs, nb, large)
		if err != nil {
			return nil, hello, err
		}
		pattern.FillRegion(side.region, seed, bs)
		md, err := side.agent.LocalMetadata()
		if err == nil {
			hello.memDesc, err = descriptors.Encode(side.descs)
		}
		if err != nil {
			_ = side.agent.Close()
			return nil, hello, err
		}
		hello.md = md
		p.side = side
	default:
		return nil, hello, fmt.Errorf("producer: unknown mode %q", mode)
	}
	hello.name = mode
	if mode == "locked" {
		p.held = map[string][][]byte{}
		p.progDone = make(chan struct{})
		go p.progress()
	}
	go p.poll()
	return p, hello, nil
}

// poll is the producer application's loop: it collects notifications and,
// in the notif workload, reports the CLOCK_MONOTONIC time it saw each.
//
//   - reactor: the reactor receives notifications by itself (it sleeps on
//     the engine's event fd when idle); the application calls NewNotifs back
//     to back, yielding the CPU between empty polls, while notifications
//     are timed, and once per step otherwise.
//   - locked: once per step, take the lock and get the notifications, as
//     vLLM's engine loop does. Never more often. The engine itself is
//     progressed as it arrives by progress, as NIXL's progress thread does
//     beside vLLM's scheduler.
//   - raw: this goroutine is the engine's only driver. While notifications
//     are timed it progresses back to back (yielding between empty turns):
//     the floor. Otherwise it sleeps on the engine's event fd between turns,
//     so it costs no CPU yet never leaves the engine unprogressed.
func (p *producer) poll() {
	defer close(p.done)
	tmp := map[string][][]byte{}
	tick := time.NewTicker(stepInterval)
	defer tick.Stop()
	for {
		var got map[string][][]byte
		work := false
		switch p.mode {
		case "reactor", "direct":
			got = p.tr.NewNotifs()
		case "locked":
			p.mu.Lock()
			_, _ = p.side.agent.Progress()
			p.side.agent.GetNotifs(p.held)
			tmp, p.held = p.held, tmp // tmp was cleared below
			p.mu.Unlock()
			got = tmp
		case "raw":
			work, _ = p.side.agent.Progress()
			p.side.agent.GetNotifs(tmp)
			got = tmp
		}
		seen := monoNow()
		n := 0
		for _, msgs := range got {
			n += len(msgs)
		}
		timing := p.timing.Load()
		if n > 0 && timing {
			for _, msgs := range got {
				for _, msg := range msgs {
					if !isTimed(msg) {
						continue // left over from an earlier workload
					}
					if err := p.send(ctrl.Message{Kind: "seen", Data: msg, Ints: map[string]int64{"t": seen}}); err != nil {
						p.pollErr.Store(&err)
						return
					}
				}
			}
		}
		clear(tmp)
		select {
		case <-p.stop:
			return
		default:
		}
		switch {
		case work || n > 0:
			continue
		case timing && p.mode != "locked":
			schedYield()
			continue
		case p.mode == "raw":
			p.sleepOnEngine()
			continue
		}
		select {
		case <-p.stop:
			return
		case <-tick.C:
		}
	}
}

// progress stands for the progress thread NIXL runs in vLLM's process: it
// sleeps until the locked producer's engine has work (its event fd), then
// progresses it under the engine lock until it has none. The
// notifications it receives it keeps (held), as NIXL's thread keeps them
// in its backend, until poll's next step takes them: left in the engine,
// they kept the engine from arming, and the thread slept instead of
// progressing requests that came meanwhile (Go rounds a 50 µs sleep of
// an idle process up to about a millisecond), where NIXL's thread
// progresses again at once.
func (p *producer) progress() {
	defer close(p.progDone)
	a := p.side.agent
	fd := a.EventFD()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		p.mu.Lock()
		work, _ := a.Progress()
		a.GetNotifs(p.held)
		armed := false
		if !work && fd >= 0 {
			ok, err := a.Arm()
			armed = err == nil && ok
		}
		p.mu.Unlock()
		switch {
		case work:
		case armed:
			_, _ = unix.Poll(fds, int(stepInterval/time.Millisecond))
		case fd < 0:
			time.Sleep(50 * time.Microsecond)
		default:
			// Events the engine has not taken yet (it could not arm):
			// progress again, as NIXL's thread does.
			runtime.Gosched()
		}
	}
}

// sleepOnEngine waits up to one step for the raw producer's engine to have
// work: arm its event fd and poll it.
func (p *producer) sleepOnEngine() {
	a := p.side.agent
	fd := a.EventFD()
	if fd < 0 {
		time.Sleep(stepInterval)
		return
	}
	if ok, err := a.Arm(); err != nil || !ok {
		return
	}
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	_, _ = unix.Poll(fds, int(stepInterval/time.Millisecond))
}

func (p *producer) close() error {
	close(p.stop)
	<-p.done
	if p.progDone != nil {
		<-p.progDone
	}
	if p.tr != nil {
		if p.hook != nil {
			p.hook(p.tr, false)
		}
		return p.tr.Deregister()
	}
	return p.side.agent.Close()
}

// timedMagic starts the notification of every notif-workload READ, so the
// producer reports those and no stragglers of earlier workloads.
const timedMagic = "ecxbNTF:"

func isTimed(msg []byte) bool { return len(msg) == 16 && string(msg[:8]) == timedMagic }

// isPipe reports whether descriptor fd is open and a pipe.
func isPipe(fd int) bool {
	var st unix.Stat_t
	return unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFIFO
}
