package main

import (
	"context"
	"errors"

	"github.com/ecxfer/ecxfer"
)

// The error codes of the ABI. Their values are part of the ABI: never
// renumber one; add new ones at the end.
const (
	codeOK               = 0
	codeConfig           = -1
	codeUnknownPeer      = -2
	codeIndexMismatch    = -3
	codeIndexRange       = -4
	codeBadHandle        = -5
	codeBadMetadata      = -6
	codeBadDescriptor    = -7
	codeBadNotif         = -8
	codeClosed           = -9
	codeBusy             = -10
	codeRemoteDisconnect = -11
	codeTimeout          = -12
	codeCanceled         = -13
	codeEngine           = -14
	codeNoBackend        = -15
	codeBadArg           = -16
	codeUnknownTransport = -17
	// codeUnpacked is the Python builtins' "arguments left to the
	// general path" (pycalls.c); no error of the library's has it.
	codeUnpacked = -18
	codeOther    = -99
)

// errBadArg reports a malformed call: a null pointer with a non-zero
// length, a negative length, a region of 0 bytes, a name buffer too small,
// an unknown blob kind. (An unknown transport id is errUnknownTransport,
// an unknown peer ecxfer.ErrUnknownPeer.)
var errBadArg = errors.New("ecxfer: bad argument")

// errUnknownTransport reports a transport id that is not (or no longer)
// live.
var errUnknownTransport = errors.New("ecxfer: unknown transport (deregistered or never created)")

// codeTable maps each error to its code, most specific first (a config
// error about a missing backend is a missing backend).
var codeTable = []struct {
	err  error
	code int
}{
	{ecxfer.ErrNoBackend, codeNoBackend},
	{ecxfer.ErrConfig, codeConfig},
	{ecxfer.ErrUnknownPeer, codeUnknownPeer},
	{ecxfer.ErrIndexMismatch, codeIndexMismatch},
	{ecxfer.ErrIndexRange, codeIndexRange},
	{ecxfer.ErrBadHandle, codeBadHandle},
	{ecxfer.ErrBadMetadata, codeBadMetadata},
	{ecxfer.ErrBadDescriptor, codeBadDescriptor},
	{ecxfer.ErrBadNotif, codeBadNotif},
	{ecxfer.ErrClosed, codeClosed},
	{ecxfer.ErrBusy, codeBusy},
	{ecxfer.ErrRemoteDisconnect, codeRemoteDisconnect},
	{ecxfer.ErrTimeout, codeTimeout},
	{context.DeadlineExceeded, codeTimeout},
	{ecxfer.ErrCanceled, codeCanceled},
	{context.Canceled, codeCanceled},
	{ecxfer.ErrEngine, codeEngine},
	{errBadArg, codeBadArg},
	{errUnknownTransport, codeUnknownTransport},
}

// codeOf returns err's code: 0 for nil, codeOther for an error none of the
// sentinels matches.
func codeOf(err error) int {
	if err == nil {
		return codeOK
	}
	for _, c := range codeTable {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return codeOther
}
