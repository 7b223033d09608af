// Package msgp is the one strict msgpack reader ecxfer's decoders share:
// descriptor lists (descriptors), ucx metadata and loopback metadata.
//
// A general msgpack decoder converts what it finds into what it is asked
// for: nil reads as 0, a negative integer as a huge unsigned one, and a
// declared length is believed until the allocation fails. A Reader does
// none of that. Each read names the msgpack kinds it accepts and fails,
// without consuming anything, on any other type code; every declared
// length is checked against the bytes left before anything is allocated or
// sliced. Errors are *Error values that give the offset of the item at
// fault, so each decoder words them in its own terms.
//
// Only the kinds ecxfer's formats use are read: arrays, strings, binary
// strings and integers. Encoding stays with github.com/vmihailenco/msgpack.
package msgp

import (
	"encoding/binary"
	"fmt"
)

// Error is a read that failed. Off is the offset of the item's first byte.
type Error struct {
	Off int
	Msg string // what is wrong, e.g. "want an array, got map"
}

func (e *Error) Error() string { return fmt.Sprintf("%s (at byte %d)", e.Msg, e.Off) }

// Reader reads msgpack items from a byte slice, front to back.
type Reader struct {
	b   []byte
	off int
}

// NewReader returns a Reader over b. It keeps b; Bytes results alias it.
func NewReader(b []byte) *Reader { return &Reader{b: b} }

// Off is the offset of the next unread byte.
func (r *Reader) Off() int { return r.off }

// Len is the number of bytes left.
func (r *Reader) Len() int { return len(r.b) - r.off }

func (r *Reader) fail(off int, format string, args ...any) *Error {
	return &Error{Off: off, Msg: fmt.Sprintf(format, args...)}
}

const truncated = "truncated input"

// size reads the n-byte big-endian length or value that follows the type
// code at r.off (n is 1, 2, 4 or 8) and returns it with the offset after
// it.
func (r *Reader) size(n int) (uint64, int, bool) {
	at := r.off + 1
	if len(r.b)-at < n {
		return 0, 0, false
	}
	p := r.b[at : at+n]
	switch n {
	case 1:
		return uint64(p[0]), at + 1, true
	case 2:
		return uint64(binary.BigEndian.Uint16(p)), at + 2, true
	case 4:
		return uint64(binary.BigEndian.Uint32(p)), at + 4, true
	}
	return binary.BigEndian.Uint64(p), at + 8, true
}

// header reads the type code at r.off and, for the kinds in accept, the
// length or value it carries. It returns the code, that value, and the
// offset after the header; want names the kinds for the error.
func (r *Reader) header(want string, accept func(c byte) (width int, inline uint64, ok bool)) (byte, uint64, int, error) {
	if r.off >= len(r.b) {
		return 0, 0, 0, r.fail(r.off, truncated)
	}
	c := r.b[r.off]
	width, inline, ok := accept(c)
	if !ok {
		return c, 0, 0, r.fail(r.off, "want %s, got %s", want, TypeName(c))
	}
	if width == 0 {
		return c, inline, r.off + 1, nil
	}
	v, next, ok := r.size(width)
	if !ok {
		return c, 0, 0, r.fail(r.off, truncated)
	}
	return c, v, next, nil
}

func arrayCode(c byte) (int, uint64, bool) {
	switch {
	case c >= 0x90 && c <= 0x9f:
		return 0, uint64(c & 0x0f), true
	case c == 0xdc:
		return 2, 0, true
	case c == 0xdd:
		return 4, 0, true
	}
	return 0, 0, false
}

// ArrayLen reads an array header of any width and returns its element
// count. The count is not checked against the bytes left (an element may
// be one byte or more); callers bound it with Len.
func (r *Reader) ArrayLen() (uint64, error) {
	_, n, next, err := r.header("an array", arrayCode)
	if err != nil {
		return 0, err
	}
	r.off = next
	return n, nil
}

func strCode(c byte) (int, uint64, bool) {
	switch {
	case c >= 0xa0 && c <= 0xbf:
		return 0, uint64(c & 0x1f), true
	case c == 0xd9:
		return 1, 0, true
	case c == 0xda:
		return 2, 0, true
	case c == 0xdb:
		return 4, 0, true
	}
	return 0, 0, false
}

func binCode(c byte) (int, uint64, bool) {
	switch c {
	case 0xc4:
		return 1, 0, true
	case 0xc5:
		return 2, 0, true
	case 0xc6:
		return 4, 0, true
	}
	return 0, 0, false
}

// Str reads a string of max bytes at most and returns its bytes, which
// alias the input. It does not check UTF-8.
func (r *Reader) Str(max int) ([]byte, error) { return r.bytes("a string", strCode, max) }

// Bin reads a binary string of max bytes at most and returns its bytes,
// which alias the input.
func (r *Reader) Bin(max int) ([]byte, error) { return r.bytes("binary", binCode, max) }

func (r *Reader) bytes(want string, accept func(byte) (int, uint64, bool), max int) ([]byte, error) {
	_, n, next, err := r.header(want, accept)
	if err != nil {
		return nil, err
	}
	if n > uint64(max) {
		return nil, r.fail(r.off, "%d bytes, at most %d allowed", n, max)
	}
	if n > uint64(len(r.b)-next) {
		return nil, r.fail(r.off, truncated)
	}
	r.off = next + int(n)
	return r.b[next:r.off:r.off], nil
}

func uintCode(c byte) (int, uint64, bool) {
	switch {
	case c <= 0x7f:
		return 0, uint64(c), true
	case c == 0xcc:
		return 1, 0, true
	case c == 0xcd:
		return 2, 0, true
	case c == 0xce:
		return 4, 0, true
	case c == 0xcf:
		return 8, 0, true
	}
	return 0, 0, false
}

// Uint reads an integer in an unsigned encoding (positive fixint, uint8,
// uint16, uint32, uint64).
func (r *Reader) Uint() (uint64, error) {
	_, v, next, err := r.header("an unsigned integer", uintCode)
	if err != nil {
		return 0, err
	}
	r.off = next
	return v, nil
}

func intCode(c byte) (int, uint64, bool) {
	if w, v, ok := uintCode(c); ok {
		return w, v, ok
	}
	switch {
	case c >= 0xe0:
		return 0, uint64(int64(int8(c))), true
	case c == 0xd0:
		return 1, 0, true
	case c == 0xd1:
		return 2, 0, true
	case c == 0xd2:
		return 4, 0, true
	case c == 0xd3:
		return 8, 0, true
	}
	return 0, 0, false
}

// NonNegInt reads an integer in any msgpack integer encoding, signed ones
// included, whose value is not negative (what msgspec and other encoders
// may write for a Python int).
func (r *Reader) NonNegInt() (uint64, error) {
	c, v, next, err := r.header("a non-negative integer", intCode)
	if err != nil {
		return 0, err
	}
	var neg int64
	switch c {
	case 0xd0:
		neg = int64(int8(v))
	case 0xd1:
		neg = int64(int16(v))
	case 0xd2:
		neg = int64(int32(v))
	case 0xd3:
		neg = int64(v)
	default:
		if c >= 0xe0 {
			neg = int64(v)
		}
	}
	if neg < 0 {
		return 0, r.fail(r.off, "negative value %d", neg)
	}
	r.off = next
	return v, nil
}

// End fails if bytes are left.
func (r *Reader) End() error {
	if n := r.Len(); n > 0 {
		return r.fail(r.off, "%d trailing bytes", n)
	}
	return nil
}

// TypeName names the msgpack type that code c starts, for error messages.
func TypeName(c byte) string {
	switch {
	case c <= 0x7f, c >= 0xe0, c >= 0xcc && c <= 0xd3:
		return "integer"
	case c == 0xc0:
		return "nil"
	case c == 0xc2 || c == 0xc3:
		return "bool"
	case c == 0xca:
		return "float32"
	case c == 0xcb:
		return "float64"
	case c >= 0xa0 && c <= 0xbf, c >= 0xd9 && c <= 0xdb:
		return "string"
	case c >= 0xc4 && c <= 0xc6:
		return "binary"
	case c >= 0x90 && c <= 0x9f, c == 0xdc || c == 0xdd:
		return "array"
	case c >= 0x80 && c <= 0x8f, c == 0xde || c == 0xdf:
		return "map"
	case c >= 0xc7 && c <= 0xc9, c >= 0xd4 && c <= 0xd8:
		return "extension"
	}
	return fmt.Sprintf("unused type code %#02x", c)
}
