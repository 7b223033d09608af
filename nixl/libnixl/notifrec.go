package libnixl

import (
	"encoding/binary"
	"fmt"
)

// The layout of one notification record as ecxnixl_notifs writes it
// (ecxnixl.h): a header of two native-endian uint32 lengths, the sender's
// name, the message, then padding to a multiple of recAlign.
const (
	recSenderLenOff = 0 // uint32: bytes of the sender's name
	recMsgLenOff    = 4 // uint32: bytes of the message
	recHeaderLen    = 8 // the name starts here, the message right after it
	recAlign        = 8 // every record starts at a multiple of this
)

// parseNotifs reads count records from buf, the bytes the shim reported
// used, and appends each message (a fresh slice) to dst under its
// sender's name. Every length is checked against buf before any byte is read, so
// a shim that disagrees with this layout costs notifications, never a
// read past the buffer. It returns how many records it delivered and, if
// that is fewer than count or bytes are left over, why.
func parseNotifs(buf []byte, count int, dst map[string][][]byte) (int, error) {
	off := 0
	for i := 0; i < count; i++ {
		rest := len(buf) - off
		if rest < recHeaderLen {
			return i, fmt.Errorf("record %d at offset %d: %d bytes left, header needs %d", i, off, rest, recHeaderLen)
		}
		hl := uint64(binary.NativeEndian.Uint32(buf[off+recSenderLenOff:]))
		ml := uint64(binary.NativeEndian.Uint32(buf[off+recMsgLenOff:]))
		need := recordSize(hl, ml) // two uint32 lengths: no overflow
		if need > uint64(rest) {
			return i, fmt.Errorf("record %d at offset %d: sender %d and message %d bytes need %d, %d left", i, off, hl, ml, need, rest)
		}
		name := buf[off+recHeaderLen:][:hl]
		msg := buf[off+recHeaderLen+int(hl):][:ml]
		dst[string(name)] = append(dst[string(name)], append([]byte(nil), msg...))
		off += int(need)
	}
	if off != len(buf) {
		return count, fmt.Errorf("%d records end at offset %d of %d used bytes", count, off, len(buf))
	}
	return count, nil
}

// recordSize is how many bytes a record of sender and msg takes, padding
// included.
func recordSize(sender, msg uint64) uint64 {
	return (recHeaderLen + sender + msg + recAlign - 1) &^ (recAlign - 1)
}
