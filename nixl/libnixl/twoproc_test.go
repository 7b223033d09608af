package libnixl

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/nixl"
)

// Two processes: the test binary re-executes itself as a producer that
// owns a block region and pumps its agent until its stdin closes; the
// parent reads from it as a consumer.

const childEnv = "ECXFER_LIBNIXL_CHILD"

func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		exit(runChild(spec))
	}
	exit(m.Run())
}

// exit ends the process without running C's exit handlers. Under the race
// detector os.Exit ends in libc's exit(), which runs the destructors of
// every loaded library, and one of those the NIXL wheel brings in (its
// libnl-route, loaded by its UCX's InfiniBand module) crashes there
// (SIGSEGV in rtnl_tc_unregister). A plain Go binary never calls exit(),
// so only -race test binaries need this. Races found during the tests
// have already failed them.
func exit(code int) { syscall.Exit(code) }

// runChild is the producer: spec is "name,blockSize,numBlocks,seed". It
// prints "MD <hex>" and "BASE <addr>", then "NOTIF <sender> <hex>" per
// notification, until stdin closes.
func runChild(spec string) int {
	// Lines go to a duplicate of stdout; UCX's log lines, printed to
	// stdout, reach stderr instead of the parent's line reader.
	stdout, err := ctrl.TakeStdout()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// A line printed to fd 1, as UCX prints its log lines: the parent
	// must not find it among the child's lines.
	_, _ = syscall.Write(1, []byte("child: a line printed to stdout\n"))
	f := strings.Split(spec, ",")
	bs, _ := strconv.Atoi(f[1])
	nb, _ := strconv.Atoi(f[2])
	seed, _ := strconv.ParseInt(f[3], 10, 64)
	a, err := New(Config{Name: f[0]})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer a.Close()
	_, buf, err := a.AllocMem(bs*nb, nixl.DRAM, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rand.New(rand.NewSource(seed)).Read(buf)
	md, err := a.LocalMetadata()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	out := bufio.NewWriter(stdout)
	fmt.Fprintf(out, "MD %x\nBASE %d\n", md, uintptr(unsafePointer(buf)))
	out.Flush()
	eof := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(eof)
	}()
	notifs := map[string][][]byte{}
	for {
		select {
		case <-eof:
			return 0
		default:
		}
		_, _ = a.Progress()
		if a.GetNotifs(notifs) > 0 {
			for k, v := range notifs {
				for _, m := range v {
					fmt.Fprintf(out, "NOTIF %s %x\n", k, m)
				}
			}
			clear(notifs)
			out.Flush()
		} else {
			time.Sleep(20 * time.Microsecond)
		}
	}
}

type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	md    []byte
	base  uint64
}

func startChild(t *testing.T, name string, bs, nb int, seed int64) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s,%d,%d,%d", childEnv, name, bs, nb, seed))
	stdin, stdout, err := ctrl.StartPiped(cmd)
	require.NoError(t, err)
	c := &child{cmd: cmd, stdin: stdin, lines: make(chan string, 1024)}
	t.Cleanup(func() {
		_ = c.stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		_ = stdout.Close()
	})
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<24)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	c.md, err = hex.DecodeString(strings.TrimPrefix(c.next(t, "MD "), "MD "))
	require.NoError(t, err)
	c.base, err = strconv.ParseUint(strings.TrimPrefix(c.next(t, "BASE "), "BASE "), 10, 64)
	require.NoError(t, err)
	return c
}

func (c *child) next(t *testing.T, prefix string) string {
	t.Helper()
	select {
	case l, ok := <-c.lines:
		require.True(t, ok, "the producer exited")
		require.True(t, strings.HasPrefix(l, prefix), "got %q, want %s...", l, prefix)
		return l
	case <-time.After(20 * time.Second):
		t.Fatalf("no %q line from the producer", prefix)
	}
	return ""
}

func TestTwoProcessRead(t *testing.T) {
	needNIXL(t)
	const bs, nb, seed = 5120, 1000, 42
	pname := testName("prod")
	ch := startChild(t, pname, bs, nb, seed)
	cons := newSide(t, testName("cons"), bs, nb)
	name, err := cons.a.LoadRemoteMetadata(ch.md)
	require.NoError(t, err)
	require.Equal(t, pname, name)
	rdl, err := cons.a.PrepDlist(name, descriptors.BuildBlockDescs(ch.base, nb, bs, 0), nixl.DRAM)
	require.NoError(t, err)

	want := make([]byte, bs*nb)
	rand.New(rand.NewSource(seed)).Read(want)
	rng := rand.New(rand.NewSource(7))
	pm := newPump(cons.a)
	for round := 0; round < 3; round++ {
		local, remote := rng.Perm(nb)[:880], rng.Perm(nb)[:880]
		clear(cons.buf)
		msg := []byte(fmt.Sprintf("session:%016x", rng.Uint64()))
		id, err := cons.a.MakeXfer(nixl.Read, cons.local, local, rdl, remote, msg)
		require.NoError(t, err)
		require.NoError(t, cons.a.PostXfer(id))
		pm.until(t, "the read", pm.done(id))
		require.NoError(t, pm.comps[id])
		for i := range local {
			require.Equal(t, want[remote[i]*bs:(remote[i]+1)*bs], cons.block(local[i]), "block %d", i)
		}
		l := ch.next(t, "NOTIF ")
		require.Equal(t, fmt.Sprintf("NOTIF %s %x", cons.a.Name(), msg), l)
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
}
