package ucx

/*
#include <stdio.h>
*/
import "C"

// FlushCStdio flushes the C library's output streams. UCX logs through
// stdio to standard output and flushes only after errors; when standard
// output is a pipe, stdio holds its warnings (UCX's teardown report among
// them) until its buffer fills or the process exits through C's exit,
// which Go's os.Exit is not. A process that reads its own UCX log (the
// soak) flushes before it counts.
func FlushCStdio() {
	C.fflush(nil)
}
