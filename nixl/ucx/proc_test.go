package ucx

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/nixl"
)

// Two-process tests re-execute the test binary; TestMain turns the child
// into a producer when ECX_UCX_ROLE is set. Parent and child talk over the
// child's stdin/stdout in frames: [type byte][len uint32 LE][payload].
//
// Child -> parent: 'M' metadata, 'N' notification (name, 0, message),
// 'A' command acknowledged. Parent -> child: 'M' consumer metadata,
// 'S' stop progressing, 'R' resume, 'Q' quit.

const roleEnv = "ECX_UCX_ROLE"

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "producer" {
		if err := runProducer(); err != nil {
			fmt.Fprintln(os.Stderr, "producer:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	if os.Getenv(roleEnv) == "new-agent" {
		// Makes one agent and closes it; TestNoConfigWarnings reads
		// what UCX printed.
		a, err := New(Config{Name: "config-check"})
		if err == nil {
			err = a.Close()
		}
		FlushCStdio()
		if err != nil {
			fmt.Fprintln(os.Stderr, "new-agent:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func writeFrame(w io.Writer, typ byte, payload []byte) error {
	var h [5]byte
	h[0] = typ
	binary.LittleEndian.PutUint32(h[1:], uint32(len(payload)))
	if _, err := w.Write(h[:]); err != nil {
		return err
	}
	_, err := w.Write(payload)
	return err
}

func readFrame(r io.Reader) (byte, []byte, error) {
	var h [5]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	n := binary.LittleEndian.Uint32(h[1:])
	if n > 64<<20 {
		return 0, nil, fmt.Errorf("frame of %d bytes", n)
	}
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	return h[0], b, err
}

type frame struct {
	typ byte
	b   []byte
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// runProducer is the child: it allocates (or registers) a region filled
// with the seeded pattern, publishes its metadata, loads the consumer's and
// progresses its agent until told to quit, forwarding notifications.
func runProducer() error {
	// Frames go to a duplicate of stdout; UCX's log lines, printed to
	// stdout, reach stderr instead of the frame stream.
	stdout, err := ctrl.TakeStdout()
	if err != nil {
		return err
	}
	// A line printed to fd 1, as UCX prints its log lines: every test of
	// a producer child checks that the frame stream does not carry it.
	_, _ = unix.Write(1, []byte("producer child: a line printed to stdout\n"))
	cfg := Config{Name: os.Getenv("ECX_NAME"), ErrMode: ErrMode(envInt("ECX_ERRMODE", 0))}
	a, err := New(cfg)
	if err != nil {
		return err
	}
	defer a.Close()
	n := envInt("ECX_BLOCK", testBlock) * envInt("ECX_BLOCKS", testBlocks)
	var buf []byte
	if os.Getenv("ECX_ALLOC") == "1" {
		if _, buf, err = a.AllocMem(n, nixl.DRAM, 0); err != nil {
			return err
		}
	} else {
		if buf, err = unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
			return err
		}
		if _, err = a.RegisterMem(buf, nixl.DRAM, 0); err != nil {
			return err
		}
	}
	fillBlocks(buf, envInt("ECX_BLOCK", testBlock), uint64(envInt("ECX_SEED", 1)))
	md, err := a.LocalMetadata()
	if err != nil {
		return err
	}
	out := bufio.NewWriter(stdout)
	send := func(typ byte, b []byte) error {
		if err := writeFrame(out, typ, b); err != nil {
			return err
		}
		return out.Flush()
	}
	if err := send('M', md); err != nil {
		return err
	}
	// With ECX_PARK=1 the child sleeps like a parked reactor: after the
	// first turn without work it arms the agent and waits, without a
	// timeout, for the agent's descriptor or a command (cmdFD). Woken, it
	// first tries to arm again, as a reactor does that was woken for
	// something else while a message arrived: the window in which UCX's
	// wake-up of an idle interface is taken before that interface's
	// message is.
	park := os.Getenv("ECX_PARK") == "1"
	woken := false
	cmdFD, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return err
	}
	// cmdFD is not closed: the stdin reader below may still write to it
	// after this returns, and the process exits right after.
	cmds := make(chan frame, 16)
	go func() {
		one := []byte{1, 0, 0, 0, 0, 0, 0, 0}
		in := bufio.NewReader(os.Stdin)
		for {
			t, b, err := readFrame(in)
			if err != nil {
				cmds <- frame{typ: 'Q'}
				_, _ = unix.Write(cmdFD, one)
				return
			}
			cmds <- frame{t, b}
			_, _ = unix.Write(cmdFD, one)
		}
	}()
	sleepFD, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return err
	}
	defer unix.Close(sleepFD)
	for _, fd := range []int{a.EventFD(), cmdFD} {
		if err := unix.EpollCtl(sleepFD, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			return err
		}
	}
	events := make([]unix.EpollEvent, 4)
	sleep := func(timeout int) {
		_, _ = unix.EpollWait(sleepFD, events, timeout)
		var b [8]byte
		_, _ = unix.Read(cmdFD, b[:])
	}
	notifs := map[string][][]byte{}
	quiet := os.Getenv("ECX_QUIET") == "1"
	idle := 0
	stalled := false
	for {
		var cmd frame
		select {
		case cmd = <-cmds:
		default:
			if stalled {
				cmd = <-cmds
			}
		}
		switch cmd.typ {
		case 'M':
			if _, err := a.LoadRemoteMetadata(cmd.b); err != nil {
				return err
			}
			if err := send('A', nil); err != nil {
				return err
			}
		case 'S':
			stalled = true
			if err := send('A', nil); err != nil {
				return err
			}
			continue
		case 'R':
			stalled = false
			if err := send('A', nil); err != nil {
				return err
			}
		case 'Q':
			return nil
		case 'W':
			// The frame woke a parked child (child.wake): progress
			// before arming again.
			woken = false
		}
		if woken {
			woken = false
			if armed, err := a.Arm(); err != nil {
				return err
			} else if armed {
				sleep(-1)
				woken = true
				continue
			}
		}
		did, err := a.Progress()
		if err != nil {
			return err
		}
		if a.GetNotifs(notifs) > 0 {
			for name, msgs := range notifs {
				if quiet {
					break
				}
				for _, m := range msgs {
					if err := send('N', append(append([]byte(name), 0), m...)); err != nil {
						return err
					}
				}
			}
			clear(notifs)
			did = true
		}
		if did {
			idle = 0
			continue
		}
		if idle++; idle < 2000 && !park {
			continue
		}
		if armed, err := a.Arm(); err != nil {
			return err
		} else if armed {
			timeout := 5 // short sleeps keep the command channel responsive
			if park {
				timeout = -1
			}
			sleep(timeout)
			woken = park
		}
	}
}

// child is a running producer process seen from the test.
type child struct {
	t      testing.TB
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout io.Closer // closed by stop, once the reader has seen the end
	md     []byte
	notifs chan frame // 'N' frames
	acks   chan frame
	wg     sync.WaitGroup
	waited bool
}

type childOpts struct {
	name    string
	seed    int
	block   int
	blocks  int
	alloc   bool
	tls     string
	errMode ErrMode
	quiet   bool // drop notifications instead of forwarding them
	park    bool // sleep without a timeout whenever a turn finds no work
}

func startChild(t testing.TB, o childOpts) *child {
	t.Helper()
	if o.block == 0 {
		o.block = testBlock
	}
	if o.blocks == 0 {
		o.blocks = testBlocks
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		roleEnv+"=producer",
		"ECX_NAME="+o.name,
		"ECX_SEED="+strconv.Itoa(o.seed),
		"ECX_BLOCK="+strconv.Itoa(o.block),
		"ECX_BLOCKS="+strconv.Itoa(o.blocks),
		"ECX_ERRMODE="+strconv.Itoa(int(o.errMode)),
	)
	if o.alloc {
		cmd.Env = append(cmd.Env, "ECX_ALLOC=1")
	}
	if o.quiet {
		cmd.Env = append(cmd.Env, "ECX_QUIET=1")
	}
	if o.park {
		cmd.Env = append(cmd.Env, "ECX_PARK=1")
	}
	if o.tls != "" {
		cmd.Env = append(cmd.Env, "UCX_TLS="+o.tls)
	}
	stdin, stdout, err := ctrl.StartPiped(cmd)
	require.NoError(t, err)
	c := &child{t: t, cmd: cmd, stdin: stdin, stdout: stdout, notifs: make(chan frame, 1024), acks: make(chan frame, 16)}
	typ, md, err := readFrame(stdout)
	require.NoError(t, err)
	require.Equal(t, byte('M'), typ)
	c.md = md
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(c.notifs)
		for {
			typ, b, err := readFrame(stdout)
			if err != nil {
				return
			}
			switch typ {
			case 'N':
				c.notifs <- frame{typ, b}
			case 'A':
				c.acks <- frame{typ, b}
			}
		}
	}()
	t.Cleanup(c.stop)
	return c
}

// command sends a command and, while waiting for its acknowledgement,
// keeps the parent's agent progressing (the child may need us to answer).
func (c *child) command(typ byte, payload []byte, a *Agent) {
	c.t.Helper()
	require.NoError(c.t, writeFrame(c.stdin, typ, payload))
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-c.acks:
			return
		default:
		}
		if a != nil {
			_, _ = a.Progress()
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	c.t.Fatalf("child did not acknowledge %q", typ)
}

// nextNotif waits for one notification from the child, progressing a.
func (c *child) nextNotif(a *Agent, timeout time.Duration) (string, []byte) {
	c.t.Helper()
	name, msg, ok := c.tryNotif(a, timeout)
	if !ok {
		c.t.Fatalf("no notification within %v", timeout)
	}
	return name, msg
}

// tryNotif is nextNotif reporting a timeout instead of failing.
func (c *child) tryNotif(a *Agent, timeout time.Duration) (string, []byte, bool) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case f, ok := <-c.notifs:
			require.True(c.t, ok, "child exited")
			for i, b := range f.b {
				if b == 0 {
					return string(f.b[:i]), f.b[i+1:], true
				}
			}
			c.t.Fatalf("bad notification frame")
		default:
		}
		if a != nil {
			_, _ = a.Progress()
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	return "", nil, false
}

// wake sends the child a frame it ignores; it wakes a child asleep on its
// descriptors (park), which then progresses its agent.
func (c *child) wake() {
	c.t.Helper()
	require.NoError(c.t, writeFrame(c.stdin, 'W', nil))
}

// noNotif asserts that no notification arrives within d.
func (c *child) noNotif(a *Agent, d time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		select {
		case f, ok := <-c.notifs:
			if ok {
				c.t.Fatalf("unexpected notification %q", f.b)
			}
		default:
		}
		_, _ = a.Progress()
	}
}

func (c *child) kill() {
	require.NoError(c.t, c.cmd.Process.Kill())
	_ = c.cmd.Wait()
	c.waited = true
}

func (c *child) stop() {
	defer func() { _ = c.stdout.Close() }()
	if c.waited {
		c.wg.Wait()
		return
	}
	_ = writeFrame(c.stdin, 'Q', nil)
	_ = c.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- c.cmd.Wait() }()
	select {
	case err := <-done:
		require.NoError(c.t, err, "producer exit")
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
		c.t.Errorf("producer did not quit")
	}
	c.waited = true
	c.wg.Wait()
}

// consumer is the parent's side of a two-process test.
type consumer struct {
	a      *Agent
	buf    []byte
	local  nixl.DlistID
	remote nixl.DlistID
	peer   string
	block  int
	blocks int
}

func newConsumer(t testing.TB, cfg Config, blocks, block int) *consumer {
	t.Helper()
	c := &consumer{a: newTestAgent(t, cfg), block: block, blocks: blocks}
	c.buf = mmapBuf(t, blocks*block)
	_, err := c.a.RegisterMem(c.buf, nixl.DRAM, 0)
	require.NoError(t, err)
	c.local, err = c.a.PrepDlist("", descriptors.BuildBlockDescs(addrOf(c.buf), blocks, uint64(block), 0), nixl.DRAM)
	require.NoError(t, err)
	return c
}

// connect loads the child's metadata, preps the remote list over the
// child's region and gives the child our metadata.
func (c *consumer) connect(t testing.TB, ch *child) {
	t.Helper()
	c.connectOneWay(t, ch)
	md, err := c.a.LocalMetadata()
	require.NoError(t, err)
	ch.command('M', md, c.a)
}

// connectOneWay is connect without giving the child our metadata, so the
// child has no endpoint to us (a vLLM producer's case).
func (c *consumer) connectOneWay(t testing.TB, ch *child) {
	t.Helper()
	m, err := decodeMetadata(ch.md)
	require.NoError(t, err)
	require.Len(t, m.Region, 1)
	c.peer, err = c.a.LoadRemoteMetadata(ch.md)
	require.NoError(t, err)
	c.remote, err = c.a.PrepDlist(c.peer, descriptors.BuildBlockDescs(m.Region[0].Addr, c.blocks, uint64(c.block), 0), nixl.DRAM)
	require.NoError(t, err)
}

// read posts one READ of remoteIdx into localIdx and waits for it.
func (c *consumer) read(t testing.TB, localIdx, remoteIdx []int, notif []byte) error {
	t.Helper()
	id, err := c.a.MakeXfer(nixl.Read, c.local, localIdx, c.remote, remoteIdx, notif)
	require.NoError(t, err)
	defer func() { require.NoError(t, c.a.ReleaseXfer(id)) }()
	require.NoError(t, c.a.PostXfer(id))
	return waitXfer(t, c.a, id, 20*time.Second)
}

func (c *consumer) verify(t testing.TB, seed uint64, localIdx, remoteIdx []int) {
	t.Helper()
	for k, li := range localIdx {
		got := c.buf[li*c.block : (li+1)*c.block]
		require.Equal(t, -1, checkBlock(got, seed, remoteIdx[k]), "local block %d <- remote %d", li, remoteIdx[k])
	}
}
