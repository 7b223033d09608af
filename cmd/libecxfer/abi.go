package main

/*
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
*/
import "C"

import (
	"fmt"
	"sync"
	"time"
	"unsafe"
)

// int must be 64 bits: index arrays of int64 are read as []int in place.
var _ [unsafe.Sizeof(int(0)) - 8]struct{}

// abiVersion changes whenever a function's signature or meaning changes.
const abiVersion = 5

// ecxNameCap is the name buffer ecx_add_peer needs: the longest agent name
// (256 bytes) and its NUL.
const ecxNameCap = 257

// maxLen bounds every length the caller passes (1 TiB): a larger one is a
// bad argument, not a slice the runtime should try to build.
const maxLen = 1 << 40

// firstAddr is the lowest address a caller's memory can have: the kernel
// never maps the first page. A pointer below it is refused as soon as it
// arrives; Go's runtime aborts the process when it finds one on a stack
// it copies, so one that lingered into deeper calls took the caller's
// process down (such a pointer is a bad argument to every function here,
// which documents the caller's duty: null or valid).
const firstAddr = 4096

func main() {}

// bytesArg borrows n bytes at p for the duration of the call.
func bytesArg(p unsafe.Pointer, n C.int64_t) ([]byte, error) {
	switch {
	case n < 0 || n > maxLen:
		return nil, fmt.Errorf("%w: length %d", errBadArg, int64(n))
	case n == 0:
		return nil, nil
	case p == nil:
		return nil, fmt.Errorf("%w: null pointer with length %d", errBadArg, int64(n))
	case uintptr(p) < firstAddr:
		return nil, fmt.Errorf("%w: pointer %#x with length %d", errBadArg, uintptr(p), int64(n))
	}
	return unsafe.Slice((*byte)(p), int(n)), nil
}

// indexArg borrows n int64 indices at p for the duration of the call (to
// be read once: see copyIdx).
func indexArg(p *C.int64_t, n C.int64_t) ([]int, error) {
	switch {
	case n < 0 || n > maxLen/8:
		return nil, fmt.Errorf("%w: index count %d", errBadArg, int64(n))
	case n == 0:
		return []int{}, nil
	case p == nil:
		return nil, fmt.Errorf("%w: null index array with count %d", errBadArg, int64(n))
	case uintptr(unsafe.Pointer(p)) < firstAddr:
		return nil, fmt.Errorf("%w: index array at %#x with count %d", errBadArg, uintptr(unsafe.Pointer(p)), int64(n))
	}
	return unsafe.Slice((*int)(unsafe.Pointer(p)), int(n)), nil
}

// idxCopies are the Go copies of a post's index lists. The caller's arrays
// are read once, into these: another thread of the caller writing them
// during the call (Python releases the GIL here) could otherwise change an
// index between the reactor's check of it and its use, and an index never
// checked would reach the copy or the engine. Copies of more than
// keepIdx indices are not kept.
var idxCopies = sync.Pool{New: func() any { return new([]int) }}

const keepIdx = 1 << 14

// copyIdx returns a Go copy of idx in a buffer from idxCopies; put it back
// with putIdx when the call is done with it.
func copyIdx(idx []int) *[]int {
	b := idxCopies.Get().(*[]int)
	*b = append((*b)[:0], idx...)
	return b
}

func putIdx(b *[]int) {
	if cap(*b) <= keepIdx {
		idxCopies.Put(b)
	}
}

// giveBytes hands the bytes get returns to the caller as malloc'd memory at
// *out and returns their length (0 and *out NULL for none), or a negative
// code: for a NULL out (get is then not called) or get's error.
func giveBytes(out *unsafe.Pointer, get func() ([]byte, error)) C.int64_t {
	if out == nil {
		return C.int64_t(fail(fmt.Errorf("%w: null out", errBadArg)))
	}
	b, err := get()
	if err != nil {
		return C.int64_t(fail(err))
	}
	if len(b) == 0 {
		*out = nil
		return 0
	}
	*out = C.CBytes(b)
	return C.int64_t(len(b))
}

func nanos(ns C.int64_t) time.Duration {
	if ns < 0 {
		return -1
	}
	return time.Duration(ns)
}

//export ecx_abi_version
func ecx_abi_version() C.int { return abiVersion }

// ecx_new creates a transport from opts, a JSON object of options (see
// options), over the caller's region of regionLen bytes (NULL: the
// transport allocates its own, and regionLen must be 0; a region of
// length 0 is refused, not replaced by one of the transport's). The
// region must stay mapped until
// every ecx_deregister of the transport has returned. It stores the
// transport's id at *out.
//
//export ecx_new
func ecx_new(opts unsafe.Pointer, optsLen C.int64_t, region unsafe.Pointer, regionLen C.int64_t, out *C.uint64_t) C.int {
	o, err := bytesArg(opts, optsLen)
	if err != nil {
		return C.int(fail(err))
	}
	var reg []byte
	if region == nil && regionLen != 0 {
		return C.int(fail(fmt.Errorf("%w: no region, but a length of %d", errBadArg, regionLen)))
	}
	if region != nil {
		if regionLen == 0 {
			return C.int(fail(fmt.Errorf("%w: a region at %p of 0 bytes", errBadArg, region)))
		}
		if reg, err = bytesArg(region, regionLen); err != nil {
			return C.int(fail(err))
		}
	}
	if out == nil {
		return C.int(fail(fmt.Errorf("%w: null out", errBadArg)))
	}
	id, err := newTransport(o, reg)
	if err != nil {
		return C.int(fail(err))
	}
	*out = C.uint64_t(id)
	return 0
}

// ecx_deregister tears the transport down (blocking until its thread has
// stopped) and forgets its id. A call made while another is tearing the
// same transport down waits for it; a call after that returns 0 at once.
//
//export ecx_deregister
func ecx_deregister(t C.uint64_t) C.int {
	if err := deregister(uint64(t)); err != nil {
		return C.int(fail(err))
	}
	return 0
}

// ecx_blob copies the agent metadata (which 1) or the msgpack block
// descriptor list (which 2) to malloc'd memory at *out and returns its
// length, or a negative code.
//
//export ecx_blob
func ecx_blob(t C.uint64_t, which C.int, out *unsafe.Pointer) C.int64_t {
	return giveBytes(out, func() ([]byte, error) { return blob(uint64(t), int(which)) })
}

// ecx_add_peer adds a peer from its metadata and descriptor list. It
// writes the peer's name, NUL-terminated, into name and its id at *peer.
// name must have room for the longest name, nameCap >= ecxNameCap (257):
// the call is refused before it adds anything otherwise, so a peer is
// never added whose name the caller could not learn.
//
//export ecx_add_peer
func ecx_add_peer(t C.uint64_t, md unsafe.Pointer, mdLen C.int64_t, desc unsafe.Pointer, descLen C.int64_t,
	name *C.char, nameCap C.int64_t, peer *C.uint64_t) C.int {
	m, err := bytesArg(md, mdLen)
	if err != nil {
		return C.int(fail(err))
	}
	d, err := bytesArg(desc, descLen)
	if err != nil {
		return C.int(fail(err))
	}
	if name == nil || peer == nil {
		return C.int(fail(fmt.Errorf("%w: null name or peer", errBadArg)))
	}
	if nameCap < ecxNameCap {
		return C.int(fail(fmt.Errorf("%w: name buffer of %d bytes, need %d", errBadArg, int64(nameCap), ecxNameCap)))
	}
	n, pid, err := addPeer(uint64(t), m, d)
	if err != nil {
		return C.int(fail(err))
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(name)), int(nameCap))
	dst[copy(dst, n)] = 0
	*peer = C.uint64_t(pid)
	return 0
}

// ecx_remove_peer removes the peer with that name (nameLen bytes),
// canceling its READs in flight.
//
//export ecx_remove_peer
func ecx_remove_peer(t C.uint64_t, name unsafe.Pointer, nameLen C.int64_t) C.int {
	n, err := bytesArg(name, nameLen)
	if err != nil {
		return C.int(fail(err))
	}
	if err := removePeer(uint64(t), string(n)); err != nil {
		return C.int(fail(err))
	}
	return 0
}

// ecx_post_read posts a READ of the peer's blocks remote[0:nRemote] into
// the local blocks local[0:nLocal], with notif (notifLen bytes; none when
// 0) delivered to the peer once the data has landed. It returns the handle
// (> 0) or a negative code; it never waits for data.
//
//export ecx_post_read
func ecx_post_read(t C.uint64_t, local *C.int64_t, nLocal C.int64_t, peer C.uint64_t,
	remote *C.int64_t, nRemote C.int64_t, notif unsafe.Pointer, notifLen C.int64_t) C.int64_t {
	l, err := indexArg(local, nLocal)
	if err != nil {
		return C.int64_t(fail(err))
	}
	r, err := indexArg(remote, nRemote)
	if err != nil {
		return C.int64_t(fail(err))
	}
	msg, err := bytesArg(notif, notifLen)
	if err != nil {
		return C.int64_t(fail(err))
	}
	h, err := postReadCopy(uint64(t), l, uint64(peer), r, msg)
	if err != nil {
		return C.int64_t(fail(err))
	}
	return C.int64_t(h)
}

// ecx_check returns a READ's state: 0 PROC, 1 DONE, or the negative code
// of its error (ERR). It does not wait for the READ, but may work or
// pause first, as ecxfer.Transport.CheckXferState says: copy one chunk
// of a large same-host READ, take a step of the engine's work, or, while
// more engine READs are in flight than twice GOMAXPROCS, sleep up to
// 200 µs for a READ its caller polls in a loop.
//
//export ecx_check
func ecx_check(t C.uint64_t, h C.uint64_t) C.int {
	st, err := checkState(uint64(t), uint64(h))
	if err != nil {
		return C.int(fail(err))
	}
	return C.int(st)
}

// ecx_wait blocks until the READ leaves PROC or timeoutNs passes
// (negative: no limit) and returns its state as ecx_check does: 0 means
// the time ran out first.
//
//export ecx_wait
func ecx_wait(t C.uint64_t, h C.uint64_t, timeoutNs C.int64_t) C.int {
	st, err := wait(uint64(t), uint64(h), nanos(timeoutNs))
	if err != nil {
		return C.int(fail(err))
	}
	return C.int(st)
}

// ecx_release frees a handle, canceling its READ if in flight (a direct
// READ on the copy workers: once its copy has stopped).
//
//export ecx_release
func ecx_release(t C.uint64_t, h C.uint64_t) C.int {
	if err := release(uint64(t), uint64(h)); err != nil {
		return C.int(fail(err))
	}
	return 0
}

// ecx_notifs takes the notifications received since the last call,
// waiting up to timeoutNs for the first (0: not at all; negative: no
// limit). It returns the length of the encoding at *out (malloc'd; 0 and
// NULL when there are none) or a negative code. The encoding, integers
// little-endian uint32: number of senders; per sender its name's length,
// the name, the number of messages; per message its length and bytes.
//
//export ecx_notifs
func ecx_notifs(t C.uint64_t, timeoutNs C.int64_t, out *unsafe.Pointer) C.int64_t {
	return giveBytes(out, func() ([]byte, error) { return notifs(uint64(t), nanos(timeoutNs)) })
}

// ecx_stats writes the transport's counters as a JSON object to malloc'd
// memory at *out and returns its length, or a negative code.
//
//export ecx_stats
func ecx_stats(t C.uint64_t, out *unsafe.Pointer) C.int64_t {
	return giveBytes(out, func() ([]byte, error) { return stats(uint64(t)) })
}

// ecx_runtime writes {"transports": live transports, "goroutines": Go
// goroutines} as JSON to malloc'd memory at *out and returns its length.
//
//export ecx_runtime
func ecx_runtime(out *unsafe.Pointer) C.int64_t {
	return giveBytes(out, func() ([]byte, error) { return runtimeStats(), nil })
}

// ecx_last_error copies the calling thread's last error message into buf
// (capacity bytes, NUL-terminated, cut to fit), forgets it, and returns the
// message's full length (0: none).
//
//export ecx_last_error
func ecx_last_error(buf *C.char, capacity C.int64_t) C.int64_t {
	s := takeLastErr()
	if buf != nil && capacity > 0 {
		dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(min(int64(capacity), maxLen)))
		dst[copy(dst[:len(dst)-1], s)] = 0
	}
	return C.int64_t(len(s))
}

// ecx_free frees memory the library handed out.
//
//export ecx_free
func ecx_free(p unsafe.Pointer) { C.free(p) }
