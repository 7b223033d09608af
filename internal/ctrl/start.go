package ctrl

import (
	"errors"
	"io"
	"os"
	"os/exec"
)

// StartPiped starts cmd with pipes to its standard input and output, the
// two ends a Conn is made from (New(stdout, stdin)). A command without a
// Stderr of its own writes to this process's standard error. As with
// exec.Cmd's pipes, Wait closes them once the command has exited.
//
// A command whose Stdin or Stdout is already set is refused before any pipe
// is made, and a command that fails to start has its pipes closed by Start,
// so neither leaves a descriptor open. (Should the process run out of
// descriptors between the two pipes, the first stays open until the
// garbage collector closes it.)
func StartPiped(cmd *exec.Cmd) (stdin io.WriteCloser, stdout io.ReadCloser, err error) {
	if cmd.Stdin != nil || cmd.Stdout != nil {
		return nil, nil, errors.New("ctrl: StartPiped: the command's Stdin or Stdout is already set")
	}
	if cmd.Stderr == nil {
		cmd.Stderr = os.Stderr
	}
	if stdin, err = cmd.StdinPipe(); err != nil {
		return nil, nil, err
	}
	if stdout, err = cmd.StdoutPipe(); err != nil {
		return nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	return stdin, stdout, nil
}
