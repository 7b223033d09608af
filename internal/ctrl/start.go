package ctrl

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"

	"golang.org/x/sys/unix"
)

// StartPiped starts cmd with pipes to its standard input and output, the
// two ends a Conn is made from (New(stdout, stdin)). A command without a
// Stderr of its own writes to this process's standard error.
//
// The caller owns stdout and closes it once it has read what it wants.
// Unlike exec.Cmd's StdoutPipe, Wait does not close it: what the command
// wrote before it exited stays readable after Wait, so a last message (an
// error report, say) is not lost to a goroutine that waits for the exit.
// After the command exits and its output is read, reads return io.EOF.
// Wait closes stdin once the command has exited, as with StdinPipe.
//
// A command whose Stdin or Stdout is already set is refused before any pipe
// is made, and a command that fails to start has both pipes closed, so
// neither leaves a descriptor open.
func StartPiped(cmd *exec.Cmd) (stdin io.WriteCloser, stdout io.ReadCloser, err error) {
	if cmd.Stdin != nil || cmd.Stdout != nil {
		return nil, nil, errors.New("ctrl: StartPiped: the command's Stdin or Stdout is already set")
	}
	if cmd.Stderr == nil {
		cmd.Stderr = os.Stderr
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, nil, err
	}
	if stdin, err = cmd.StdinPipe(); err != nil {
		_ = r.Close()
		_ = w.Close()
		return nil, nil, err
	}
	cmd.Stdout = w // an *os.File: the child gets it as is, no copying goroutine
	err = cmd.Start()
	_ = w.Close() // the child has its own copy; ours would keep EOF away
	if err != nil {
		_ = r.Close() // Start has closed the stdin pipe
		return nil, nil, err
	}
	return stdin, r, nil
}

// ChildConn is the child's side of StartPiped: a Conn over its standard
// input and its standard output taken by TakeStdout.
func ChildConn() (*Conn, error) {
	out, err := TakeStdout()
	if err != nil {
		return nil, err
	}
	return New(os.Stdin, out), nil
}

// TakeStdout returns a duplicate of standard output (close-on-exec) for a
// stream of the caller's own and points descriptor 1 at standard error.
// Libraries that print to stdout (UCX logs there) would otherwise write
// into that stream and break its framing; their lines now reach stderr.
//
// os.Stdout is left as it is: it is what holds descriptor 1 open. An
// *os.File that becomes unreachable closes its descriptor, so replacing
// os.Stdout would let the collector close fd 1, and the next descriptor
// the process opened (a socket, say) would receive those lines.
//
// Standard output can be taken once: a second call returns an error (it
// would get a duplicate of standard error, and its stream would go there).
func TakeStdout() (*os.File, error) {
	stdoutMu.Lock()
	defer stdoutMu.Unlock()
	if stdoutTaken {
		return nil, errors.New("ctrl: standard output was already taken")
	}
	fd, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("ctrl: duplicating stdout: %w", err)
	}
	if err := unix.Dup3(2, 1, 0); err != nil { // Dup2 is not on every Linux arch
		_ = unix.Close(fd)
		return nil, fmt.Errorf("ctrl: pointing stdout at stderr: %w", err)
	}
	stdoutTaken = true
	return os.NewFile(uintptr(fd), "ctrl"), nil
}

var (
	stdoutMu    sync.Mutex
	stdoutTaken bool // TakeStdout has pointed fd 1 at stderr
)
