package ucx

/*
#include <stdlib.h>
#include "ecx.h"
*/
import "C"

import (
	"fmt"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ----------------------------------------------------------------- dlists

// PrepDlist implements nixl.Agent. Remote lists are checked against the
// regions the peer advertised: the target does not bounds-check emulated
// gets, so this check is what protects it.
func (a *Agent) PrepDlist(peerName string, descs descriptors.List, mem nixl.MemType) (nixl.DlistID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckMem(mem); err != nil {
		return 0, err
	}
	d := &dlist{}
	d.Descs, d.Valid = append(descriptors.List(nil), descs...), true
	if peerName == "" {
		if err := a.mems.Spans().CheckList(descs); err != nil {
			return 0, err
		}
		d.Mems, _ = a.mems.Covering(descs) // every descriptor was just checked
	} else {
		p, err := enginekit.LivePeer(kit, a.peers, peerName)
		if err != nil {
			return 0, err
		}
		if err := p.spans.CheckList(descs); err != nil {
			return 0, err
		}
		d.Peer = p
	}
	return a.dlists.Add(d, &a.ids), nil
}

// regionAddr returns the address of the region whose rkey is p.rkeys[i].
func (p *peer) regionAddr(i int) uint64 {
	for _, r := range p.regions {
		if int(r.rkey) == i {
			return r.addr
		}
	}
	return 0
}

// regionAt returns the index in p.regions of the region containing addr.
func (p *peer) regionAt(addr uint64) int {
	return sort.Search(len(p.regions), func(i int) bool { return p.regions[i].addr > addr }) - 1
}

// ReleaseDlist implements nixl.Agent.
func (a *Agent) ReleaseDlist(id nixl.DlistID) error {
	if a.closed {
		return errClosed
	}
	_, err := a.dlists.Release(kit, id)
	return err
}

// -------------------------------------------------------------- transfers

// MakeXfer implements nixl.Agent. Runs are merged (descriptors.MergeRuns)
// and split again wherever they would cross from one remote region (one
// rkey) into the next; the result is kept in C memory for PostXfer.
func (a *Agent) MakeXfer(op nixl.Op, local nixl.DlistID, localIdx []int, remote nixl.DlistID, remoteIdx []int, notif []byte) (nixl.XferID, error) {
	if a.closed {
		return 0, errClosed
	}
	ld, rd, err := enginekit.XferLists(kit, a.dlists.ByID(), op, local, remote, len(notif), a.cfg.MaxNotif)
	if err != nil {
		return 0, err
	}
	rs, err := kit.MergeRuns(&a.rangeBuf, ld.Descs, rd.Descs, localIdx, remoteIdx)
	if err != nil {
		return 0, err
	}
	p := rd.Peer
	// Count the pieces after splitting at remote region ends.
	n := 0
	for _, r := range rs {
		n += p.pieces(r)
	}
	// Released requests are recycled with their C range arrays, so a
	// steady stream of reads allocates nothing on the Go heap.
	var x *xfer
	if k := len(a.spare); k > 0 {
		x = a.spare[k-1]
		a.spare[k-1] = nil
		a.spare = a.spare[:k-1]
	} else {
		x = &xfer{}
	}
	*x = xfer{id: nixl.XferID(a.ids.Next()), op: op, peer: p, nranges: n, nlen: len(notif),
		ranges: x.ranges, rcap: x.rcap}
	if n > x.rcap {
		C.free(unsafe.Pointer(x.ranges))
		x.rcap = max(n, 16)
		x.ranges = (*C.ecx_range_t)(C.malloc(C.size_t(x.rcap) * C.sizeof_ecx_range_t))
	}
	if n > 0 {
		out := unsafe.Slice(x.ranges, n)
		k := 0
		for _, r := range rs {
			for r.Len > 0 {
				i := p.regionAt(r.Remote)
				reg := p.regions[i]
				l := min(r.Len, reg.addr+reg.len-r.Remote, maxGet)
				out[k] = C.ecx_range_t{local: C.uint64_t(r.Local), remote: C.uint64_t(r.Remote),
					len: C.uint64_t(l), rkey: C.uint32_t(reg.rkey)}
				k++
				r.Local += l
				r.Remote += l
				r.Len -= l
			}
		}
	}
	if len(notif) > 0 {
		x.notif = (*C.char)(C.CBytes(notif))
	}
	x.mems = ld.Mems
	enginekit.AddRefs(x.mems, 1)
	a.xfers[x.id] = x
	return x.id, nil
}

// maxGet bounds one get: large READs are cut into gets of at most 1 MiB,
// which ecx_post and ecx_progress post a few MiB per loop turn (see
// ECX_TURN_BUDGET), so READs behind a large one are not held up for the
// whole of it and a timeout or a release can stop it between pieces.
const maxGet = 1 << 20

// pieces returns into how many gets r splits at remote region boundaries
// and at maxGet.
func (p *peer) pieces(r descriptors.Range) int {
	n := 0
	for r.Len > 0 {
		reg := p.regions[p.regionAt(r.Remote)]
		l := min(r.Len, reg.addr+reg.len-r.Remote, maxGet)
		r.Remote += l
		r.Len -= l
		n++
	}
	return n
}

// PostXfer implements nixl.Agent: the gets (or puts) of the request are
// posted by one cgo call, up to the round's budget; the rest by Progress.
func (a *Agent) PostXfer(id nixl.XferID) error {
	if a.closed {
		return errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return kit.XferNotFound(id)
	}
	if err := kit.CheckPost(id, x.state); err != nil {
		return err
	}
	p := x.peer
	if p.pidfd >= 0 && !a.pidPolled {
		// A same-host peer that died would still "serve" gets from the
		// segment it left behind: its pidfd is polled before the first
		// post of each round (one poll for all peers). A round is a run
		// of posts: Progress, PollCompletions, XferStatus and GetNotifs
		// end it, so a loop's turn that posts without progressing the
		// engine (callers step in for it) does not carry a poll made
		// before a death over to READs posted after it.
		a.pidPolled = true
		a.checkPids()
	}
	if p.Dead != nil {
		return p.Dead
	}
	if p.deferred != nil {
		if err := a.unpackDeferred(p); err != nil {
			return err
		}
	}
	if a.fenced(x) {
		a.hold(x)
		return nil
	}
	return a.post(x)
}

// post posts x's gets (or puts) and notification in C.
func (a *Agent) post(x *xfer) error {
	p := x.peer
	op := C.int(C.ECX_OP_READ)
	switch {
	case x.op == nixl.Write:
		op = C.ECX_OP_WRITE
	case p.gatherBig:
		op = C.ECX_OP_GATHER_BIG
	case p.gather:
		op = C.ECX_OP_GATHER
	}
	// The out parameter lives in C memory: a Go variable whose address
	// goes to C would escape to the heap on every post.
	st := C.ecx_post(a.c, C.uint64_t(x.id), p.ep, op, x.ranges, C.uint32_t(x.nranges), p.rkeys,
		unsafe.Pointer(x.notif), C.uint32_t(x.nlen), &p.notifTo, a.postOut)
	if st != 0 {
		return ucsErr(st, "ucx: post")
	}
	x.post = *a.postOut
	x.recheck = a.c.last_in_rounds != 0
	x.state = enginekit.Inflight
	x.err = nil
	x.gen++
	p.inflight[x.id] = x
	return nil
}

// exited reports whether the process behind a pidfd has exited (the pidfd
// is readable).
func exited(pidfd int) bool {
	fds := [1]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds[:], 0)
	return err == nil && n > 0 && fds[0].Revents&unix.POLLIN != 0
}

// drainC moves completions from the C queue to the pending queue.
func (a *Agent) drainC() {
	buf := unsafe.Slice(a.compBuf, compBufLen)
	for a.c.comp_head != nil {
		n := int(C.ecx_drain(a.c, a.compBuf, compBufLen))
		for _, e := range buf[:n] {
			if e.pad == C.ECX_ORPHAN_END {
				a.orphanEnded(nixl.XferID(e.id))
				continue
			}
			x := a.xfers[nixl.XferID(e.id)]
			if x == nil || x.state != enginekit.Inflight {
				continue
			}
			x.post = nil
			x.state = enginekit.Done
			if e.status != 0 {
				x.err = ucsErr(C.int(e.status), fmt.Sprintf("ucx: xfer %d", x.id))
			} else if x.recheck && x.peer.pidfd >= 0 && exited(x.peer.pidfd) {
				// Gets from a same-host peer's segment are copies of
				// whatever it holds: what was posted after the peer died
				// (without PostXfer's poll) read what the dead process
				// left. DONE only if the peer outlived the whole READ.
				x.err = nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: xfer %d: peer %q (pid %d) exited during the transfer", x.id, x.peer.name, x.peer.pid)
			}
			if x.err == nil {
				x.peer.wired = true
			}
			delete(x.peer.inflight, x.id)
			a.pending.Push(x.id, x.gen, x.err)
		}
	}
	if a.fenceLifted {
		a.fenceLifted = false
		a.releaseHeld()
	}
	if n := a.pending.Len(); n > 1024 && n > 2*len(a.xfers) {
		a.pending.Compact(a.live)
	}
}

// live reports whether a queued completion of post gen of request id may
// still be reported.
func (a *Agent) live(id nixl.XferID, gen uint64) bool {
	x := a.xfers[id]
	return x != nil && x.gen == gen && x.state == enginekit.Done
}

// XferStatus implements nixl.Agent. A request that was never posted reports
// (false, ErrNotPosted).
func (a *Agent) XferStatus(id nixl.XferID) (bool, error) {
	a.pidPolled = false // a new round (PostXfer)
	if a.closed {
		return true, errClosed
	}
	if a.c.comp_head != nil {
		a.drainC()
	}
	x := a.xfers[id]
	if x == nil {
		return true, kit.XferNotFound(id)
	}
	switch x.state {
	case enginekit.Idle:
		return false, nixl.ErrNotPosted
	case enginekit.Inflight:
		return false, nil
	}
	return true, x.err
}

// ReleaseXfer implements nixl.Agent. An in-flight request is cancelled: its
// outstanding UCX operations are asked to cancel and the C side frees the
// request once every one of them has called back; no notification is sent.
// Gets already on the wire may still land in local memory: until the last
// has called back, the request's local regions stay referenced and
// DeregisterMem refuses them, and READs posted into its local ranges are
// held (fence.go).
func (a *Agent) ReleaseXfer(id nixl.XferID) error {
	if a.closed {
		return errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return kit.XferNotFound(id)
	}
	a.cancelPost(x)
	delete(x.peer.inflight, id)
	a.freeXfer(x)
	delete(a.xfers, id)
	x.peer, x.err = nil, nil
	if len(a.spare) < maxSpare {
		a.spare = append(a.spare, x)
	} else {
		C.free(unsafe.Pointer(x.ranges))
	}
	return nil
}

// cancelPost cancels x's post, if it has one in C. Gets UCX cannot cancel
// keep x's local regions referenced until they call back (orphanEnded).
// A READ's local ranges are also fenced until then (fence.go); a held READ
// is forgotten.
func (a *Agent) cancelPost(x *xfer) {
	if x.post == nil {
		if len(a.held) > 0 {
			a.unhold(x)
		}
		return
	}
	if C.ecx_post_cancel(a.c, x.post) == 0 {
		if len(x.mems) > 0 {
			enginekit.AddRefs(x.mems, 1)
			a.orphans[x.id] = x.mems
		}
		a.fenceOrphan(x)
	}
	x.post = nil
}

// orphanEnded drops the references a cancelled post held: UCX has called
// back its last operation, so nothing writes its local memory any more.
func (a *Agent) orphanEnded(id nixl.XferID) {
	if ms, ok := a.orphans[id]; ok {
		enginekit.AddRefs(ms, -1)
		delete(a.orphans, id)
	}
	a.liftFence(id)
}

// maxSpare bounds the released requests kept for reuse.
const maxSpare = 1024

func (a *Agent) freeXfer(x *xfer) {
	if x.notif != nil {
		C.free(unsafe.Pointer(x.notif))
		x.notif = nil
	}
	enginekit.AddRefs(x.mems, -1)
	x.mems = nil
}

// PollCompletions implements nixl.Agent.
func (a *Agent) PollCompletions(dst []nixl.Completion) int {
	a.pidPolled = false // a new round (PostXfer)
	if a.closed {
		return 0
	}
	if a.c.comp_head != nil {
		a.drainC()
	}
	return a.pending.Poll(dst, a.live)
}
