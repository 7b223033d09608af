package reactor

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
)

// The errors the reactor reports. The ecxfer package re-exports them under
// the same names; they work with errors.Is.
var (
	ErrUnknownPeer      = errors.New("ecxfer: unknown peer")
	ErrIndexMismatch    = errors.New("ecxfer: index lists differ in length")
	ErrIndexRange       = errors.New("ecxfer: block index out of range")
	ErrBadHandle        = errors.New("ecxfer: unknown, released or stale handle")
	ErrBadMetadata      = errors.New("ecxfer: bad agent metadata")
	ErrBadDescriptor    = errors.New("ecxfer: bad memory descriptor")
	ErrBadNotif         = errors.New("ecxfer: notification too large")
	ErrClosed           = errors.New("ecxfer: transport closed")
	ErrBusy             = errors.New("ecxfer: too many transfers in flight")
	ErrRemoteDisconnect = errors.New("ecxfer: remote peer disconnected")
	ErrTimeout          = errors.New("ecxfer: transfer timed out")
	ErrCanceled         = errors.New("ecxfer: transfer canceled")
	ErrEngine           = errors.New("ecxfer: transfer engine error")
	ErrConfig           = errors.New("ecxfer: bad config")
	// ErrReactorThread: a call that would wait for the reactor's thread
	// was made on that thread (from a Logger handler): it would wait for
	// itself.
	ErrReactorThread     = errors.New("ecxfer: called on the reactor's own thread (an event handler), which it would wait for")
	errUnsupportedOption = errors.New("reactor: unsupported option")
)

var codeErrs = [numCodes]error{
	codeNone:             nil,
	codeRemoteDisconnect: ErrRemoteDisconnect,
	codeTimeout:          ErrTimeout,
	codeCanceled:         ErrCanceled,
	codeEngine:           ErrEngine,
	codeUnknownPeer:      ErrUnknownPeer,
	codeClosed:           ErrClosed,
}

// codeOf maps an engine error onto the code stored in a slot word.
func codeOf(err error) uint64 {
	switch {
	case errors.Is(err, nixl.ErrRemoteDisconnect):
		return codeRemoteDisconnect
	case errors.Is(err, nixl.ErrCanceled):
		return codeCanceled
	case errors.Is(err, ErrTimeout):
		return codeTimeout
	case errors.Is(err, ErrUnknownPeer):
		return codeUnknownPeer
	case errors.Is(err, ErrClosed):
		return codeClosed
	}
	return codeEngine
}

func wrapf(sentinel error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", sentinel, fmt.Sprintf(format, args...))
}

// maxQuotedName bounds how much of a peer name an error quotes: agent
// names have at most 256 bytes, and a caller's garbage name may have
// megabytes.
const maxQuotedName = 256

// QuoteName quotes name for an error message, cut at maxQuotedName bytes
// (then its length), as every error of this package that names a peer.
func QuoteName(name string) string {
	if len(name) <= maxQuotedName {
		return fmt.Sprintf("%q", name)
	}
	return fmt.Sprintf("%q... (%d bytes)", name[:maxQuotedName], len(name))
}

// outOfResources reports whether err is this process running out of
// descriptors or memory (an errno in its chain), not a fault of what the
// caller passed.
func outOfResources(err error) bool {
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) || errors.Is(err, unix.ENOMEM)
}
