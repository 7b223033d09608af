package ecxfer

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fdCheckResult is what the "fdcheck" role reports.
type fdCheckResult struct {
	SameAsStderr bool   // fd 1 is the file fd 2 is
	Fd1          string // what /proc says fd 1 is
}

// runFdCheck is the "fdcheck" role: after keepCtrlOut, a few collections
// and new descriptors, fd 1 must still be standard error, so that lines
// C libraries print land there and not in a descriptor opened since.
func runFdCheck() int {
	for range 5 {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	r, w, err := os.Pipe() // takes the lowest free numbers, as a socket would
	if err != nil {
		return 1
	}
	defer r.Close()
	defer w.Close()
	_, _ = unix.Write(1, []byte("a line printed to stdout\n"))
	var s1, s2 unix.Stat_t
	res := fdCheckResult{}
	if unix.Fstat(1, &s1) == nil && unix.Fstat(2, &s2) == nil {
		res.SameAsStderr = s1.Dev == s2.Dev && s1.Ino == s2.Ino
	}
	res.Fd1, _ = os.Readlink("/proc/self/fd/1")
	if err := json.NewEncoder(ctrlOut).Encode(res); err != nil {
		return 1
	}
	return 0
}

// TestCtrlOutKeepsStdout: a role process keeps fd 1 pointed at standard
// error for its whole life. Its control channel moved off fd 1 once let
// the garbage collector close fd 1 (the *os.File of the old os.Stdout),
// a later socket took the number, and UCX's log lines went into a TCP
// stream between two test processes: the peer aborted in UCX's tcp
// framing assertion (TestTwoHostsLinkDown, about 1 run in 30).
func TestCtrlOutKeepsStdout(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	errPath := filepath.Join(t.TempDir(), "stderr")
	errFile, err := os.Create(errPath)
	require.NoError(t, err)
	defer errFile.Close()
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=fdcheck")
	cmd.Stderr = errFile
	out, err := cmd.Output()
	require.NoError(t, err)
	var res fdCheckResult
	require.NoError(t, json.Unmarshal(out, &res), "the control channel carried %q", out)
	require.True(t, res.SameAsStderr, "fd 1 is %q, not standard error", res.Fd1)
	printed, err := os.ReadFile(errPath)
	require.NoError(t, err)
	require.True(t, strings.Contains(string(printed), "a line printed to stdout"), "stderr holds %q", printed)
}
