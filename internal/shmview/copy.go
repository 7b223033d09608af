package shmview

import (
	"errors"
	"runtime/debug"
)

// ErrFault reports a copy that touched memory that is no longer there: the
// producer shrank or truncated the file behind its region.
var ErrFault = errors.New("shmview: fault reading the peer's region (file truncated?)")

// Copy copies min(len(dst), len(src)) bytes from src to dst. A SIGBUS or
// SIGSEGV while reading src (a mapping whose file was truncated) ends the
// copy with ErrFault instead of the process. dst is assumed good: a fault
// writing it is reported the same way, but that is a bug of the caller.
func Copy(dst, src []byte) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if r := recover(); r != nil {
			if _, ok := r.(interface{ Addr() uintptr }); ok {
				err = ErrFault
				return
			}
			panic(r)
		}
	}()
	copy(dst, src)
	return nil
}
