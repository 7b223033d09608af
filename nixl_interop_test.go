package ecxfer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl/libnixl"
)

// Interop with NIXL's own Python API: testdata/nixl_peer.py is a NIXL
// agent driven the way vLLM drives one, and ecxfer (Backend "nixl") is the
// other side, once as the consumer and once as the producer. It needs the
// NIXL engine library and the project's .venv with NIXL's wheel, numpy and
// msgpack (make nixl-venv); make test-nixl sets ECXFER_REQUIRE_NIXL=1,
// which turns anything missing into a failure.

const (
	interopPeer = "testdata/nixl_peer.py"
	interopStep = 30 * time.Second // bound on every wait for the peer
)

// interopPython is the Python that runs the peer: $VIRTUAL_ENV's, else the
// project's .venv (the test runs in the repository's root).
func interopPython() string {
	if v := os.Getenv(libnixl.EnvVenv); v != "" {
		return filepath.Join(v, "bin", "python")
	}
	return filepath.Join(libnixl.ProjectVenv, "bin", "python")
}

// interopByte is byte j of block i of the peer's pattern (see pattern() in
// nixl_peer.py).
func interopByte(seed uint64, i, j int) byte {
	return byte((seed ^ uint64(i)<<20 ^ uint64(j)) * 0x9E3779B97F4A7C15 >> 56)
}

func interopCheck(got []byte, seed uint64, i int) (bool, int) {
	for j := range got {
		if got[j] != interopByte(seed, i, j) {
			return false, j
		}
	}
	return true, -1
}

// requireNIXLPython skips the test unless both sides can run, or fails it
// when ECXFER_REQUIRE_NIXL=1.
func requireNIXLPython(t *testing.T) {
	t.Helper()
	why := ""
	if err := libnixl.Available(); err != nil {
		why = fmt.Sprintf("NIXL engine not available: %v", err)
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), interopStep)
		defer cancel()
		py := interopPython()
		out, err := exec.CommandContext(ctx, py, "-c",
			"import os, nixl._api, numpy, msgpack; os._exit(0)").CombinedOutput()
		if err != nil {
			// The last line of Python's traceback names the missing module.
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			why = fmt.Sprintf("%s cannot import nixl._api, numpy and msgpack (make nixl-venv "+
				"installs them): %v: %s", py, err, lines[len(lines)-1])
		}
	}
	if why == "" {
		return
	}
	if os.Getenv(libnixl.RequireEnv) == "1" {
		t.Fatalf("%s=1 but %s", libnixl.RequireEnv, why)
	}
	t.Skip(why)
}

// lockedBuffer collects the peer's stderr.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// pyPeer is a running nixl_peer.py.
type pyPeer struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []string
	stderr *lockedBuffer
	killed bool // killed on purpose: its exit status is not checked
}

// kill ends the peer with SIGKILL.
func (p *pyPeer) kill() {
	p.t.Helper()
	p.killed = true
	require.NoError(p.t, p.cmd.Process.Kill())
}

func startPyPeer(t *testing.T, role, name string, bs, nb int, seed uint64) *pyPeer {
	t.Helper()
	cmd := exec.Command(interopPython(), interopPeer, role, name,
		strconv.Itoa(bs), strconv.Itoa(nb), strconv.FormatUint(seed, 10))
	p := &pyPeer{t: t, name: name, cmd: cmd, lines: make(chan []string, 16), stderr: &lockedBuffer{}}
	cmd.Stderr = p.stderr
	stdin, stdout, err := ctrl.StartPiped(cmd)
	require.NoError(t, err)
	p.stdin = stdin
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			p.lines <- strings.Fields(sc.Text())
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		// Closing stdin tells the peer to exit; a peer that does not is
		// killed.
		_ = p.stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		var werr error
		select {
		case werr = <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			werr = <-done
			t.Errorf("python %s peer did not exit within 10s of its stdin closing; killed", role)
		}
		_ = stdout.Close()
		if werr != nil && !t.Failed() && !p.killed {
			t.Errorf("python %s peer: %v", role, werr)
		}
		if t.Failed() {
			t.Logf("python %s peer stderr:\n%s", role, p.stderr.String())
		}
	})
	return p
}

// expect waits for the peer's next line and requires it to be kind with n
// fields after it.
func (p *pyPeer) expect(kind string, n int) []string {
	p.t.Helper()
	select {
	case f, ok := <-p.lines:
		if !ok {
			p.t.Fatalf("python peer exited before %q", kind)
		}
		if len(f) == 0 || f[0] != kind || len(f) != n+1 {
			p.t.Fatalf("python peer: want %q with %d fields, got %q", kind, n, f)
		}
		return f[1:]
	case <-time.After(interopStep):
		p.t.Fatalf("python peer: no %q within %v", kind, interopStep)
	}
	return nil
}

func (p *pyPeer) send(words ...string) {
	p.t.Helper()
	_, err := io.WriteString(p.stdin, strings.Join(words, " ")+"\n")
	require.NoError(p.t, err)
}

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	require.NoError(t, err)
	return b
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

func TestNIXLPythonInterop(t *testing.T) {
	requireNIXLPython(t)
	const bs, nb, n = 5120, 1000, 880
	msg := []byte("session:hash")

	t.Run("PythonProducer", func(t *testing.T) {
		leakcheck.Check(t)
		const seed = 11
		pyName := uniqueName("py-prod")
		py := startPyPeer(t, "producer", pyName, bs, nb, seed)
		md := unhex(t, py.expect("meta", 1)[0])
		descs := unhex(t, py.expect("desc", 1)[0])

		cons := env{t: t, backend: "nixl"}.transport(uniqueName("go-cons"), bs, nb)
		got, err := cons.AddRemotePeer(md, descs)
		require.NoError(t, err)
		require.Equal(t, pyName, got)

		rng := rand.New(rand.NewSource(seed))
		remote, local := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
		h, err := cons.PostRead(local, pyName, remote, msg)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), interopStep)
		defer cancel()
		require.NoError(t, cons.Wait(ctx, h))
		for k := range local {
			ok, off := interopCheck(block(cons, bs, local[k]), seed, remote[k])
			require.True(t, ok, "local block %d (remote %d) differs at byte %d", local[k], remote[k], off)
		}
		require.NoError(t, cons.ReleaseXferHandle(h))

		f := py.expect("notif", 2)
		require.Equal(t, cons.cfg.AgentName, f[0], "notification's sender as the python side saw it")
		require.Equal(t, msg, unhex(t, f[1]), "notification bytes as the python side got them")
		require.NoError(t, cons.RemoveRemotePeer(pyName))
	})

	t.Run("PythonConsumer", func(t *testing.T) {
		leakcheck.Check(t)
		const seed = 12
		prodName := uniqueName("go-prod")
		prod := env{t: t, backend: "nixl"}.transport(prodName, bs, nb)
		r := prod.Region()
		for i := 0; i < nb; i++ {
			for j := 0; j < bs; j++ {
				r[i*bs+j] = interopByte(seed, i, j)
			}
		}

		py := startPyPeer(t, "consumer", uniqueName("py-cons"), bs, nb, seed)
		py.send("peer", hex.EncodeToString(prod.AgentMetadata()), hex.EncodeToString(prod.MemDescriptor()))
		rng := rand.New(rand.NewSource(seed))
		remote, local := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
		py.send("read", joinInts(local), joinInts(remote), hex.EncodeToString(msg))
		select {
		case f, ok := <-py.lines:
			require.True(t, ok, "python consumer exited without reporting")
			require.Equal(t, []string{"done", prodName}, f, "python consumer's report")
		case <-time.After(interopStep):
			t.Fatalf("python consumer: no report within %v", interopStep)
		}

		got := notifsUntil(prod, 1, interopStep)
		time.Sleep(20 * time.Millisecond)
		for k, v := range prod.NewNotifs() {
			got[k] = append(got[k], v...)
		}
		require.Equal(t, map[string][][]byte{py.name: {msg}}, got)
	})
}

// A NIXL peer process that dies: with vLLM's defaults (error mode peer,
// so UCX uses TCP and notices the broken connection), READs posted to it
// afterwards end in ErrEngine. NIXL's C API reports REMOTE_DISCONNECT as a
// generic backend error, so the engine cannot tell ErrRemoteDisconnect.
// This also takes UCX's TCP error path, where UCX 1.13 was seen to abort.
func TestNIXLPythonPeerKilled(t *testing.T) {
	requireNIXLPython(t)
	leakcheck.Check(t)
	const bs, nb, n, seed = 5120, 256, 64, 13
	pyName := uniqueName("py-dead")
	py := startPyPeer(t, "producer", pyName, bs, nb, seed)
	md := unhex(t, py.expect("meta", 1)[0])
	descs := unhex(t, py.expect("desc", 1)[0])
	cons := env{t: t, backend: "nixl"}.transport(uniqueName("go-cons"), bs, nb,
		func(c *Config) { c.XferTimeout = 15 * time.Second })
	_, err := cons.AddRemotePeer(md, descs)
	require.NoError(t, err)
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	ctx, cancel := context.WithTimeout(context.Background(), interopStep)
	defer cancel()
	h, err := cons.PostRead(idx, pyName, idx, nil)
	require.NoError(t, err)
	require.NoError(t, cons.Wait(ctx, h), "a READ while the peer lives")
	require.NoError(t, cons.ReleaseXferHandle(h))

	py.kill()
	// The first READs after the kill may still be accepted by the dead
	// connection; within a few tries UCX has noticed.
	var last error
	deadline := time.Now().Add(interopStep)
	for time.Now().Before(deadline) {
		h, err := cons.PostRead(idx, pyName, idx, nil)
		if err != nil {
			last = err
			break
		}
		last = cons.Wait(ctx, h)
		require.NoError(t, cons.ReleaseXferHandle(h))
		if last != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("after the kill: %v", last)
	require.Error(t, last, "READs from a killed NIXL peer keep succeeding")
	require.ErrorIs(t, last, ErrEngine, "a dead NIXL peer's READ: %v", last)
	require.NoError(t, cons.RemoveRemotePeer(pyName))
}
