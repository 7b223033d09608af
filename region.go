package ecxfer

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ecxfer/ecxfer/internal/procmaps"
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

// checkRegionWritable refuses a caller's region that is not mapped
// writable here from end to end: READs copy into it (on the direct path,
// in this process), and a fault there would be taken for the producer's
// (its file truncated under the copy) and end the READ blamed on it. The
// check is of the mappings when New runs; the region must stay so until
// Deregister returns. A process whose mappings cannot be read is not
// refused for it.
func checkRegionWritable(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	m, err := procmaps.Open("self")
	if err != nil {
		return nil
	}
	defer m.Close()
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	ok, at, err := m.Writable(base, uint64(len(b)))
	if err != nil || ok {
		return nil
	}
	return fmt.Errorf("%w: Region [%#x, %#x) is not mapped writable in this process at %#x", ErrConfig,
		base, base+uint64(len(b)), at)
}
