package main

/*
#include <signal.h>

static struct sigaction ecx_go_bus, ecx_go_segv;

static void ecx_save_fault_handlers(void)
{
    sigaction(SIGBUS, NULL, &ecx_go_bus);
    sigaction(SIGSEGV, NULL, &ecx_go_segv);
}

static int ecx_fault_handlers_moved(void)
{
    struct sigaction cur;
    int moved = 0;
    if (sigaction(SIGBUS, NULL, &cur) == 0 && cur.sa_sigaction != ecx_go_bus.sa_sigaction) {
        moved |= 1;
    }
    if (sigaction(SIGSEGV, NULL, &cur) == 0 && cur.sa_sigaction != ecx_go_segv.sa_sigaction) {
        moved |= 2;
    }
    return moved;
}
*/
import "C"

// A direct READ copies from a mapping of the producer's region file; a
// producer that truncates the file makes the copy fault (SIGBUS), which
// Go's handler turns into an error of that READ (debug.SetPanicOnFault).
// That needs Go's handler to be the process's: a handler installed after
// the library loaded (Python's faulthandler.enable(), signal.signal)
// replaces it, and the fault then kills the process. Go installed its
// handlers before this package's init ran; they are remembered here.
func init() { C.ecx_save_fault_handlers() }

// ecx_fault_handlers reports which fault handlers are no longer the ones
// the library installed when it loaded: 1 SIGBUS, 2 SIGSEGV (or both); 0
// when both still are.
//
//export ecx_fault_handlers
func ecx_fault_handlers() C.int { return C.ecx_fault_handlers_moved() }
