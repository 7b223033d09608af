package ecxfer

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/internal/shmview"
)

// Two processes: this test binary re-executed as a producer. The producer
// creates a UCX transport over pattern-filled blocks, sends its metadata on
// stdout, and then only ever calls NewNotifs, reporting each notification
// back; everything else its side of a READ needs is the reactor's job.

const roleEnv = "ECXFER_TEST_ROLE"

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) != "" {
		keepCtrlOut()
	}
	switch os.Getenv(roleEnv) {
	case "producer":
		os.Exit(runTestProducer())
	case "consumer":
		os.Exit(runTestConsumer())
	case "hugeregion":
		os.Exit(runHugeRegion())
	case "fdcheck":
		os.Exit(runFdCheck())
	}
	os.Exit(m.Run())
}

// ctrlOut is a role's control channel: a duplicate of the pipe on fd 1.
var ctrlOut *os.File

// keepCtrlOut moves the control channel off file descriptor 1: UCX logs
// to stdout, and a log line in the channel would break its framing. From
// here on ctrlOut is a duplicate of the pipe and fd 1 goes to stderr
// (ctrl.TakeStdout). os.Stdout must not be replaced by ctrlOut: the
// collector then closed fd 1, a socket took the number, and UCX's log
// lines went into a TCP stream, where the peer's transport aborted on the
// garbled framing (TestCtrlOutKeepsStdout).
func keepCtrlOut() {
	var err error
	if ctrlOut, err = ctrl.TakeStdout(); err != nil {
		panic(err)
	}
}

func envInt(name string) int {
	v, err := strconv.Atoi(os.Getenv(name))
	if err != nil {
		panic(fmt.Sprintf("%s: %v", name, err))
	}
	return v
}

func runTestProducer() int {
	c := ctrl.New(os.Stdin, ctrlOut)
	fail := func(err error) int {
		_ = c.Send(ctrl.Message{Kind: "error", Strs: map[string]string{"error": err.Error()}})
		return 1
	}
	bs, nb, seed := envInt("ECX_BS"), envInt("ECX_NB"), uint64(envInt("ECX_SEED"))
	cfg := Config{AgentName: os.Getenv("ECX_NAME"), BlockSize: bs, NumBlocks: nb}
	if os.Getenv("ECX_REGION") == "mmap" {
		region, err := unix.Mmap(-1, 0, bs*nb, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			return fail(err)
		}
		cfg.Region = region
	}
	if path := os.Getenv("ECX_SHM_PATH"); os.Getenv("ECX_REGION") == "shm" {
		// A MAP_SHARED mapping of a /dev/shm file, like vLLM's region.
		region, err := shmview.MapNewFile(path, bs*nb)
		if err != nil {
			return fail(err)
		}
		cfg.Region = region
	}
	cfg.NoGather = os.Getenv("ECX_NOGATHER") == "1"
	switch os.Getenv("ECX_DIRECT") {
	case "1":
		cfg.Direct = DirectOn
	case "0":
		cfg.Direct = DirectOff // no advertisement: consumers read it through the engine
	}
	tr, err := New(cfg)
	if err != nil {
		return fail(err)
	}
	defer tr.Deregister()
	pattern.FillRegion(tr.Region(), seed, bs)
	if err := c.Send(ctrl.Message{Kind: "hello", Name: cfg.AgentName, Metadata: tr.AgentMetadata(), MemDesc: tr.MemDescriptor()}); err != nil {
		return fail(err)
	}
	// Commands arrive on stdin; the consumer closes stdin when it is done.
	cmds := make(chan ctrl.Message, 16)
	go func() {
		for {
			m, err := c.Recv()
			if err != nil {
				close(cmds)
				return
			}
			cmds <- m
		}
	}()
	for {
		for sender, msgs := range tr.NewNotifs() {
			for _, m := range msgs {
				if err := c.Send(ctrl.Message{Kind: "notif", Name: sender, Data: m}); err != nil {
					return fail(err)
				}
			}
		}
		select {
		case m, ok := <-cmds:
			if !ok {
				if err := tr.Deregister(); err != nil {
					return fail(err)
				}
				return 0
			}
			if err := c.Send(producerCommand(tr, m, seed, bs)); err != nil {
				return fail(err)
			}
		case <-time.After(time.Millisecond):
		}
	}
}

type producerProc struct {
	cmd   *exec.Cmd
	conn  *ctrl.Conn
	stdin interface{ Close() error }
	hello ctrl.Message
}

func startProducer(t *testing.T, name string, bs, nb int, seed uint64, region string, extraEnv ...string) *producerProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=producer", "ECX_NAME="+name,
		"ECX_BS="+strconv.Itoa(bs), "ECX_NB="+strconv.Itoa(nb),
		"ECX_SEED="+strconv.FormatUint(seed, 10), "ECX_REGION="+region)
	cmd.Env = append(cmd.Env, extraEnv...)
	stdin, stdout, err := ctrl.StartPiped(cmd)
	require.NoError(t, err)
	p := &producerProc{cmd: cmd, conn: ctrl.New(stdout, stdin), stdin: stdin}
	t.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		_ = stdout.Close()
	})
	p.hello, err = p.conn.Expect("hello")
	require.NoError(t, err)
	return p
}

// TestTwoProcessRead: a consumer reads 880 random blocks of a producer
// process and verifies every byte and the notification, on UCX (the engine
// path over shared memory for an engine-allocated region, over tcp for
// both kinds of region) and on the direct path the ucx
// backend takes by default for same-host peers.
func TestTwoProcessRead(t *testing.T) {
	for _, c := range []struct {
		name, region, tls string
		path              string
	}{
		{"alloc", "alloc", "", "engine"},
		{"mmap-tcp", "mmap", "tcp", "engine"}, // over shared memory refused (TestEngineRefusesSharedQueuePeer)
		{"tcp", "alloc", "tcp", "engine"},
		{"direct-alloc", "alloc", "", "direct-sysv"},
		{"direct-mmap", "mmap", "", "direct-proc"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var env []string
			if c.tls != "" {
				env = append(env, "UCX_TLS="+c.tls)
				t.Setenv("UCX_TLS", c.tls)
			}
			leakcheck.Check(t)
			const bs, nb, seed = 5120, 1024, 42
			pname := uniqueName("xproc-prod")
			p := startProducer(t, pname, bs, nb, seed, c.region, env...)
			cfg := Config{AgentName: uniqueName("xproc-cons"), BlockSize: bs, NumBlocks: nb}
			if c.path == "engine" {
				cfg.Direct = DirectOff
			}
			cons, err := New(cfg)
			require.NoError(t, err)
			defer func() { require.NoError(t, cons.Deregister()) }()
			got, err := cons.AddRemotePeer(p.hello.Metadata, p.hello.MemDesc)
			require.NoError(t, err)
			require.Equal(t, pname, got)
			require.Equal(t, c.path, cons.PeerPath(pname))

			rng := rand.New(rand.NewSource(seed))
			remote := rng.Perm(nb)[:880]
			local := rng.Perm(nb)[:880]
			msg := []byte("session:hash")
			h, err := cons.PostRead(local, pname, remote, msg)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			require.NoError(t, cons.Wait(ctx, h))
			for i := range local {
				ok, off := pattern.Check(cons.Region()[local[i]*bs:(local[i]+1)*bs], seed, remote[i])
				require.True(t, ok, "local block %d (remote %d) differs at byte %d", local[i], remote[i], off)
			}
			require.NoError(t, cons.ReleaseXferHandle(h))

			n, err := p.conn.Expect("notif")
			require.NoError(t, err)
			require.Equal(t, cons.cfg.AgentName, n.Name)
			require.Equal(t, msg, n.Data)
			require.Equal(t, int64(0), cons.Stats().LiveHandles)
		})
	}
}
