package ecxfer

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/pattern"
)

// The roles this test binary plays when re-executed (see TestMain), and the
// test side of driving them. A producer answers commands between
// notifications; a consumer is driven entirely by commands.

// producerCommand answers one command sent to a producer process.
func producerCommand(tr *Transport, m ctrl.Message, seed uint64, bs int) ctrl.Message {
	switch m.Kind {
	case "stats":
		return ctrl.Message{Kind: "stats", Ints: statsInts(tr.Stats())}
	case "deregister":
		if err := tr.Deregister(); err != nil {
			return errMsg(err)
		}
		return ctrl.Message{Kind: "deregistered"}
	case "verify":
		bad := int64(-1)
		region := tr.Region()
		for i := 0; (i+1)*bs <= len(region); i++ {
			if ok, _ := pattern.Check(region[i*bs:(i+1)*bs], seed, i); !ok {
				bad = int64(i)
				break
			}
		}
		return ctrl.Message{Kind: "verify", Ints: map[string]int64{"bad": bad}}
	}
	return errMsg(fmt.Errorf("unknown command %q", m.Kind))
}

func statsInts(s Stats) map[string]int64 {
	return map[string]int64{
		"posted": int64(s.ReadsPosted), "done": int64(s.ReadsDone), "failed": int64(s.ReadsFailed),
		"canceled": int64(s.ReadsCanceled), "live": s.LiveHandles, "inflight": s.InFlight,
		"peers": int64(s.Peers), "loops": int64(s.LoopTurns), "parks": int64(s.Parks),
		"notifs":  int64(s.NotifsReceived),
		"gserved": int64(s.Gathers.Served), "gdropped": int64(s.Gathers.Dropped),
	}
}

func errMsg(err error) ctrl.Message {
	return ctrl.Message{Kind: "error", Strs: map[string]string{"error": err.Error()}}
}

// monoNow is CLOCK_MONOTONIC in nanoseconds: the same clock in every
// process of the machine, whatever network namespace it runs in.
func monoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// runTestConsumer is the consumer role: a transport of ECX_NB blocks that
// adds peers, reads and streams reads on command.
func runTestConsumer() int {
	c := ctrl.New(os.Stdin, ctrlOut)
	bs, nb := envInt("ECX_BS"), envInt("ECX_NB")
	cfg := Config{AgentName: os.Getenv("ECX_NAME"), BlockSize: bs, NumBlocks: nb, NoGather: os.Getenv("ECX_NOGATHER") == "1"}
	if v := os.Getenv("ECX_XFER_MS"); v != "" {
		ms, _ := strconv.Atoi(v)
		cfg.XferTimeout = time.Duration(ms) * time.Millisecond
	}
	tr, err := New(cfg)
	if err != nil {
		_ = c.Send(errMsg(err))
		return 1
	}
	defer tr.Deregister()
	if err := c.Send(ctrl.Message{Kind: "hello", Name: cfg.AgentName}); err != nil {
		return 1
	}
	var st *stream
	for {
		m, err := c.Recv()
		if err != nil {
			if st != nil {
				st.halt()
			}
			if err := tr.Deregister(); err != nil {
				return 1
			}
			return 0
		}
		var reply ctrl.Message
		switch m.Kind {
		case "add":
			name, err := tr.AddRemotePeer(m.Metadata, m.MemDesc)
			reply = ctrl.Message{Kind: "added", Name: name}
			if err != nil {
				reply = errMsg(err)
			}
		case "remove":
			reply = ctrl.Message{Kind: "removed"}
			if err := tr.RemoveRemotePeer(m.Name); err != nil {
				reply = errMsg(err)
			}
		case "read":
			start := time.Now()
			err := consumerRead(tr, m.Name, int(m.Ints["n"]), uint64(m.Ints["seed"]), int(m.Ints["count"]), bs, nb, int(m.Ints["rnb"]))
			reply = ctrl.Message{Kind: "read", Ints: map[string]int64{"ns": int64(time.Since(start))}}
			if err != nil {
				reply = errMsg(err)
			}
		case "stream":
			st = startStream(tr, m.Name, int(m.Ints["n"]), int(m.Ints["depth"]), uint64(m.Ints["seed"]), bs, int(m.Ints["rnb"]))
			<-st.started
			reply = ctrl.Message{Kind: "streaming"}
		case "stop":
			reply = ctrl.Message{Kind: "stopped", Ints: st.stop(m.Ints["t0"])}
		default:
			reply = errMsg(fmt.Errorf("unknown command %q", m.Kind))
		}
		if err := c.Send(reply); err != nil {
			return 1
		}
	}
}

// consumerRead reads count times n random blocks and verifies them.
func consumerRead(tr *Transport, peer string, n int, seed uint64, count, bs, nb, rnb int) error {
	rng := rand.New(rand.NewSource(int64(seed) + time.Now().UnixNano()))
	for k := 0; k < count; k++ {
		remote := rng.Perm(rnb)[:n]
		local := rng.Perm(nb)[:n]
		h, err := tr.PostRead(local, peer, remote, nil)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = tr.Wait(ctx, h)
		cancel()
		_ = tr.ReleaseXferHandle(h)
		if err != nil {
			return err
		}
		for i := range local {
			if ok, off := pattern.Check(tr.Region()[local[i]*bs:(local[i]+1)*bs], seed, remote[i]); !ok {
				return fmt.Errorf("block %d (remote %d) differs at byte %d", local[i], remote[i], off)
			}
		}
	}
	return nil
}

// stream keeps depth reads of n blocks in flight until stopped. Slot k of
// the depth owns local blocks [k*n, (k+1)*n), so DONE reads can be checked.
type stream struct {
	started chan struct{}
	out     chan map[string]int64
	t0      chan int64
	once    sync.Once
}

type streamRead struct {
	h      Handle
	slot   int
	remote []int
	posted int64
}

func startStream(tr *Transport, peer string, n, depth int, seed uint64, bs, rnb int) *stream {
	s := &stream{started: make(chan struct{}), out: make(chan map[string]int64, 1), t0: make(chan int64, 1)}
	go func() {
		rng := rand.New(rand.NewSource(int64(seed)))
		res := map[string]int64{}
		var out []streamRead
		free := make([]int, 0, depth)
		for k := depth - 1; k >= 0; k-- {
			free = append(free, k)
		}
		var t0 int64 = -1
		posting := true
		started := false
		deadline := time.Time{}
		for {
			select {
			case t := <-s.t0:
				t0, posting = t, false
				deadline = time.Now().Add(60 * time.Second)
			default:
			}
			for posting && len(free) > 0 {
				slot := free[len(free)-1]
				local := make([]int, n)
				for i := range local {
					local[i] = slot*n + i
				}
				remote := rng.Perm(rnb)[:n]
				h, err := tr.PostRead(local, peer, remote, nil)
				if err != nil {
					res["posterr"]++
					time.Sleep(time.Millisecond)
					break
				}
				free = free[:len(free)-1]
				out = append(out, streamRead{h: h, slot: slot, remote: remote, posted: monoNow()})
				res["posted"]++
			}
			if !started && len(free) == 0 {
				started = true
				close(s.started)
			}
			keep := out[:0]
			for _, r := range out {
				st, err := tr.CheckXferState(r.h)
				if st == StateProc {
					keep = append(keep, r)
					continue
				}
				end := monoNow()
				switch {
				case st == StateDone:
					res["done"]++
					// A sample keeps the stream streaming: the first, the
					// last and two random blocks.
					for _, i := range []int{0, n - 1, rng.Intn(n), rng.Intn(n)} {
						li := r.slot*n + i
						if ok, _ := pattern.Check(tr.Region()[li*bs:(li+1)*bs], seed, r.remote[i]); !ok {
							res["corrupt"]++
							break
						}
					}
				case errors.Is(err, ErrRemoteDisconnect):
					res["disc"]++
				case errors.Is(err, ErrTimeout):
					res["timeout"]++
				case errors.Is(err, ErrCanceled):
					res["canceled"]++
				default:
					res["other"]++
				}
				if t0 >= 0 && end > t0 {
					// In flight at some point after t0.
					res["after"]++
					if st == StateErr {
						res["afterErr"]++
					}
					if d := end - t0; d > res["maxEnd"] {
						res["maxEnd"] = d
					}
					if d := end - max(r.posted, t0); d > res["maxLife"] {
						res["maxLife"] = d
					}
				}
				_ = tr.ReleaseXferHandle(r.h)
				free = append(free, r.slot)
			}
			out = keep
			if !posting && (len(out) == 0 || time.Now().After(deadline)) {
				res["stuck"] = int64(len(out))
				for _, r := range out {
					_ = tr.ReleaseXferHandle(r.h)
				}
				if !started {
					close(s.started)
				}
				s.out <- res
				return
			}
			time.Sleep(200 * time.Microsecond)
		}
	}()
	return s
}

// stop ends posting. Reads that end after t0 (CLOCK_MONOTONIC ns) are
// reported separately: how many ("after"), how many in ERR ("afterErr"),
// the last end after t0 ("maxEnd") and the longest time one of them spent
// in flight after t0 ("maxLife").
func (s *stream) stop(t0 int64) map[string]int64 {
	var res map[string]int64
	s.once.Do(func() {
		s.t0 <- t0
		res = <-s.out
	})
	return res
}

// halt stops the stream if it still runs.
func (s *stream) halt() { s.stop(monoNow()) }

// roleProc is a re-executed test binary seen from the test.
type roleProc struct {
	t      testing.TB
	cmd    *exec.Cmd
	conn   *ctrl.Conn
	stdin  interface{ Close() error }
	hello  ctrl.Message
	notifs []ctrl.Message
	exited chan struct{}
}

// startRole runs this test binary as role, behind the prefix command (e.g.
// ip netns exec NS), with env added to the environment.
func startRole(t testing.TB, prefix []string, role string, env ...string) *roleProc {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	argv := append(append([]string(nil), prefix...), exe, "-test.run=^$")
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), roleEnv+"="+role), env...)
	stdin, stdout, err := ctrl.StartPiped(cmd)
	require.NoError(t, err)
	p := &roleProc{t: t, cmd: cmd, conn: ctrl.New(stdout, stdin), stdin: stdin, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		_ = stdin.Close()
		select {
		case <-p.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Signal(syscall.SIGCONT)
			_ = cmd.Process.Kill()
			<-p.exited
		}
		_ = stdout.Close()
	})
	p.hello, err = p.conn.Expect("hello")
	require.NoError(t, err)
	return p
}

// startTestProducer runs a producer role of nb blocks of bs bytes filled
// with seed's pattern; region is "alloc" or "mmap".
func startTestProducer(t testing.TB, prefix []string, name string, bs, nb int, seed uint64, region string, env ...string) *roleProc {
	return startRole(t, prefix, "producer", append([]string{"ECX_NAME=" + name,
		"ECX_BS=" + strconv.Itoa(bs), "ECX_NB=" + strconv.Itoa(nb),
		"ECX_SEED=" + strconv.FormatUint(seed, 10), "ECX_REGION=" + region}, env...)...)
}

// request sends m and returns the reply of kind want, keeping the
// notifications that arrive meanwhile.
func (p *roleProc) request(m ctrl.Message, want string) (ctrl.Message, error) {
	if err := p.conn.Send(m); err != nil {
		return ctrl.Message{}, err
	}
	for {
		r, err := p.conn.Recv()
		if err != nil {
			return r, err
		}
		switch r.Kind {
		case "notif":
			p.notifs = append(p.notifs, r)
			continue
		case "error":
			return r, fmt.Errorf("%s", r.Strs["error"])
		case want:
			return r, nil
		}
		return r, fmt.Errorf("got %q, want %q", r.Kind, want)
	}
}

func (p *roleProc) signal(sig syscall.Signal) {
	p.t.Helper()
	require.NoError(p.t, p.cmd.Process.Signal(sig))
}

// waitStopped waits until the process is in the stopped state (SIGSTOP is
// delivered asynchronously).
func (p *roleProc) waitStopped() {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
		require.NoError(p.t, err)
		if i := strings.LastIndexByte(string(b), ')'); i > 0 && len(b) > i+2 && (b[i+2] == 'T' || b[i+2] == 't') {
			return
		}
		time.Sleep(time.Millisecond)
	}
	p.t.Fatalf("process %d not stopped after 10s", p.cmd.Process.Pid)
}

// kill sends SIGKILL and waits for the process to be gone; it returns the
// time the signal was sent.
func (p *roleProc) kill() time.Time {
	p.t.Helper()
	at := time.Now()
	require.NoError(p.t, p.cmd.Process.Kill())
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.t.Fatalf("process %d survived SIGKILL for 10s", p.cmd.Process.Pid)
	}
	return at
}

// cpuTime returns the process's user+system CPU time.
func (p *roleProc) cpuTime() time.Duration {
	p.t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	require.NoError(p.t, err)
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	ut, err := strconv.ParseUint(f[11], 10, 64) // field 14
	require.NoError(p.t, err)
	stt, err := strconv.ParseUint(f[12], 10, 64) // field 15
	require.NoError(p.t, err)
	return time.Duration(ut+stt) * time.Second / 100 // USER_HZ
}
