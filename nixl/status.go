package nixl

import "fmt"

// Status is one of NIXL's status codes. The negative ones are errors and
// work with errors.Is; success is reported as a nil error, never as a
// Status.
type Status int32

// NIXL's status codes, with the same numeric values as nixl_status_t.
const (
	InProgress          Status = 1
	Success             Status = 0
	ErrNotPosted        Status = -1
	ErrInvalidParam     Status = -2
	ErrBackend          Status = -3
	ErrNotFound         Status = -4
	ErrMismatch         Status = -5
	ErrNotAllowed       Status = -6
	ErrRepostActive     Status = -7
	ErrUnknown          Status = -8
	ErrNotSupported     Status = -9
	ErrRemoteDisconnect Status = -10
	ErrCanceled         Status = -11
)

var statusNames = map[Status]string{
	InProgress:          "NIXL_IN_PROG",
	Success:             "NIXL_SUCCESS",
	ErrNotPosted:        "NIXL_ERR_NOT_POSTED",
	ErrInvalidParam:     "NIXL_ERR_INVALID_PARAM",
	ErrBackend:          "NIXL_ERR_BACKEND",
	ErrNotFound:         "NIXL_ERR_NOT_FOUND",
	ErrMismatch:         "NIXL_ERR_MISMATCH",
	ErrNotAllowed:       "NIXL_ERR_NOT_ALLOWED",
	ErrRepostActive:     "NIXL_ERR_REPOST_ACTIVE",
	ErrUnknown:          "NIXL_ERR_UNKNOWN",
	ErrNotSupported:     "NIXL_ERR_NOT_SUPPORTED",
	ErrRemoteDisconnect: "NIXL_ERR_REMOTE_DISCONNECT",
	ErrCanceled:         "NIXL_ERR_CANCELED",
}

// String returns NIXL's name for the code.
func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("NIXL_STATUS(%d)", int32(s))
}

// Error implements error.
func (s Status) Error() string { return "nixl: " + s.String() }

// FromCode converts a raw nixl_status_t to an error: nil for success and
// in-progress, the Status for a known error code, ErrUnknown wrapped with
// the number for anything else.
func FromCode(code int32) error {
	s := Status(code)
	if s >= 0 {
		return nil
	}
	if _, ok := statusNames[s]; ok {
		return s
	}
	return Errorf(ErrUnknown, "unrecognised status code %d", code)
}

// Error is a Status with context. errors.Is(err, nixl.ErrX) matches its
// Status.
type Error struct {
	Status Status
	Msg    string
}

func (e *Error) Error() string { return e.Status.Error() + ": " + e.Msg }

// Unwrap returns the Status.
func (e *Error) Unwrap() error { return e.Status }

// Errorf returns an *Error with Status s and a formatted message.
func Errorf(s Status, format string, args ...any) error {
	return &Error{Status: s, Msg: fmt.Sprintf(format, args...)}
}
