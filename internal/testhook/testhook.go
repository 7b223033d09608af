// Package testhook holds the points where tests of other packages widen a
// race window that is otherwise too narrow to hit on demand. Each is nil
// outside tests; the code that runs one pays an atomic load.
package testhook

import "sync/atomic"

// AfterDirectDone runs on the reactor's loop between publishing a pool
// READ of a same-host peer DONE and sending its notification.
var AfterDirectDone atomic.Pointer[func()]

// Run runs the hook h points at, if any.
func Run(h *atomic.Pointer[func()]) {
	if f := h.Load(); f != nil {
		(*f)()
	}
}
