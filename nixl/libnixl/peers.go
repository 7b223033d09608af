package libnixl

/*
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"bytes"
	"unsafe"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// -------------------------------------------------------------- metadata

// LocalMetadata implements nixl.Agent: NIXL's own blob, which NIXL agents
// in other languages (vLLM's Python ones) load as they are.
func (a *Agent) LocalMetadata() ([]byte, error) {
	if a.closed {
		return nil, errClosed
	}
	size := firstBuf
	for {
		buf := C.malloc(C.size_t(size))
		var n C.size_t
		st := C.ecx_dl_local_md(a.lib.c, a.c, buf, C.size_t(size), &n)
		if st == 0 {
			md := C.GoBytes(buf, C.int(n))
			C.free(buf)
			return md, nil
		}
		C.free(buf)
		if nixl.Status(st) == nixl.ErrInvalidParam && int(n) > size {
			size = int(n)
			continue
		}
		return nil, codeErr(int32(st), "local metadata")
	}
}

// ownAddrFormat is the format version of this agent's own UCX worker
// address, read from its metadata once (-1 if it cannot be told).
func (a *Agent) ownAddrFormat() int {
	if !a.addrFormatRead {
		a.addrFormatRead, a.addrFormat = true, -1
		if md, err := a.LocalMetadata(); err == nil {
			if pm, err := parseMD(md); err == nil {
				a.addrFormat = pm.addrFormat
			}
		}
	}
	return a.addrFormat
}

// LoadRemoteMetadata implements nixl.Agent. The peer's name is read from
// the blob first, so a changed blob under a loaded name is refused with
// ErrNotAllowed and that name, as the contract asks (NIXL itself refuses it
// without naming the peer). A peer NIXL reported gone is refused the same
// way, whatever the blob, so the caller invalidates it and loads it anew.
// NIXL's C API (1.5) reports a peer's disconnect as a backend error, not
// as REMOTE_DISCONNECT: the READ that found it fails with ErrEngine; NIXL
// then invalidates the peer itself, the next request to it ends NOT_FOUND
// (ErrRemoteDisconnect), and that marks it gone (markGone).
func (a *Agent) LoadRemoteMetadata(md []byte) (string, error) {
	if a.closed {
		return "", errClosed
	}
	pm, err := parseMD(md)
	if err != nil {
		return "", err
	}
	if pm.name == a.name {
		return "", nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata names this agent (%q)", a.name)
	}
	if own := a.ownAddrFormat(); pm.addrFormat >= 0 && own >= 0 && pm.addrFormat != own {
		// UCX asserts (aborts the process) on a worker address of another
		// format; this one is garbage, or from a UCX this one cannot read.
		return "", nixl.Errorf(nixl.ErrInvalidParam, "libnixl: %q's UCX worker address is of format %d, this UCX's of %d",
			pm.name, pm.addrFormat, own)
	}
	if d := a.draining[pm.name]; d != nil {
		if err := a.drain(d, drainWait); err != nil {
			return "", err
		}
	}
	if p := a.peers[pm.name]; p != nil {
		if p.Dead == nil && bytes.Equal(p.blob, md) {
			return p.name, nil
		}
		if p.Dead != nil {
			return p.name, nixl.Errorf(nixl.ErrNotAllowed, "libnixl: peer %q is gone (%v); invalidate it first", p.name, p.Dead)
		}
		return p.name, kit.OtherMetadata(p.name)
	}
	p := &peer{name: pm.name, blob: append([]byte(nil), md...),
		inflight: map[nixl.XferID]*xfer{}}
	if pm.known {
		if p.spans, err = nixl.NewSpanIndex(pm.regions); err != nil {
			return "", err
		}
		p.checked = true
	}
	const nameCap = 4096
	nbuf := C.malloc(nameCap)
	defer C.free(nbuf)
	var nlen C.size_t
	st := C.ecx_dl_load_md(a.lib.c, a.c, unsafe.Pointer(unsafe.SliceData(md)), C.size_t(len(md)),
		(*C.char)(nbuf), nameCap, &nlen)
	if st != 0 {
		// NIXL's C API reports every refusal but a bad parameter or an
		// unknown name as a backend error (NOT_ALLOWED, MISMATCH and
		// REMOTE_DISCONNECT included), so the reason cannot be told here.
		// NIXL may have kept part of what it refused (its connection
		// details are stored before the memory section is read), which
		// would make it refuse this peer's next, good metadata. The name
		// is not one of ours (those returned above), so drop it.
		_ = a.forget(pm.name, false)
		if !pm.known {
			// Of a layout this package does not know, and NIXL would not
			// load it either: malformed, as the contract calls it, or of
			// a NIXL this one cannot read.
			return "", nixl.Errorf(nixl.ErrInvalidParam, "libnixl: NIXL refused metadata of %q, of a layout this build does not know (%v)",
				pm.name, codeErr(int32(st), "status"))
		}
		return "", codeErr(int32(st), "loading metadata of %q", pm.name)
	}
	if got := C.GoStringN((*C.char)(nbuf), C.int(min(int(nlen), nameCap))); got != pm.name {
		// Undo the load, unless the name NIXL gave is one of ours: that
		// peer is not this metadata's to drop.
		if a.peers[got] == nil && a.draining[got] == nil {
			_ = C.ecx_dl_invalidate(a.lib.c, a.c, (*C.char)(nbuf), C.size_t(min(int(nlen), nameCap)))
		}
		return "", nixl.Errorf(nixl.ErrMismatch, "libnixl: metadata names %q but NIXL loaded %q", pm.name, got)
	}
	a.peers[p.name] = p
	return p.name, nil
}

// InvalidateRemoteMetadata implements nixl.Agent. In-flight transfers to
// the peer are cancelled in NIXL and end with ErrRemoteDisconnect; its
// prepared lists stay allocated, and unusable, until released.
func (a *Agent) InvalidateRemoteMetadata(name string) error {
	if a.closed {
		return errClosed
	}
	p := a.peers[name]
	if p != nil {
		a.failPeer(p, kit.Invalidated(name))
		a.dlists.Invalidate(p)
		delete(a.peers, name)
		if p.zombies > 0 {
			p.draining = true
			a.draining[name] = p
			return nil
		}
	}
	if name == "" || a.draining[name] != nil {
		return kit.PeerNotFound(name)
	}
	return a.forget(name, p != nil)
}

// forget invalidates name in NIXL. known says whether this Agent had it
// loaded (then NIXL having dropped it already is no error).
func (a *Agent) forget(name string, known bool) error {
	cname := C.CString(name)
	st := C.ecx_dl_invalidate(a.lib.c, a.c, cname, C.size_t(len(name)))
	C.free(unsafe.Pointer(cname))
	if known && nixl.Status(st) == nixl.ErrNotFound {
		return nil // NIXL already dropped it after a disconnect
	}
	if nixl.Status(st) == nixl.ErrNotFound {
		return kit.PeerNotFound(name)
	}
	return codeErr(int32(st), "invalidating %q", name)
}

// failPeer ends every in-flight transfer to p with err; their NIXL
// requests become zombies.
func (a *Agent) failPeer(p *peer, err error) {
	for id, x := range p.inflight {
		a.unlink(x)
		a.bury(x)
		x.state = enginekit.Done
		x.err = err
		a.pending.Push(x.id, x.gen, err)
		delete(p.inflight, id)
	}
}
