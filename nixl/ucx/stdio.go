package ucx

/*
#include <stdio.h>
#include <stdlib.h>
#include "ecx.h"
*/
import "C"

import "unsafe"

// FlushCStdio flushes the C library's output streams. UCX logs through
// stdio to standard output and flushes only after errors; when standard
// output is a pipe, stdio holds its warnings (UCX's teardown report among
// them) until its buffer fills or the process exits through C's exit,
// which Go's os.Exit is not. A process that reads its own UCX log (the
// soak) flushes before it counts.
func FlushCStdio() {
	C.fflush(nil)
}

// tlsHasTCP and devicesHaveTCP report whether a UCX_TLS and a
// UCX_NET_DEVICES value let UCX open its tcp transport, as New decides
// before it sets tcp's TX_SEG_SIZE.
func tlsHasTCP(tls string) bool {
	cs := C.CString(tls)
	defer C.free(unsafe.Pointer(cs))
	return C.ecx_tls_has_tcp(cs) != 0
}

func devicesHaveTCP(devs string) bool {
	cs := C.CString(devs)
	defer C.free(unsafe.Pointer(cs))
	return C.ecx_devices_have_tcp(cs) != 0
}
