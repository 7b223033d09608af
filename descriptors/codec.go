package descriptors

import (
	"bytes"
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// DefaultMaxDescs is the largest number of descriptors Decode accepts:
// 4,194,304 blocks, far more than any producer registers (an 8 GiB region of
// 2 KiB blocks), yet small enough that a hostile length header cannot make
// the decoder allocate gigabytes.
const DefaultMaxDescs = 1 << 22

// minEncodedDesc is the fewest bytes one encoded descriptor can occupy: a
// fixarray header and three positive fixints. A declared element count that
// the remaining input cannot hold at this size is rejected before the list
// is allocated.
const minEncodedDesc = 4

// Errors returned by Encode, Decode and DecodeMax. They work with errors.Is.
var (
	// ErrMalformed: the input is not a valid descriptor list, or (from
	// Encode) the list holds a descriptor that Decode would reject. Every
	// error from Decode, DecodeMax and Encode wraps it.
	ErrMalformed = errors.New("descriptors: malformed descriptor list")
	// ErrTooMany: the list declares more descriptors than the limit given
	// to DecodeMax (DefaultMaxDescs for Decode), or (from Encode) more than
	// a msgpack array can hold. Errors that wrap ErrTooMany also wrap
	// ErrMalformed, so a caller that only checks ErrMalformed still sees
	// them as a rejected list.
	ErrTooMany = errors.New("descriptors: too many descriptors")
)

// codecError is the error type of this file: a message that already says
// what is wrong and where, unwrapping to ErrMalformed and, for count-limit
// failures, to ErrTooMany as well.
type codecError struct {
	msg     string
	tooMany bool
}

func (e *codecError) Error() string { return e.msg }

func (e *codecError) Unwrap() []error {
	if e.tooMany {
		return []error{ErrMalformed, ErrTooMany}
	}
	return []error{ErrMalformed}
}

// fieldNames names the three members of an encoded descriptor in order.
var fieldNames = [3]string{"addr", "len", "dev"}

// loc is a position in the descriptor list's structure, formatted only when
// an error needs it. elem < 0 is the top-level array; field < 0 is an
// element's own array header.
type loc struct {
	elem, field int
}

var topLevel = loc{elem: -1, field: -1}

func (l loc) String() string {
	switch {
	case l.elem < 0:
		return "top level"
	case l.field < 0:
		return fmt.Sprintf("element %d", l.elem)
	default:
		return fmt.Sprintf("element %d: field %d (%s)", l.elem, l.field, fieldNames[l.field])
	}
}

// errorAt returns an error for a problem found at l; off >= 0 adds the byte
// offset in the input.
func errorAt(l loc, off int, tooMany bool, format string, args ...any) error {
	what := fmt.Sprintf(format, args...)
	msg := "descriptors: " + l.String() + ": " + what
	if off >= 0 {
		msg += fmt.Sprintf(" (at byte %d)", off)
	}
	return &codecError{msg: msg, tooMany: tooMany}
}

// checkDesc returns the reason d cannot be part of a descriptor list, or "".
// The field index says which field is at fault.
func checkDesc(d Desc) (field int, reason string) {
	if d.Len == 0 {
		return 1, "zero length"
	}
	if d.Addr+d.Len < d.Addr {
		return 1, fmt.Sprintf("addr %#x + len %#x overflows uint64", d.Addr, d.Len)
	}
	return -1, ""
}

// uintSize is the length of the smallest msgpack encoding of v.
func uintSize(v uint64) int {
	switch {
	case v <= math.MaxInt8:
		return 1
	case v <= math.MaxUint8:
		return 2
	case v <= math.MaxUint16:
		return 3
	case v <= math.MaxUint32:
		return 5
	default:
		return 9
	}
}

// arrayHeaderSize is the length of the smallest msgpack array header for n
// elements.
func arrayHeaderSize(n int) int {
	switch {
	case n < 16:
		return 1
	case n <= math.MaxUint16:
		return 3
	default:
		return 5
	}
}

// appendWriter is the Encoder's output: it appends to a slice sized in
// advance, so encoding allocates the result and nothing else.
type appendWriter struct{ b []byte }

func (w *appendWriter) Write(p []byte) (int, error) {
	w.b = append(w.b, p...)
	return len(p), nil
}

func (w *appendWriter) WriteByte(c byte) error {
	w.b = append(w.b, c)
	return nil
}

// Encode returns the msgpack encoding of l that vLLM's msgspec produces for
// list[tuple[int, int, int]]: an array (fixarray, array16 or array32 header)
// of 3-element arrays [addr, len, dev], each integer in its smallest unsigned
// encoding (positive fixint, uint8, uint16, uint32 or uint64). A nil or empty
// l encodes as an empty array.
//
// Encode refuses what Decode would refuse, with an error wrapping
// ErrMalformed: a descriptor of zero length, one whose Addr+Len overflows
// uint64, and (wrapping ErrTooMany too) more descriptors than an array32
// header can count. It does not apply Decode's DefaultMaxDescs limit.
func Encode(l List) ([]byte, error) {
	if uint64(len(l)) > math.MaxUint32 {
		return nil, errorAt(topLevel, -1, true, "%d descriptors, a msgpack array holds at most %d", len(l), uint64(math.MaxUint32))
	}
	size := arrayHeaderSize(len(l))
	for i, d := range l {
		if f, reason := checkDesc(d); reason != "" {
			return nil, errorAt(loc{elem: i, field: f}, -1, false, "%s", reason)
		}
		size += 1 + uintSize(d.Addr) + uintSize(d.Len) + uintSize(d.DevID)
	}

	w := appendWriter{b: make([]byte, 0, size)}
	enc := msgpack.GetEncoder()
	defer msgpack.PutEncoder(enc)
	enc.Reset(&w)
	if err := enc.EncodeArrayLen(len(l)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	for _, d := range l {
		if err := encodeDesc(enc, d); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
		}
	}
	return w.b, nil
}

func encodeDesc(enc *msgpack.Encoder, d Desc) error {
	if err := enc.EncodeArrayLen(3); err != nil {
		return err
	}
	if err := enc.EncodeUint(d.Addr); err != nil {
		return err
	}
	if err := enc.EncodeUint(d.Len); err != nil {
		return err
	}
	return enc.EncodeUint(d.DevID)
}

// Decode parses a descriptor list in the format Encode writes, accepting at
// most DefaultMaxDescs descriptors. See DecodeMax.
func Decode(b []byte) (List, error) {
	return DecodeMax(b, DefaultMaxDescs)
}

// DecodeMax parses a descriptor list: one msgpack array of 3-element arrays
// [addr, len, dev] and nothing after it. It is strict about the shape and
// the values and lenient about widths: any msgpack integer encoding is
// accepted for a value, signed ones included when the value is not
// negative, and any array header width for the arrays, so Encode of the
// result may be shorter than b.
//
// It rejects, with an error wrapping ErrMalformed that names the element and
// field at fault and the byte offset: a top level or element that is not an
// array, an element that does not have exactly 3 members, a value that is
// negative or not an integer, a zero length, a descriptor whose Addr+Len
// overflows uint64, truncated input and bytes after the list. A list that
// declares more than maxDescs descriptors is rejected before anything is
// allocated, with an error wrapping both ErrTooMany and ErrMalformed;
// maxDescs <= 0 means DefaultMaxDescs. An empty array decodes to an empty,
// non-nil List. DecodeMax never panics.
func DecodeMax(b []byte, maxDescs int) (List, error) {
	if maxDescs <= 0 {
		maxDescs = DefaultMaxDescs
	}
	r := bytes.NewReader(b)
	dec := msgpack.GetDecoder()
	defer msgpack.PutDecoder(dec)
	// A bytes.Reader is an io.ByteScanner, so the decoder reads from it
	// directly without buffering ahead: r.Len() stays exact.
	dec.Reset(r)
	p := parser{dec: dec, r: r, size: len(b)}

	start := p.off()
	n, err := p.arrayLen(topLevel)
	if err != nil {
		return nil, err
	}
	if n < 0 || n > maxDescs {
		// n < 0: an array32 count that does not fit in int on a 32-bit
		// platform.
		return nil, errorAt(topLevel, start, true, "list declares %d descriptors, the limit is %d", uint32(n), maxDescs)
	}
	if rest := r.Len(); n > rest/minEncodedDesc {
		return nil, errorAt(topLevel, start, false, "truncated input: list declares %d descriptors but only %d bytes follow", n, rest)
	}

	l := make(List, n)
	for i := range l {
		if err := p.desc(i, &l[i]); err != nil {
			return nil, err
		}
	}
	if rest := r.Len(); rest > 0 {
		return nil, errorAt(topLevel, p.off(), false, "%d trailing bytes after the list", rest)
	}
	return l, nil
}

// parser reads one descriptor list through a msgpack Decoder, peeking at
// every type code before decoding so that it accepts only the codes it
// means to: the Decoder alone would read nil as 0 and a negative integer as
// a huge unsigned one.
type parser struct {
	dec  *msgpack.Decoder
	r    *bytes.Reader
	size int
}

// off is the offset of the next unread byte.
func (p *parser) off() int { return p.size - p.r.Len() }

// truncated reports input that ends inside the item that starts at off.
func truncated(l loc, off int) error {
	return errorAt(l, off, false, "truncated input")
}

// arrayLen reads an array header of any width.
func (p *parser) arrayLen(l loc) (int, error) {
	off := p.off()
	c, err := p.dec.PeekCode()
	if err != nil {
		return 0, truncated(l, off)
	}
	if !msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32 {
		return 0, errorAt(l, off, false, "want an array, got %s", typeName(c))
	}
	n, err := p.dec.DecodeArrayLen()
	if err != nil {
		return 0, truncated(l, off)
	}
	return n, nil
}

// desc reads element i into d and checks it.
func (p *parser) desc(i int, d *Desc) error {
	el := loc{elem: i, field: -1}
	off := p.off()
	n, err := p.arrayLen(el)
	if err != nil {
		return err
	}
	if n != 3 {
		return errorAt(el, off, false, "want a 3-element array [addr, len, dev], got an array of %d", uint32(n))
	}
	var v [3]uint64
	var lenOff int
	for f := range v {
		if f == 1 {
			lenOff = p.off()
		}
		if v[f], err = p.uint(loc{elem: i, field: f}); err != nil {
			return err
		}
	}
	*d = Desc{Addr: v[0], Len: v[1], DevID: v[2]}
	if f, reason := checkDesc(*d); reason != "" {
		return errorAt(loc{elem: i, field: f}, lenOff, false, "%s", reason)
	}
	return nil
}

// uint reads one non-negative integer of any msgpack integer encoding.
func (p *parser) uint(l loc) (uint64, error) {
	off := p.off()
	c, err := p.dec.PeekCode()
	if err != nil {
		return 0, truncated(l, off)
	}
	switch {
	case msgpcode.IsFixedNum(c) && c <= msgpcode.PosFixedNumHigh,
		c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		v, err := p.dec.DecodeUint64()
		if err != nil {
			return 0, truncated(l, off)
		}
		return v, nil
	case msgpcode.IsFixedNum(c),
		c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		v, err := p.dec.DecodeInt64()
		if err != nil {
			return 0, truncated(l, off)
		}
		if v < 0 {
			return 0, errorAt(l, off, false, "negative value %d", v)
		}
		return uint64(v), nil
	default:
		return 0, errorAt(l, off, false, "want a non-negative integer, got %s", typeName(c))
	}
}

// typeName names the msgpack type that code c starts, for error messages.
func typeName(c byte) string {
	switch {
	case msgpcode.IsFixedNum(c), c >= msgpcode.Uint8 && c <= msgpcode.Int64:
		return "integer"
	case c == msgpcode.Nil:
		return "nil"
	case c == msgpcode.False || c == msgpcode.True:
		return "bool"
	case c == msgpcode.Float:
		return "float32"
	case c == msgpcode.Double:
		return "float64"
	case msgpcode.IsFixedString(c), c == msgpcode.Str8, c == msgpcode.Str16, c == msgpcode.Str32:
		return "string"
	case c == msgpcode.Bin8, c == msgpcode.Bin16, c == msgpcode.Bin32:
		return "binary"
	case msgpcode.IsFixedArray(c), c == msgpcode.Array16, c == msgpcode.Array32:
		return "array"
	case msgpcode.IsFixedMap(c), c == msgpcode.Map16, c == msgpcode.Map32:
		return "map"
	case msgpcode.IsExt(c):
		return "extension"
	default:
		return fmt.Sprintf("unused type code %#02x", c)
	}
}
