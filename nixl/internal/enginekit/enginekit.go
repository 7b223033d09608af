// Package enginekit holds the pure-Go bookkeeping that the cgo engines
// (nixl/ucx and nixl/libnixl) share: ID allocation, the queue of finished
// transfers, the set of registered regions, the set of prepared lists with
// the state of a list and of a peer that the checks read (ListBase,
// PeerBase), and the argument checks and error messages of the nixl.Agent
// methods, parameterised by the engine's message prefix.
//
// Nothing here calls C; each engine keeps its handles and C calls to itself.
//
// What stays in each engine on purpose: the "if a.closed" guard that opens
// every method. It is one line whose zero results differ per method; a
// shared wrapper would cost a closure per call on the hot path and hide the
// early return, for no line saved.
package enginekit

import (
	"errors"
	"sync"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// UCXInit is held while an engine starts UCX in this process: the ucx
// engine reading UCX's configuration from the environment, and libnixl's
// first agent, which sets UCX_MODULES for the moment it loads NIXL's own
// UCX plugin (and whose agent reads its configuration too). glibc's
// setenv is not safe against a getenv on another thread, so the two must
// not overlap.
var UCXInit sync.Mutex

// MaxNotifLimit caps an engine's configured notification size.
const MaxNotifLimit = 1 << 20

// Prefix is an engine's error-message prefix ("ucx", "libnixl"). Its
// methods build the errors both engines report for the same conditions.
type Prefix string

// Errorf returns nixl.Errorf(s, "<prefix>: "+format, args...).
func (p Prefix) Errorf(s nixl.Status, format string, args ...any) error {
	return nixl.Errorf(s, string(p)+": "+format, args...)
}

// Closed is the error every method of a closed agent returns.
func (p Prefix) Closed() error { return p.Errorf(nixl.ErrNotAllowed, "agent is closed") }

// CheckConfig validates an agent name (1..maxName bytes) and the
// notification limit, replacing a zero *maxNotif with def.
func (p Prefix) CheckConfig(name string, maxName int, maxNotif *int, def int) error {
	if name == "" || len(name) > maxName {
		return p.Errorf(nixl.ErrInvalidParam, "name must be 1..%d bytes", maxName)
	}
	if *maxNotif == 0 {
		*maxNotif = def
	}
	if *maxNotif < 0 || *maxNotif > MaxNotifLimit {
		return p.Errorf(nixl.ErrInvalidParam, "MaxNotif %d out of range 1..%d", *maxNotif, MaxNotifLimit)
	}
	return nil
}

// CheckMem refuses memory types other than DRAM.
func (p Prefix) CheckMem(mem nixl.MemType) error {
	if mem != nixl.DRAM {
		return p.Errorf(nixl.ErrNotSupported, "%v memory", mem)
	}
	return nil
}

// CheckRegister checks RegisterMem's arguments.
func (p Prefix) CheckRegister(buf []byte, mem nixl.MemType) error {
	if err := p.CheckMem(mem); err != nil {
		return err
	}
	if len(buf) == 0 {
		return p.Errorf(nixl.ErrInvalidParam, "empty region")
	}
	return nil
}

// CheckAlloc checks AllocMem's arguments.
func (p Prefix) CheckAlloc(length int, mem nixl.MemType) error {
	if err := p.CheckMem(mem); err != nil {
		return err
	}
	if length <= 0 {
		return p.Errorf(nixl.ErrInvalidParam, "length %d", length)
	}
	return nil
}

// CheckNotif refuses a notification longer than limit.
func (p Prefix) CheckNotif(n, limit int) error {
	if n > limit {
		return p.Errorf(nixl.ErrInvalidParam, "notification of %d bytes, limit %d", n, limit)
	}
	return nil
}

// PeerNotFound is the error for an unknown peer name.
func (p Prefix) PeerNotFound(name string) error { return p.Errorf(nixl.ErrNotFound, "peer %q", name) }

// DlistNotFound is the error for an unknown list.
func (p Prefix) DlistNotFound(id nixl.DlistID) error {
	return p.Errorf(nixl.ErrNotFound, "dlist %d", id)
}

// XferNotFound is the error for an unknown request.
func (p Prefix) XferNotFound(id nixl.XferID) error { return p.Errorf(nixl.ErrNotFound, "xfer %d", id) }

// OtherMetadata is the error for different metadata under a loaded name.
func (p Prefix) OtherMetadata(name string) error {
	return p.Errorf(nixl.ErrNotAllowed, "peer %q is loaded with other metadata; invalidate it first", name)
}

// Invalidated is the error that ends transfers to an invalidated peer.
func (p Prefix) Invalidated(name string) error {
	return p.Errorf(nixl.ErrRemoteDisconnect, "peer %q was invalidated", name)
}

// Peer is the engine-independent state of a loaded peer.
type Peer interface {
	// Gone returns why the peer is unusable, nil while it is usable.
	Gone() error
}

// LivePeer returns peers[name] if it is loaded and usable; otherwise
// ErrNotFound or the reason it is gone.
func LivePeer[P interface {
	comparable
	Peer
}](p Prefix, peers map[string]P, name string) (P, error) {
	var zero P
	q, ok := peers[name]
	if !ok || q == zero {
		return zero, p.PeerNotFound(name)
	}
	if err := q.Gone(); err != nil {
		return zero, err
	}
	return q, nil
}

// Dlist is what the shared checks need to know of a prepared list.
type Dlist interface {
	// Remote reports whether the list describes a peer's memory.
	Remote() bool
	// Usable reports whether a remote list's peer is still loaded and
	// alive.
	Usable() bool
}

// XferLists checks MakeXfer's operation, lists and notification and
// returns the two lists.
func XferLists[D interface {
	comparable
	Dlist
}](p Prefix, dlists map[nixl.DlistID]D, op nixl.Op, local, remote nixl.DlistID, notif, maxNotif int) (ld, rd D, err error) {
	var zero D
	if op != nixl.Read && op != nixl.Write {
		return zero, zero, p.Errorf(nixl.ErrInvalidParam, "op %v", op)
	}
	ld, rd = dlists[local], dlists[remote]
	if ld == zero || rd == zero {
		return zero, zero, p.Errorf(nixl.ErrNotFound, "dlist %d or %d", local, remote)
	}
	if ld.Remote() {
		return zero, zero, p.Errorf(nixl.ErrInvalidParam, "dlist %d is not local", local)
	}
	if !rd.Remote() {
		return zero, zero, p.Errorf(nixl.ErrInvalidParam, "dlist %d is not a peer's", remote)
	}
	if !rd.Usable() {
		return zero, zero, p.Errorf(nixl.ErrRemoteDisconnect, "dlist %d belongs to a peer that is gone", remote)
	}
	if err := p.CheckNotif(notif, maxNotif); err != nil {
		return zero, zero, err
	}
	return ld, rd, nil
}

// MergeRuns is descriptors.MergeRuns with its errors mapped to
// ErrMismatch (paired lengths differ) or ErrInvalidParam. *buf is reused
// and keeps the result's storage for the next call.
func (p Prefix) MergeRuns(buf *[]descriptors.Range, local, remote descriptors.List, localIdx, remoteIdx []int) ([]descriptors.Range, error) {
	rs, err := descriptors.MergeRuns(*buf, local, remote, localIdx, remoteIdx)
	*buf = rs[:0]
	if err != nil {
		if errors.Is(err, descriptors.ErrLenMismatch) {
			return nil, p.Errorf(nixl.ErrMismatch, "%v", err)
		}
		return nil, p.Errorf(nixl.ErrInvalidParam, "%v", err)
	}
	return rs, nil
}

// XferState is where a transfer request is in its life.
type XferState uint8

const (
	// Idle: made, never posted.
	Idle XferState = iota
	// Inflight: posted and not finished.
	Inflight
	// Done: finished (successfully or not) since its last post.
	Done
)

// CheckPost returns the error for posting a request in state s, nil if it
// may be posted.
func (p Prefix) CheckPost(id nixl.XferID, s XferState) error {
	if s == Inflight {
		return p.Errorf(nixl.ErrRepostActive, "xfer %d is in flight", id)
	}
	return nil
}
