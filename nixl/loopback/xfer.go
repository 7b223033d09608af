package loopback

import (
	"errors"
	"fmt"
	"time"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

type xferState uint8

const (
	stIdle   xferState = iota // made, or cancelled; never posted since
	stPosted                  // waiting for Progress
	stDone                    // finished; err says how
)

// xfer is a transfer request.
type xfer struct {
	id            nixl.XferID
	op            nixl.Op
	local, remote *dlist
	ranges        []descriptors.Range // merged runs, local/remote addresses
	notif         []byte              // empty: no notification
	state         xferState
	err           error
	seq           uint64      // bumped by every post
	readyAt       time.Time   // zero: at the next Progress
	fault         nixl.Status // injected failure, 0 for none
	queued        bool        // a completion waits in the done queue
	released      bool
}

// pendingEntry refers to one post of x; it is stale once x was released
// or posted again.
type pendingEntry struct {
	x   *xfer
	seq uint64
}

func (e pendingEntry) live() bool {
	return !e.x.released && e.x.seq == e.seq && e.x.state == stPosted
}

// MakeXfer builds a request. local must be a local list and remote a list
// of a loaded peer. Index lists must be non-empty, of equal length and in
// range (else nixl.ErrInvalidParam), and paired descriptors of equal length
// (else nixl.ErrMismatch); the errors also wrap the descriptors package's.
func (a *Agent) MakeXfer(op nixl.Op, local nixl.DlistID, localIdx []int, remote nixl.DlistID, remoteIdx []int, notif []byte) (nixl.XferID, error) {
	if a.dead.Load() {
		return 0, ErrClosed
	}
	if op != nixl.Read && op != nixl.Write {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: unknown operation %d", uint8(op))
	}
	ld, ok := a.dlists[local]
	if !ok {
		return 0, nixl.Errorf(nixl.ErrNotFound, "loopback: unknown descriptor list %d", local)
	}
	rd, ok := a.dlists[remote]
	if !ok {
		return 0, nixl.Errorf(nixl.ErrNotFound, "loopback: unknown descriptor list %d", remote)
	}
	if ld.peer != nil {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: list %d describes peer %q's memory, not local memory", local, ld.peer.name)
	}
	if rd.peer == nil {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: list %d describes local memory, not a peer's", remote)
	}
	if err := a.usable(rd); err != nil {
		return 0, err
	}
	if len(localIdx) == 0 && len(remoteIdx) == 0 {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: empty transfer")
	}
	// Released requests are recycled with their buffers, so a steady
	// stream of make/post/release allocates nothing.
	var x *xfer
	if n := len(a.spare); n > 0 {
		x = a.spare[n-1]
		a.spare[n-1] = nil
		a.spare = a.spare[:n-1]
	} else {
		x = &xfer{}
	}
	ranges, err := descriptors.MergeRuns(x.ranges[:0], ld.descs, rd.descs, localIdx, remoteIdx)
	if err != nil {
		a.spare = append(a.spare, x)
		s := nixl.ErrInvalidParam
		if errors.Is(err, descriptors.ErrLenMismatch) {
			s = nixl.ErrMismatch
		}
		return 0, fmt.Errorf("%w: %w", s, err)
	}
	// seq carries over from the recycled request: entries that still point
	// at it from its previous life never match again.
	*x = xfer{id: nixl.XferID(a.newID()), op: op, local: ld, remote: rd, ranges: ranges, seq: x.seq, notif: x.notif[:0]}
	x.notif = append(x.notif, notif...) // deliverLocked copies it out
	a.xfers[x.id] = x
	return x.id, nil
}

// PostXfer starts a request; the bytes move during a later Progress (and
// no earlier than the configured delay). A request still in flight fails
// with nixl.ErrRepostActive; a finished one may be posted again, and its
// unreported completion is then dropped. Requests whose lists were
// released or whose peer was invalidated fail with nixl.ErrNotFound.
func (a *Agent) PostXfer(id nixl.XferID) error {
	x, err := live(a, a.xfers, id, "loopback: unknown request %d")
	if err != nil {
		return err
	}
	if x.state == stPosted {
		return nixl.Errorf(nixl.ErrRepostActive, "loopback: request %d is in flight", id)
	}
	if err := a.usable(x.local); err != nil {
		return err
	}
	if err := a.usable(x.remote); err != nil {
		return err
	}
	a.unqueue(x)
	x.seq++
	x.state, x.err = stPosted, nil
	x.fault = a.takeFault()
	x.readyAt = time.Time{}
	if d := a.delay.Load(); d > 0 {
		x.readyAt = time.Now().Add(time.Duration(d))
	}
	x.local.inflight++
	x.remote.inflight++
	if len(a.pending) == 0 {
		// Keep "a request is pending ⇒ the fd was signalled since Arm last
		// cleared it", which Arm relies on to leave the fd alone.
		a.signal()
	}
	a.pending = append(a.pending, pendingEntry{x: x, seq: x.seq})
	return nil
}

// unqueue drops x's unreported completion, if any.
func (a *Agent) unqueue(x *xfer) {
	if x.queued {
		x.queued = false
		a.queued--
	}
}

// XferStatus reports (false, nil) while x is in flight, (true, nil) when it
// finished well and (true, err) when it failed. A request never posted
// reports (false, nixl.ErrNotPosted); an unknown or released one (false,
// nixl.ErrNotFound).
func (a *Agent) XferStatus(id nixl.XferID) (bool, error) {
	x, err := live(a, a.xfers, id, "loopback: unknown request %d")
	if err != nil {
		return false, err
	}
	switch x.state {
	case stPosted:
		return false, nil
	case stDone:
		return true, x.err
	}
	return false, nixl.Errorf(nixl.ErrNotPosted, "loopback: request %d was not posted", id)
}

// ReleaseXfer frees a request, cancelling it if in flight: nothing is
// copied afterwards, no notification is sent and no completion reported.
// Its ID is never reused.
func (a *Agent) ReleaseXfer(id nixl.XferID) error {
	x, err := live(a, a.xfers, id, "loopback: unknown request %d")
	if err != nil {
		return err
	}
	if x.state == stPosted {
		x.local.inflight--
		x.remote.inflight--
	}
	a.unqueue(x)
	x.released = true
	x.state = stIdle
	x.seq++ // void every queue entry that refers to it
	delete(a.xfers, id)
	if len(a.spare) < maxSpare {
		x.local, x.remote, x.err = nil, nil, nil
		a.spare = append(a.spare, x)
	}
	return nil
}

// maxSpare bounds the recycled requests an agent keeps.
const maxSpare = 4096

// finish ends the current post of x.
func (a *Agent) finish(x *xfer, err error) {
	x.state, x.err = stDone, err
	x.local.inflight--
	x.remote.inflight--
	x.queued = true
	a.queued++
	a.done = append(a.done, pendingEntry{x: x, seq: x.seq})
}

// PollCompletions reports finished requests, oldest first, each once.
func (a *Agent) PollCompletions(dst []nixl.Completion) int {
	if a.dead.Load() {
		return 0
	}
	n := 0
	for n < len(dst) && a.doneHd < len(a.done) {
		e := a.done[a.doneHd]
		a.done[a.doneHd] = pendingEntry{}
		a.doneHd++
		x := e.x
		if x.released || x.seq != e.seq || !x.queued {
			continue // released or posted again since
		}
		a.unqueue(x)
		dst[n] = nixl.Completion{ID: x.id, Err: x.err}
		n++
	}
	switch {
	case a.doneHd == len(a.done):
		a.done, a.doneHd = a.done[:0], 0
	case a.doneHd > 64 && 2*a.doneHd > len(a.done):
		k := copy(a.done, a.done[a.doneHd:])
		clear(a.done[k:])
		a.done, a.doneHd = a.done[:k], 0
	}
	return n
}

// Progress runs every posted request that is due: it copies the bytes,
// delivers the notification and queues the completion. Requests whose
// peer is gone or disconnected fail even before they are due. It reports
// whether any request finished.
func (a *Agent) Progress() (bool, error) {
	if a.dead.Load() {
		return false, ErrClosed
	}
	if len(a.pending) == 0 {
		return false, nil
	}
	var now time.Time
	did := false
	keep := a.pending[:0]
	for _, e := range a.pending {
		if !e.live() {
			continue
		}
		x := e.x
		if !x.readyAt.IsZero() {
			if now.IsZero() {
				now = time.Now()
			}
			if now.Before(x.readyAt) {
				if err := a.check(x.remote.peer); err != nil {
					a.finish(x, err)
					did = true
					continue
				}
				keep = append(keep, e)
				continue
			}
		}
		a.finish(x, a.run(x))
		did = true
	}
	clear(a.pending[len(keep):])
	a.pending = keep
	return did, nil
}

// check reports whether p can be reached.
func (a *Agent) check(p *peer) error {
	t, err := a.reach(p)
	if err == nil {
		t.mu.Unlock()
	}
	return err
}

// run performs x: the copy, then the notification, both while holding the
// peer's lock so that the peer can neither release the memory nor go away
// in between.
func (a *Agent) run(x *xfer) error {
	if x.fault != 0 {
		return nixl.Errorf(x.fault, "loopback: injected failure")
	}
	t, err := a.reach(x.remote.peer)
	if err != nil {
		return err
	}
	defer t.mu.Unlock()
	for _, r := range x.ranges {
		if x.op == nixl.Read {
			err = copyRange(a.regions, t.regions, r.Local, r.Remote, r.Len)
		} else {
			err = copyRange(t.regions, a.regions, r.Remote, r.Local, r.Len)
		}
		if err != nil {
			return err
		}
	}
	if len(x.notif) > 0 {
		t.deliverLocked(a.name, x.notif)
	}
	return nil
}

// copyRange moves n bytes from src to dst, each address resolved in its
// agent's live regions; a range may span adjacent regions.
func copyRange(dstRegs, srcRegs []*region, dst, src, n uint64) error {
	for n > 0 {
		d := findRegion(dstRegs, dst)
		if d == nil {
			return nixl.Errorf(nixl.ErrBackend, "loopback: destination %#x is no longer registered", dst)
		}
		s := findRegion(srcRegs, src)
		if s == nil {
			return nixl.Errorf(nixl.ErrBackend, "loopback: source %#x is no longer registered", src)
		}
		db, sb := d.buf[dst-d.addr:], s.buf[src-s.addr:]
		k := min(n, uint64(len(db)), uint64(len(sb)))
		copy(db[:k], sb[:k])
		dst, src, n = dst+k, src+k, n-k
	}
	return nil
}
