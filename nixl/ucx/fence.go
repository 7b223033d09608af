package ucx

import (
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// Fences. UCX 1.13 cannot cancel a get: a READ released (or ended by the
// transport's timeout) while some of its gets are outstanding may still
// have a reply land in its local blocks later, for example when a silent
// link to the peer comes back. A later READ into the same local memory
// must not complete before that: the late reply would overwrite its bytes
// with the old peer's. So the local ranges of such an orphaned READ are
// fenced until ecx_drain reports its end, and a READ posted into fenced
// memory is held (in flight, nothing posted) until no fence covers it.
//
// With the default transports a same-host peer's gets complete inside
// ucp_get_nbx and leave no orphans; emulated ones do (tcp alone, or shared
// memory without cma). Once such a peer has failed or been removed, its
// fences are lifted when its process has exited (its pidfd, kept for that
// until then): its endpoint (error mode NONE) cannot be force-closed, and
// over shared memory its orphans would never end; a process that is gone
// sends nothing more (what it sent before it died and UCX has not read yet
// may still land: the fence does not cover that). Until then, or until its
// gets call back, they stay. A peer on another host (mode PEER) has its
// endpoint closed, and UCX ends its outstanding gets then.

// span is a fenced range of local addresses, [Lo, Hi).
type span = enginekit.Interval

// fence is one orphaned READ's local ranges.
type fence struct {
	peer  *peer
	spans []span
}

// heldXfer is a READ waiting for fences over its local memory; gen tells a
// recycled request from the one that was held.
type heldXfer struct {
	x   *xfer
	gen uint64
}

// fenceOrphan fences x's local ranges: x was a READ cancelled with gets
// outstanding.
func (a *Agent) fenceOrphan(x *xfer) {
	if x.op != nixl.Read || x.nranges == 0 {
		return
	}
	f := fence{peer: x.peer, spans: make([]span, 0, x.nranges)}
	for _, r := range unsafe.Slice(x.ranges, x.nranges) {
		f.spans = append(f.spans, span{Lo: uint64(r.local), Hi: uint64(r.local) + uint64(r.len)})
	}
	a.fences[x.id] = f
	a.fencesChanged()
}

// fencesChanged records a change of a.fences: for the loop's own look
// (mergeFences, when next needed) and for other goroutines' (Fencing at
// once; Fenced's view is stale, so answers true, until Progress
// publishes the new one).
func (a *Agent) fencesChanged() {
	a.fenceDirty = true
	a.fenceN.Store(int64(len(a.fences)))
	a.fenceGen.Add(1)
}

// fenceView is the merged fence spans as of change gen.
type fenceView struct {
	gen   uint64
	spans []span
}

// publishFences gives other goroutines the fences as they are now, once
// per batch of changes (Progress calls it: a storm of cancelled READs
// merges once, not once per READ).
func (a *Agent) publishFences() {
	gen := a.fenceGen.Load()
	if v := a.fenceView.Load(); v != nil && v.gen == gen {
		return
	}
	if a.fenceDirty {
		a.mergeFences()
	}
	a.fenceView.Store(&fenceView{gen: gen, spans: slices.Clone(a.fenceSpans)})
}

var _ nixl.LocalFencer = (*Agent)(nil)

// Fencing reports whether local memory is fenced (nixl.LocalFencer); any
// goroutine may call it.
func (a *Agent) Fencing() bool { return a.fenceN.Load() > 0 }

// FenceVersion implements nixl.LocalFencer: the change of the fences
// Fenced answers from; any goroutine may call it.
func (a *Agent) FenceVersion() uint64 {
	if v := a.fenceView.Load(); v != nil {
		return v.gen
	}
	return 0
}

// Fenced reports whether [addr, addr+n) may overlap a fence
// (nixl.LocalFencer); any goroutine may call it. Until Progress has
// published the fences after a change it answers true.
func (a *Agent) Fenced(addr, n uint64) bool {
	if a.fenceN.Load() == 0 || n == 0 {
		return false
	}
	v := a.fenceView.Load()
	if v == nil || v.gen != a.fenceGen.Load() {
		return true
	}
	return enginekit.Overlaps(v.spans, addr, addr+min(n, ^addr))
}

// liftFence drops the fence of orphan id, if it has one; drainC then
// posts the READs no fence holds any more.
func (a *Agent) liftFence(id nixl.XferID) {
	if _, ok := a.fences[id]; !ok {
		return
	}
	delete(a.fences, id)
	a.fenceLifted = true
	a.fencesChanged()
}

// liftPeerFences drops the fences of p's orphans (see above).
func (a *Agent) liftPeerFences(p *peer) {
	n := len(a.fences)
	for id, f := range a.fences {
		if f.peer == p {
			delete(a.fences, id)
		}
	}
	if len(a.fences) != n {
		a.fencesChanged()
		a.releaseHeld()
	}
}

// fenced reports whether one of x's local ranges overlaps a fence.
func (a *Agent) fenced(x *xfer) bool {
	if len(a.fences) == 0 || x.op != nixl.Read {
		return false
	}
	if a.fenceDirty {
		a.mergeFences()
	}
	for _, r := range unsafe.Slice(x.ranges, x.nranges) {
		if enginekit.Overlaps(a.fenceSpans, uint64(r.local), uint64(r.local)+uint64(r.len)) {
			return true
		}
	}
	return false
}

// mergeFences sorts and merges every fence's spans into a.fenceSpans.
func (a *Agent) mergeFences() {
	m := a.fenceSpans[:0]
	for _, f := range a.fences {
		m = append(m, f.spans...)
	}
	a.fenceSpans = enginekit.MergeIntervals(m)
	a.fenceDirty = false
}

// hold makes x, a READ into fenced memory, in flight without posting it.
func (a *Agent) hold(x *xfer) {
	x.state = enginekit.Inflight
	x.err = nil
	x.gen++
	x.peer.inflight[x.id] = x
	a.held = append(a.held, heldXfer{x, x.gen})
}

// unhold forgets x if it is held (released, or failed with its peer).
func (a *Agent) unhold(x *xfer) {
	a.held = slices.DeleteFunc(a.held, func(h heldXfer) bool { return h.x == x })
}

// releaseHeld posts, oldest first, the held READs no fence covers any more.
// One that fails to post ends with that error.
func (a *Agent) releaseHeld() {
	if len(a.held) == 0 {
		return
	}
	keep := a.held[:0]
	for _, h := range a.held {
		x := h.x
		if x.gen != h.gen || x.state != enginekit.Inflight || a.xfers[x.id] != x {
			continue
		}
		if a.fenced(x) {
			keep = append(keep, h)
			continue
		}
		delete(x.peer.inflight, x.id)
		err := x.peer.Dead
		if err == nil {
			err = a.post(x)
			// Posted without PostXfer's poll of the peer's pidfd, which
			// may be up to LivenessPoll old: a same-host peer that died
			// since would serve these gets from the segment it left.
			x.recheck = true
		}
		if err != nil {
			x.state = enginekit.Done
			x.err = err
			a.pending.Push(x.id, x.gen, err)
		}
	}
	clear(a.held[len(keep):])
	a.held = keep
}

// hasFences reports whether an orphan of p fences local memory.
func (a *Agent) hasFences(p *peer) bool {
	for _, f := range a.fences {
		if f.peer == p {
			return true
		}
	}
	return false
}

// watchGone keeps a duplicate of the pidfd of p, which is being removed or
// failed while its process lives and its orphans fence local memory, so
// that checkGone lifts them once the process exits. It reports false when
// it cannot (the caller then lifts them at once rather than for ever).
func (a *Agent) watchGone(p *peer) bool {
	fd, err := unix.FcntlInt(uintptr(p.pidfd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return false
	}
	a.gone[p] = fd
	return true
}

// checkGone lifts the fences of the removed peers whose process has exited
// and stops watching those without fences; it reports whether it lifted
// any.
func (a *Agent) checkGone() bool {
	lifted := false
	for p, fd := range a.gone {
		has := a.hasFences(p)
		if has && !exited(fd) {
			continue
		}
		unix.Close(fd)
		delete(a.gone, p)
		if has {
			a.liftPeerFences(p)
			lifted = true
		}
	}
	return lifted
}
