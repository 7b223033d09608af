package nixl

import (
	"github.com/ecxfer/ecxfer/descriptors"
)

// MemType says where a registered region lives.
type MemType uint8

const (
	// DRAM is host memory.
	DRAM MemType = iota
	// VRAM is device memory. Reserved: no backend supports it yet.
	VRAM
)

func (m MemType) String() string {
	switch m {
	case DRAM:
		return "DRAM"
	case VRAM:
		return "VRAM"
	}
	return "MemType(?)"
}

// Op is the direction of a transfer, seen from the initiator.
type Op uint8

const (
	// Read moves bytes from the remote list into the local list.
	Read Op = iota
	// Write moves bytes from the local list into the remote list.
	Write
)

func (o Op) String() string {
	switch o {
	case Read:
		return "READ"
	case Write:
		return "WRITE"
	}
	return "Op(?)"
}

// MemID names a region registered with an Agent. Zero is never valid.
type MemID uint64

// DlistID names a prepared descriptor list. Zero is never valid.
type DlistID uint64

// XferID names a transfer request. Zero is never valid.
type XferID uint64

// Completion reports that a posted transfer left the in-progress state.
// Err is nil when every byte landed (and the notification, if any, was
// handed to the engine); otherwise it wraps one of the Status errors.
type Completion struct {
	ID  XferID
	Err error
}

// Agent is a Go rendering of NIXL's agent. It owns one transfer engine.
//
// Concurrency contract: an Agent is driven by exactly one goroutine (in
// ecxfer, the reactor's locked OS thread). No method may be called
// concurrently with another on the same Agent; implementations do no
// locking of their own on the hot path. The only exception is Close, which
// may be called once the driving goroutine has stopped using the Agent.
//
// Memory: slices passed to RegisterMem must live outside the Go heap (mmap
// or C.malloc), because the engine and remote peers access them while Go
// code runs. AllocMem returns engine-allocated memory, likewise outside the
// Go heap, valid until DeregisterMem or Close.
//
// Errors: success is nil. Failures wrap a Status (errors.Is(err,
// nixl.ErrNotFound) and so on).
type Agent interface {
	// Name is the agent's name, as peers know it.
	Name() string

	// RegisterMem registers caller memory for transfers.
	RegisterMem(buf []byte, mem MemType, devID uint64) (MemID, error)
	// AllocMem allocates and registers length bytes owned by the engine.
	AllocMem(length int, mem MemType, devID uint64) (MemID, []byte, error)
	// DeregisterMem releases a region. Fails with ErrNotAllowed while a
	// prepared list or an in-flight transfer still uses it, including a
	// released transfer whose operations the engine could not cancel and
	// that may still write it, and (ucx) while answers to a peer's
	// gathered READ still read it after a bounded wait. It does not revoke what peers loaded: a
	// peer holding this agent's metadata may still address the region,
	// so a region is deregistered once no peer will read it (as NIXL's
	// own agents require).
	DeregisterMem(id MemID) error

	// LocalMetadata serializes what a peer needs to reach this agent's
	// registered memory (name, engine address, regions, keys).
	LocalMetadata() ([]byte, error)
	// LoadRemoteMetadata decodes and loads a peer's metadata and returns its
	// name. Loading identical metadata again returns the same name.
	// Different metadata under a loaded name fails with ErrNotAllowed until
	// the old one is invalidated; that error is returned together with the
	// name, so the caller knows which peer to invalidate. Malformed metadata fails with
	// ErrInvalidParam; it never crashes.
	LoadRemoteMetadata(md []byte) (string, error)
	// InvalidateRemoteMetadata forgets a peer: its prepared lists become
	// invalid and its in-flight transfers end with ErrRemoteDisconnect.
	// Unknown names fail with ErrNotFound.
	InvalidateRemoteMetadata(name string) error

	// PrepDlist prepares a descriptor list for transfers. peer == "" means
	// the agent's own memory; otherwise the list describes the named peer's
	// memory. Every descriptor must lie inside one registered (local) or
	// advertised (remote) region, else ErrInvalidParam; unknown peers
	// ErrNotFound.
	PrepDlist(peer string, descs descriptors.List, mem MemType) (DlistID, error)
	// ReleaseDlist frees a prepared list. Unknown IDs fail with ErrNotFound.
	ReleaseDlist(id DlistID) error

	// MakeXfer builds a request moving localIdx[i] <-> remoteIdx[i] between
	// two prepared lists. Index lists must have equal length and be in
	// range, and the paired descriptors must have equal lengths
	// (ErrInvalidParam / ErrMismatch). Consecutive runs are merged. The
	// indices and notif are copied; the caller may reuse them. A non-empty
	// notif is delivered to the data owner after the data has landed.
	MakeXfer(op Op, local DlistID, localIdx []int, remote DlistID, remoteIdx []int, notif []byte) (XferID, error)
	// PostXfer starts a request. It never waits for data. Posting a request
	// that is still in flight fails with ErrRepostActive.
	PostXfer(id XferID) error
	// XferStatus reports (false, nil) while in flight, (true, nil) once done,
	// (true, err) on failure. Unknown IDs report ErrNotFound.
	XferStatus(id XferID) (done bool, err error)
	// ReleaseXfer frees a request, cancelling it if it is in flight. A
	// cancelled request is not reported by PollCompletions.
	ReleaseXfer(id XferID) error

	// PollCompletions copies into dst the requests that finished since the
	// last call, each exactly once, and returns how many it copied. Requests
	// left over stay queued for the next call.
	PollCompletions(dst []Completion) int

	// SendNotif sends msg to a loaded peer, outside any transfer.
	SendNotif(peer string, msg []byte) error
	// GetNotifs appends the notifications received since the last call to
	// dst (sender name -> messages) and returns how many it added. Each
	// message is a fresh slice owned by the caller.
	GetNotifs(dst map[string][][]byte) int

	// Progress advances the engine once. It reports whether it did any work.
	Progress() (bool, error)
	// EventFD returns a file descriptor that becomes readable when the
	// engine has work, or -1 when the engine cannot be waited on.
	EventFD() int
	// Arm prepares EventFD for sleeping. It returns false when events are
	// already pending, in which case the caller must progress again instead
	// of sleeping.
	Arm() (bool, error)

	// Close cancels every request, releases every list, peer and region and
	// shuts the engine down. It is idempotent.
	Close() error
}
