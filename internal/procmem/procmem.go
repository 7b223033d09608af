// Package procmem reads another process's memory with process_vm_readv.
//
// It is the direct path for a same-host producer whose region is anonymous
// memory (no file a consumer could map). The kernel copies straight from
// the producer's pages into the consumer's: nothing of the producer runs,
// no shared queue sits between the two, and a producer that has died makes
// the call fail with ESRCH instead of leaving anything wedged. Unlike a
// mapping, each call checks the producer's page tables anew, so a shrunken
// region fails with EFAULT rather than a signal.
package procmem

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrGone reports that the process no longer exists.
var ErrGone = errors.New("procmem: process is gone")

// ErrFault reports remote memory that is not mapped (any more).
var ErrFault = errors.New("procmem: remote range not mapped")

// maxIov is the most iovecs one call takes (the kernel's UIO_MAXIOV).
const maxIov = 1024

// Reader batches reads from one process. A Reader is used by one goroutine
// at a time; it allocates nothing once its batch buffers have grown.
type Reader struct {
	pid    int
	local  []unix.Iovec
	remote []unix.RemoteIovec
	total  int
}

// NewReader returns a Reader for pid.
func NewReader(pid int) *Reader {
	return &Reader{pid: pid, local: make([]unix.Iovec, 0, 64), remote: make([]unix.RemoteIovec, 0, 64)}
}

// Reset starts a new batch for pid.
func (r *Reader) Reset(pid int) {
	r.pid = pid
	r.local = r.local[:0]
	r.remote = r.remote[:0]
	r.total = 0
}

// Add queues a read of len(dst) bytes at the remote address addr.
func (r *Reader) Add(dst []byte, addr uint64) {
	if len(dst) == 0 {
		return
	}
	var iov unix.Iovec
	iov.Base = unsafe.SliceData(dst)
	iov.SetLen(len(dst))
	r.local = append(r.local, iov)
	r.remote = append(r.remote, unix.RemoteIovec{Base: uintptr(addr), Len: len(dst)})
	r.total += len(dst)
}

// Read performs the queued reads and empties the batch. It returns ErrGone
// when the process has exited, ErrFault when a remote range is not mapped.
func (r *Reader) Read() error {
	defer func() { r.local, r.remote, r.total = r.local[:0], r.remote[:0], 0 }()
	li, ri := 0, 0
	for li < len(r.local) {
		le := min(li+maxIov, len(r.local))
		re := min(ri+maxIov, len(r.remote))
		n, err := unix.ProcessVMReadv(r.pid, r.local[li:le], r.remote[ri:re], 0)
		switch {
		case errors.Is(err, unix.ESRCH):
			return fmt.Errorf("%w: pid %d", ErrGone, r.pid)
		case errors.Is(err, unix.EFAULT):
			return fmt.Errorf("%w: pid %d", ErrFault, r.pid)
		case err != nil:
			return fmt.Errorf("procmem: process_vm_readv(pid %d): %w", r.pid, err)
		case n == 0:
			return fmt.Errorf("%w: pid %d: nothing read", ErrFault, r.pid)
		}
		// A short read stops at a remote iovec's end or at a fault: skip
		// what landed and go round with the rest.
		li, ri = advance(r.local, li, n), advanceRemote(r.remote, ri, n)
	}
	return nil
}

// advance drops n bytes from the front of v[i:], splitting an iovec if
// needed, and returns the new start.
func advance(v []unix.Iovec, i, n int) int {
	for n > 0 && i < len(v) {
		l := int(v[i].Len)
		if n < l {
			v[i].Base = (*byte)(unsafe.Add(unsafe.Pointer(v[i].Base), n))
			v[i].SetLen(l - n)
			return i
		}
		n -= l
		i++
	}
	return i
}

func advanceRemote(v []unix.RemoteIovec, i, n int) int {
	for n > 0 && i < len(v) {
		if n < v[i].Len {
			v[i].Base += uintptr(n)
			v[i].Len -= n
			return i
		}
		n -= v[i].Len
		i++
	}
	return i
}

// Copy reads len(dst) bytes at addr of pid in one call.
func Copy(pid int, dst []byte, addr uint64) error {
	var r Reader
	var l [1]unix.Iovec
	var rr [1]unix.RemoteIovec
	r.pid, r.local, r.remote = pid, l[:0], rr[:0]
	r.Add(dst, addr)
	return r.Read()
}
