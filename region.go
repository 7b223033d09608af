package ecxfer

import (
	"runtime"
	"unsafe"
)

// onGoHeap reports whether b's memory belongs to an object on the Go heap.
//
// Go has no call that answers this directly, so it asks runtime.AddCleanup,
// which must find the heap object a pointer lies in: for a pointer into the
// Go heap it attaches a cleanup (stopped again at once), for one it cannot
// find in the heap it panics, and for Go memory outside the heap (package
// variables) it returns a cleanup that does nothing. Only the first case
// counts as heap memory. Limits: this leans on AddCleanup refusing pointers
// it does not own, as Go 1.24 to 1.26 do (a test checks both answers);
// memory of package variables is accepted, as the garbage collector never
// frees or moves it; and with GODEBUG=sbrk=1 the runtime attaches nothing,
// so nothing is refused.
func onGoHeap(b []byte) (heap bool) {
	if len(b) == 0 {
		return false
	}
	defer func() {
		if recover() != nil {
			heap = false
		}
	}()
	c := runtime.AddCleanup(unsafe.SliceData(b), func(struct{}) {}, struct{}{})
	c.Stop()
	return c != runtime.Cleanup{}
}
