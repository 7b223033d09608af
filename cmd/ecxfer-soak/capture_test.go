package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl/ucx"
)

// TestCaptureUCXLongLine: a line on stdout longer than the capture's
// buffer does not end the capture. Everything written still reaches the real
// stdout, a report line after it is counted, and stop points fd 1 back at
// the real stdout. (The capture used to stop reading at such a line and
// close its copy of the real stdout, whose number stop then duplicated
// onto fd 1: whatever had taken that number since got the run's report.)
func TestCaptureUCXLongLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stdout")
	f, err := os.Create(path)
	require.NoError(t, err)
	defer f.Close()
	saved, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	defer func() {
		_ = unix.Dup2(saved, 1)
		_ = unix.Close(saved)
	}()
	require.NoError(t, unix.Dup2(int(f.Fd()), 1))
	var want unix.Stat_t
	require.NoError(t, unix.Fstat(1, &want))

	c, err := captureUCX()
	require.NoError(t, err)
	long := strings.Repeat("x", 3<<20) + "\n"
	report := "[1] UCX WARN 2 objects were not flushed\n"
	for _, s := range []string{long, report} {
		for b := []byte(s); len(b) > 0; {
			n, err := unix.Write(1, b)
			require.NoError(t, err, "writing to the captured stdout")
			b = b[n:]
		}
	}
	lines := c.stop()

	var got unix.Stat_t
	require.NoError(t, unix.Fstat(1, &got))
	require.Equal(t, [2]uint64{want.Dev, want.Ino}, [2]uint64{got.Dev, got.Ino}, "fd 1 is not the real stdout after stop")
	out, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, len(long)+len(report), len(out), "what was written to stdout did not all arrive")
	require.True(t, strings.HasSuffix(string(out), report))
	require.Equal(t, int64(1), lines, "the report line after the long one")
}

// TestCaptureUCXSeesStdioWarnings: UCX writes its warnings, the teardown
// report among them, through C's stdio, which holds them while stdout is
// the capture's pipe; they used to reach neither the count nor the real
// stdout unless there were more than a buffer's worth. stop flushes stdio
// first. A child of the test binary, with warnings on and an unknown UCX
// variable (UCX warns about it when the first agent starts), captures
// stdout into a file while it starts an agent.
func TestCaptureUCXSeesStdioWarnings(t *testing.T) {
	if path := os.Getenv("ECXFER_SOAK_STDIO_CHILD"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			os.Exit(3)
		}
		if unix.Dup2(int(f.Fd()), 1) != nil {
			os.Exit(4)
		}
		c, err := captureUCX()
		if err != nil {
			os.Exit(5)
		}
		a, err := ucx.New(ucx.Config{Name: "stdio-probe"})
		if err != nil {
			os.Exit(6)
		}
		c.stop()
		_ = a.Close()
		os.Exit(0)
	}
	path := filepath.Join(t.TempDir(), "stdout")
	cmd := exec.Command(os.Args[0], "-test.run=^TestCaptureUCXSeesStdioWarnings$")
	cmd.Env = append(os.Environ(), "ECXFER_SOAK_STDIO_CHILD="+path, "UCX_LOG_LEVEL=warn",
		"UCX_ECXFER_SOAK_NO_SUCH_VARIABLE=1", "UCX_WARN_UNUSED_ENV_VARS=y")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "child: %s", out)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Contains(t, string(b), "UCX_ECXFER_SOAK_NO_SUCH_VARIABLE", "UCX's warning never reached stdout")
}
