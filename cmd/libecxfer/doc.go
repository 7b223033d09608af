// Command libecxfer is ecxfer's C ABI: built with
// `go build -buildmode=c-shared` (`make python`) it becomes libecxfer.so,
// which the Python package (python/ecxfer) loads with ctypes. It is the only
// package outside nixl/ that uses cgo.
//
// # Conventions
//
// Transports and peers cross as integers: ecx_new returns a transport id,
// ecx_add_peer a peer id (a peer replaced under the same name keeps its id;
// one added again after ecx_remove_peer gets a new one), ecx_post_read a
// READ handle. 0 is never a valid id or handle.
//
// Byte strings cross as pointer plus length. A pointer is null (with a
// length of 0) or names memory the caller owns; one into the first page
// (below 4096, never mapped) is refused as a bad argument when it arrives,
// but the process may already have been aborted by Go's runtime, which
// takes it for a corrupt pointer, so callers must check what they were
// handed (the Python package does). Inputs are borrowed for the
// duration of the call only: nothing keeps a pointer the caller passed in,
// except the region given to ecx_new, which must stay mapped until
// ecx_deregister returns, and the interpreter's functions and objects
// given to ecx_py_api, kept for the life of the process. Outputs that the library allocates (ecx_blob,
// ecx_notifs, ecx_stats, ecx_runtime) are malloc'd, owned by the caller
// from then on, and freed with ecx_free.
//
// Errors are negative codes (the code* constants in codes.go, which the
// Python package mirrors in _lib.py; stable across versions; 0 is success)
// and a message. The message of the last failing
// call is kept per OS thread, like errno: ecx_last_error on the same thread
// copies it out and clears it. A call that succeeds leaves it alone.
//
// Index lists are arrays of int64 (the layout of Python's array('q') and
// numpy's int64); each is read once, into the library's own copy, and not
// kept: another thread may write it during the call without slipping an
// unchecked index through.
//
// The calls the Python package makes on every READ have a C entry of
// their own (pycalls.c, the package's only C file): ecx_py_call makes
// builtins of the interpreter's own (METH_FASTCALL functions, made with
// the interpreter's functions, installed once with ecx_py_api; the library
// does not link against Python) for post_read, check, release and wait,
// which skip ctypes' per-call costs. post_read reads the two index lists
// when they are Python lists or tuples of ints, what vLLM passes, with the
// GIL held; every builtin releases the GIL around its call into the
// library. What they cannot read (not exactly a list or tuple of exact
// ints in int64's range, not an int where one is due, lists of lengths
// that differ, an agent the package's dict lacks, a notification that is
// not bytes) they leave alone and return codeUnpacked, "ERR" from check,
// and the package takes its general way. ecx_py_api and ecx_py_call are
// called with the GIL held (through a ctypes.PyDLL).
//
// ecx_wait and ecx_notifs block up to their timeout; ecx_new, ecx_add_peer,
// ecx_remove_peer and ecx_deregister wait for the transport's reactor
// thread to do their work; ecx_release of a READ the copy workers are
// running waits for its copy to stop, and of an engine READ in flight
// for the reactor to release it in the engine;
// ecx_check may sleep up to 200 µs while many engine READs are in flight
// (see ecx_check); ecx_post_read waits for room only with the
// wait_when_busy option (so does the post_read builtin); the other calls
// never block. The Python package calls the library through ctypes, which
// releases the GIL for the duration of every call, or through the
// builtins, which release it themselves.
package main
