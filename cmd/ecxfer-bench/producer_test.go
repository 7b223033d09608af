package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"
)

// The hidden producer role run by hand, without the control pipes the
// harness gives it on descriptors 3 and 4 (nothing there, a regular file
// there, or stdin a pipe of text), says what it is and exits 2 at once;
// it used to read descriptor 3 and report "ctrl: bad frame".
func TestProducerRoleByHand(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "fd3")
	require.NoError(t, err)
	defer f.Close()
	for _, tc := range []struct {
		name  string
		extra []*os.File
	}{{"no descriptors", nil}, {"regular files", []*os.File{f, f}}} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			cmd := exec.Command(os.Args[0], "producer")
			cmd.Env = append(os.Environ(), mainEnv+"=1")
			cmd.Stdin = bytes.NewBufferString("hello\n")
			cmd.Stderr = &stderr
			cmd.ExtraFiles = tc.extra
			err := cmd.Run()
			var ee *exec.ExitError
			require.True(t, errors.As(err, &ee), "exit: %v", err)
			require.Equal(t, 2, ee.ExitCode())
			require.Contains(t, stderr.String(), "not run by hand")
			require.Contains(t, stderr.String(), "ecxfer-bench serve")
			require.NotContains(t, stderr.String(), "bad frame")
		})
	}
}
