package libnixl

/*
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ----------------------------------------------------------------- dlists

// PrepDlist implements nixl.Agent. Local lists are checked against the
// registered regions; remote lists against the regions the peer advertised
// in its metadata (when its layout was known), then by NIXL.
func (a *Agent) PrepDlist(peerName string, descs descriptors.List, mem nixl.MemType) (nixl.DlistID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckMem(mem); err != nil {
		return 0, err
	}
	if len(descs) == 0 {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: empty descriptor list")
	}
	d := &dlist{}
	d.Descs, d.Valid = append(descriptors.List(nil), descs...), true
	if peerName == "" {
		var i int
		if d.Mems, i = a.mems.Covering(descs); i >= 0 {
			ds := descs[i]
			return 0, kit.Errorf(nixl.ErrInvalidParam, "descriptor %d [%#x,+%d) is outside registered memory", i, ds.Addr, ds.Len)
		}
	} else {
		p, err := enginekit.LivePeer(kit, a.peers, peerName)
		if err != nil {
			return 0, err
		}
		if p.checked {
			if err := p.spans.CheckList(descs); err != nil {
				return 0, err
			}
		}
		d.Peer = p
	}
	n := len(descs)
	addr := make([]uint64, n)
	ln := make([]uint64, n)
	dev := make([]uint64, n)
	for i, ds := range descs {
		addr[i], ln[i], dev[i] = ds.Addr, ds.Len, ds.DevID
	}
	var cpeer *C.char
	if peerName != "" {
		cpeer = C.CString(peerName)
		defer C.free(unsafe.Pointer(cpeer))
	}
	st := C.ecx_dl_prep_dlist(a.lib.c, a.c, cpeer, C.size_t(len(peerName)),
		(*C.uint64_t)(unsafe.Pointer(&addr[0])), (*C.uint64_t)(unsafe.Pointer(&ln[0])),
		(*C.uint64_t)(unsafe.Pointer(&dev[0])), C.size_t(n), &d.c)
	if err := codeErr(int32(st), "preparing a list of %d descriptors", n); err != nil {
		return 0, err
	}
	return a.dlists.Add(d, &a.ids), nil
}

// ReleaseDlist implements nixl.Agent.
func (a *Agent) ReleaseDlist(id nixl.DlistID) error {
	if a.closed {
		return errClosed
	}
	d, err := a.dlists.Release(kit, id)
	if err != nil {
		return err
	}
	st := C.ecx_dl_release_dlist(a.lib.c, a.c, d.c)
	d.c = nil
	return codeErr(int32(st), "releasing dlist %d", id)
}

// -------------------------------------------------------------- transfers

// MakeXfer implements nixl.Agent. Indices and lengths are checked here;
// the NIXL request itself is made by PostXfer, together with posting it,
// in one call.
func (a *Agent) MakeXfer(op nixl.Op, local nixl.DlistID, localIdx []int, remote nixl.DlistID, remoteIdx []int, notif []byte) (nixl.XferID, error) {
	if a.closed {
		return 0, errClosed
	}
	ld, rd, err := enginekit.XferLists(kit, a.dlists.ByID(), op, local, remote, len(notif), a.cfg.MaxNotif)
	if err != nil {
		return 0, err
	}
	if len(ld.Descs) > 1<<31-1 || len(rd.Descs) > 1<<31-1 {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: list too long for NIXL's int indices")
	}
	// MergeRuns checks counts, ranges and paired lengths; the runs
	// themselves are NIXL's business.
	if _, err := kit.MergeRuns(&a.rangeBuf, ld.Descs, rd.Descs, localIdx, remoteIdx); err != nil {
		return 0, err
	}
	x := &xfer{id: nixl.XferID(a.ids.Next()), op: op, local: ld, remote: rd, slot: -1,
		lidx: make([]int32, len(localIdx)), ridx: make([]int32, len(remoteIdx))}
	for i, v := range localIdx {
		x.lidx[i] = int32(v)
	}
	for i, v := range remoteIdx {
		x.ridx[i] = int32(v)
	}
	if len(notif) > 0 {
		x.notif = append([]byte(nil), notif...)
	}
	x.mems = ld.Mems
	enginekit.AddRefs(x.mems, 1)
	a.xfers[x.id] = x
	return x.id, nil
}

// PostXfer implements nixl.Agent: one call makes and posts the NIXL
// request. Reposting a finished request makes a fresh NIXL request.
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
	p := x.remote.Peer
	if p.Dead != nil {
		return p.Dead
	}
	if !x.remote.Valid || a.peers[p.name] != p {
		return nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: xfer %d: peer %q is gone", id, p.name)
	}
	if x.op == nixl.Read && len(a.zombies) > 0 && a.zombieFenced(x) {
		if a.reap(); a.zombieFenced(x) {
			// A released READ still running in NIXL (its peer stalled,
			// say) may yet write these blocks: posted now, this READ
			// could end DONE and then have its bytes overwritten. NIXL
			// cannot cancel that one (see zombie), so this one is held,
			// in flight with nothing posted, until it has ended.
			a.dropReq(x)
			x.state = enginekit.Inflight
			x.err = nil
			x.gen++
			p.inflight[x.id] = x
			a.held = append(a.held, heldXfer{x, x.gen})
			return nil
		}
	}
	return a.post(x)
}

// post makes and posts x's NIXL request.
func (a *Agent) post(x *xfer) error {
	p := x.remote.Peer
	id := x.id
	a.dropReq(x)
	op := C.int32_t(C.ECXNIXL_OP_READ)
	if x.op == nixl.Write {
		op = C.ECXNIXL_OP_WRITE
	}
	var notif unsafe.Pointer
	if len(x.notif) > 0 {
		notif = unsafe.Pointer(&x.notif[0])
	}
	var li, ri *C.int32_t
	if len(x.lidx) > 0 {
		li = (*C.int32_t)(unsafe.Pointer(&x.lidx[0]))
		ri = (*C.int32_t)(unsafe.Pointer(&x.ridx[0]))
	}
	var req *C.ecxnixl_req
	st := C.ecx_dl_post(a.lib.c, a.c, op, x.local.c, li, x.remote.c, ri, C.size_t(len(x.lidx)),
		notif, C.size_t(len(x.notif)), &req)
	if st < 0 {
		a.markGone(p, int32(st))
		return xferPostErr(int32(st), id)
	}
	x.req = req
	x.state = enginekit.Inflight
	x.err = nil
	x.gen++
	x.slot = len(a.inflight)
	a.inflight = append(a.inflight, x)
	a.reqs = append(a.reqs, req)
	p.inflight[x.id] = x
	return nil
}

// markGone marks p gone when a request to it ended with code
// REMOTE_DISCONNECT, or NOT_FOUND: NIXL invalidates a peer itself when a
// transfer finds it disconnected (its C API reports that one as a backend
// error), and from then on reports every request to it as NOT_FOUND. A
// peer gone is refused by LoadRemoteMetadata, whatever the blob, so that
// the caller invalidates it and loads it anew; before, loading the same
// blob again changed nothing, and every READ of it failed.
func (a *Agent) markGone(p *peer, code int32) {
	if p.Dead != nil {
		return
	}
	switch nixl.Status(code) {
	case nixl.ErrRemoteDisconnect:
		p.Dead = nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: peer %q disconnected", p.name)
	case nixl.ErrNotFound:
		p.Dead = nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: peer %q is no longer known to NIXL (invalidated after a disconnect)", p.name)
	}
}

func xferPostErr(code int32, id nixl.XferID) error {
	if nixl.Status(code) == nixl.ErrNotFound {
		return nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: posting xfer %d: peer gone", id)
	}
	return codeErr(code, "posting xfer %d", id)
}

// unlink removes an in-flight x from the in-flight arrays.
func (a *Agent) unlink(x *xfer) {
	i := x.slot
	if i < 0 {
		return
	}
	last := len(a.inflight) - 1
	if i != last {
		a.inflight[i] = a.inflight[last]
		a.reqs[i] = a.reqs[last]
		a.inflight[i].slot = i
	}
	a.inflight[last] = nil
	a.reqs[last] = nil
	a.inflight = a.inflight[:last]
	a.reqs = a.reqs[:last]
	x.slot = -1
}

// dropReq releases x's NIXL request, cancelling it if in flight.
func (a *Agent) dropReq(x *xfer) {
	if x.req != nil {
		_ = C.ecx_dl_release_req(a.lib.c, a.c, x.req)
		x.req = nil
	}
}

// bury turns x's in-flight NIXL request into a zombie.
func (a *Agent) bury(x *xfer) {
	if x.req == nil {
		return
	}
	z := zombie{req: x.req, peer: x.remote.Peer, mems: x.mems}
	if x.op == nixl.Read {
		z.spans = make([]enginekit.Interval, 0, len(x.lidx))
		for _, li := range x.lidx {
			d := x.local.Descs[li]
			z.spans = append(z.spans, enginekit.Interval{Lo: d.Addr, Hi: d.Addr + d.Len})
		}
		a.zdirty = true
	}
	a.zombies = append(a.zombies, z)
	enginekit.AddRefs(x.mems, 1)
	x.remote.Peer.zombies++
	x.req = nil
}

// reap polls the zombies with one call and releases those that finished;
// a draining peer whose last zombie finished is invalidated in NIXL.
func (a *Agent) reap() {
	n := len(a.zombies)
	if n == 0 {
		return
	}
	a.zreqs = a.zreqs[:0]
	for _, z := range a.zombies {
		a.zreqs = append(a.zreqs, z.req)
	}
	if cap(a.zsts) < n {
		a.zsts = make([]int32, n, 2*n)
	}
	a.zsts = a.zsts[:n]
	if C.ecx_dl_status(a.lib.c, a.c, &a.zreqs[0], (*C.int32_t)(unsafe.Pointer(&a.zsts[0])), C.size_t(n)) <= 0 {
		clear(a.zreqs)
		return
	}
	k := 0
	for i, z := range a.zombies {
		if a.zsts[i] == int32(nixl.InProgress) {
			a.zombies[k] = z
			k++
			continue
		}
		_ = C.ecx_dl_release_req(a.lib.c, a.c, z.req)
		enginekit.AddRefs(z.mems, -1)
		a.zdirty = a.zdirty || len(z.spans) > 0
		z.peer.zombies--
		if z.peer.zombies == 0 && z.peer.draining {
			z.peer.draining = false
			delete(a.draining, z.peer.name)
			_ = a.forget(z.peer.name, true)
		}
	}
	clear(a.zombies[k:])
	a.zombies = a.zombies[:k]
	clear(a.zreqs)
}

// heldXfer is a READ held behind zombies; gen tells a reposted request
// from the one that was held.
type heldXfer struct {
	x   *xfer
	gen uint64
}

// releaseHeld posts, oldest first, the held READs no zombie may write
// under any more (after reap). One that cannot be posted ends with why.
// It reports whether it posted or ended any.
func (a *Agent) releaseHeld() bool {
	did := false
	keep := a.held[:0]
	for _, h := range a.held {
		x := h.x
		if x.gen != h.gen || x.state != enginekit.Inflight || a.xfers[x.id] != x {
			continue // released, or ended with its peer
		}
		if a.zombieFenced(x) {
			keep = append(keep, h)
			continue
		}
		did = true
		p := x.remote.Peer
		delete(p.inflight, x.id)
		err := p.Dead
		if err == nil && (!x.remote.Valid || a.peers[p.name] != p) {
			err = nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: xfer %d: peer %q is gone", x.id, p.name)
		}
		if err == nil {
			err = a.post(x)
		}
		if err != nil {
			x.state = enginekit.Done
			x.err = err
			a.pending.Push(x.id, x.gen, err)
		}
	}
	clear(a.held[len(keep):])
	a.held = keep
	return did
}

// zombieFenced reports whether a local block of READ x overlaps what a
// zombie READ may still write.
func (a *Agent) zombieFenced(x *xfer) bool {
	if a.zdirty {
		m := a.zspans[:0]
		for _, z := range a.zombies {
			m = append(m, z.spans...)
		}
		a.zspans, a.zdirty = enginekit.MergeIntervals(m), false
	}
	if len(a.zspans) == 0 {
		return false
	}
	for _, li := range x.lidx {
		d := x.local.Descs[li]
		if enginekit.Overlaps(a.zspans, d.Addr, d.Addr+d.Len) {
			return true
		}
	}
	return false
}

// drainWait bounds how long loading a peer waits for the zombies of its
// previous incarnation.
const drainWait = 2 * time.Second

// drain reaps until p has no zombies left, at most for wait.
func (a *Agent) drain(p *peer, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for p.zombies > 0 {
		a.reap()
		if p.zombies == 0 {
			break
		}
		if time.Now().After(deadline) {
			return nixl.Errorf(nixl.ErrBackend, "libnixl: %d transfers to the previous %q are still running", p.zombies, p.name)
		}
		time.Sleep(50 * time.Microsecond)
	}
	return nil
}

// finish records the final status of in-flight x.
func (a *Agent) finish(x *xfer, code int32) {
	a.unlink(x)
	delete(x.remote.Peer.inflight, x.id)
	x.state = enginekit.Done
	x.err = xferErr(code, x.id)
	a.markGone(x.remote.Peer, code)
	a.pending.Push(x.id, x.gen, x.err)
	if n := a.pending.Len(); n > 1024 && n > 2*len(a.xfers) {
		// A caller that checks XferStatus and never polls completions
		// would otherwise grow the queue for good.
		a.pending.Compact(a.live)
	}
}

// checkInflight asks NIXL for the status of every in-flight request, in one
// call, and moves the finished ones to the pending queue.
func (a *Agent) checkInflight() int {
	n := len(a.inflight)
	if n == 0 {
		return 0
	}
	if cap(a.sts) < n {
		a.sts = make([]int32, n, 2*n)
	}
	a.sts = a.sts[:n]
	done := C.ecx_dl_status(a.lib.c, a.c, &a.reqs[0], (*C.int32_t)(unsafe.Pointer(&a.sts[0])), C.size_t(n))
	if done <= 0 {
		return 0
	}
	// Backwards, so that unlinking (which moves the last entry into the
	// freed slot) never skips an entry not yet looked at.
	for i := n - 1; i >= 0; i-- {
		if a.sts[i] != int32(nixl.InProgress) {
			a.finish(a.inflight[i], a.sts[i])
		}
	}
	return int(done)
}

// XferStatus implements nixl.Agent. A request that was never posted reports
// (false, ErrNotPosted).
func (a *Agent) XferStatus(id nixl.XferID) (bool, error) {
	if a.closed {
		return true, errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return true, kit.XferNotFound(id)
	}
	switch x.state {
	case enginekit.Idle:
		return false, nixl.ErrNotPosted
	case enginekit.Inflight:
		if x.req == nil {
			return false, nil // held behind a zombie (releaseHeld)
		}
		a.one[0] = x.req
		C.ecx_dl_status(a.lib.c, a.c, &a.one[0], (*C.int32_t)(unsafe.Pointer(&a.oneSt[0])), 1)
		a.one[0] = nil
		if a.oneSt[0] == int32(nixl.InProgress) {
			return false, nil
		}
		a.finish(x, a.oneSt[0])
	}
	return true, x.err
}

// ReleaseXfer implements nixl.Agent. An in-flight request is not reported
// any more, but it is not cancelled in NIXL: it runs to its end as a zombie
// (see zombie), so its data may still land in local memory and its
// notification may still be sent.
func (a *Agent) ReleaseXfer(id nixl.XferID) error {
	if a.closed {
		return errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return kit.XferNotFound(id)
	}
	if x.state == enginekit.Inflight {
		a.unlink(x)
		delete(x.remote.Peer.inflight, id)
		a.bury(x)
	} else {
		a.dropReq(x)
	}
	enginekit.AddRefs(x.mems, -1)
	x.mems = nil
	delete(a.xfers, id)
	return nil
}

// PollCompletions implements nixl.Agent.
func (a *Agent) PollCompletions(dst []nixl.Completion) int {
	if a.closed {
		return 0
	}
	return a.pending.Poll(dst, a.live)
}

// live reports whether a queued completion of post gen of request id may
// still be reported.
func (a *Agent) live(id nixl.XferID, gen uint64) bool {
	x := a.xfers[id]
	return x != nil && x.gen == gen && x.state == enginekit.Done
}
