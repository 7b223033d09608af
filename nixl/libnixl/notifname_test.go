package libnixl

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// venvPython is the interpreter of the environment the NIXL engine was
// found in: VIRTUAL_ENV's, else the project's .venv.
func venvPython(t *testing.T) string {
	t.Helper()
	v := os.Getenv(EnvVenv)
	if v == "" {
		v, _ = projectVenv()
	}
	py := filepath.Join(v, "bin", "python")
	if _, err := os.Stat(py); v == "" || err != nil {
		t.Skipf("no Python environment with NIXL's wheel (%s)", EnvVenv)
	}
	return py
}

// A peer can give its NIXL agent a name with a NUL in it ("prod\x00x"),
// which NIXL's C API hands back cut at the NUL: the name of another
// agent. Its notifications were queued as the other agent's a second
// time (the lookup by the cut name found that agent's entry), and when
// that agent had sent none they vanished uncounted. Now the other agent's
// notification arrives once, under its name, and the entry that cannot be
// read is counted dropped.
func TestNotifSenderNameWithNUL(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	py := venvPython(t)
	cons := newSide(t, testName("nul-cons"), 4096, 4)
	md, err := cons.a.LocalMetadata()
	require.NoError(t, err)
	mdPath := filepath.Join(t.TempDir(), "md")
	require.NoError(t, os.WriteFile(mdPath, md, 0o600))
	sender := testName("nul-prod")
	cmd := exec.Command(py, filepath.Join("testdata", "nul_sender.py"), mdPath, sender, cons.a.Name())
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Error("nul_sender.py did not exit within 10s of its stdin closing")
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "sent\n", line)

	got := map[string][][]byte{}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && (len(got[sender]) == 0 || cons.a.DroppedNotifs() == 0) {
		_, err := cons.a.Progress()
		require.NoError(t, err)
		cons.a.GetNotifs(got)
		time.Sleep(time.Millisecond)
	}
	// Anything more (a second copy) would have come with the same batch
	// or soon after.
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); {
		_, _ = cons.a.Progress()
		cons.a.GetNotifs(got)
		time.Sleep(time.Millisecond)
	}
	require.Equal(t, map[string][][]byte{sender: {[]byte("real-1")}}, got)
	require.GreaterOrEqual(t, cons.a.DroppedNotifs(), uint64(1), "the entry under the name with a NUL is counted dropped")
}

// NIXL answers a notification that UCX still has queued as sent, and
// Close closed the connections at once, which cancels what is queued: a
// burst sent to a peer just connected, right before Close, was lost
// whole ("Request canceled"). Close now drives the worker a while after a
// recent send; every notification of a burst arrives.
func TestCloseDeliversRecentNotifs(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	b, err := New(Config{Name: testName("flush-b")})
	require.NoError(t, err)
	a, err := New(Config{Name: testName("flush-a")})
	require.NoError(t, err)
	mdb, err := b.LocalMetadata()
	require.NoError(t, err)
	_, err = a.LoadRemoteMetadata(mdb)
	require.NoError(t, err)
	// b, in a process of its own in life, takes its notifications all
	// along (its own goroutine: an agent is used from one at a time).
	const n = 300
	got := make(chan int, 1)
	stop := make(chan struct{})
	go func() {
		m := map[string][][]byte{}
		defer func() { got <- len(m[a.Name()]) }()
		for {
			b.GetNotifs(m)
			if len(m[a.Name()]) >= n {
				return
			}
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Microsecond):
			}
		}
	}()
	msg := make([]byte, 4000)
	for i := range n {
		copy(msg, fmt.Sprintf("%d", i))
		require.NoError(t, a.SendNotif(b.Name(), msg), "notification %d", i)
	}
	require.NoError(t, a.Close())
	var k int
	select {
	case k = <-got:
	case <-time.After(10 * time.Second):
		close(stop)
		k = <-got
	}
	require.NoError(t, b.Close())
	require.Equal(t, n, k, "notifications delivered of those sent before Close")
}
