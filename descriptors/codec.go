package descriptors

import (
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/ecxfer/ecxfer/internal/msgp"
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
	p := parser{r: msgp.NewReader(b)}

	start := p.r.Off()
	n, err := p.arrayLen(topLevel)
	if err != nil {
		return nil, err
	}
	if n > uint64(maxDescs) {
		return nil, errorAt(topLevel, start, true, "list declares %d descriptors, the limit is %d", n, maxDescs)
	}
	if rest := p.r.Len(); n > uint64(rest/minEncodedDesc) {
		return nil, errorAt(topLevel, start, false, "truncated input: list declares %d descriptors but only %d bytes follow", n, rest)
	}

	l := make(List, n)
	for i := range l {
		if err := p.desc(i, &l[i]); err != nil {
			return nil, err
		}
	}
	if rest := p.r.Len(); rest > 0 {
		return nil, errorAt(topLevel, p.r.Off(), false, "%d trailing bytes after the list", rest)
	}
	return l, nil
}

// parser reads one descriptor list through the strict msgp reader and
// words its errors with the element and field at fault.
type parser struct {
	r *msgp.Reader
}

// at turns a reader error into this file's error at l.
func at(l loc, err error) error {
	var e *msgp.Error
	if errors.As(err, &e) {
		return errorAt(l, e.Off, false, "%s", e.Msg)
	}
	return errorAt(l, -1, false, "%v", err)
}

// arrayLen reads an array header of any width.
func (p *parser) arrayLen(l loc) (uint64, error) {
	n, err := p.r.ArrayLen()
	if err != nil {
		return 0, at(l, err)
	}
	return n, nil
}

// desc reads element i into d and checks it.
func (p *parser) desc(i int, d *Desc) error {
	el := loc{elem: i, field: -1}
	off := p.r.Off()
	n, err := p.arrayLen(el)
	if err != nil {
		return err
	}
	if n != 3 {
		return errorAt(el, off, false, "want a 3-element array [addr, len, dev], got an array of %d", n)
	}
	var v [3]uint64
	var lenOff int
	for f := range v {
		if f == 1 {
			lenOff = p.r.Off()
		}
		// Any integer encoding, signed ones included, when the value is
		// not negative: other encoders write Python ints that way.
		if v[f], err = p.r.NonNegInt(); err != nil {
			return at(loc{elem: i, field: f}, err)
		}
	}
	*d = Desc{Addr: v[0], Len: v[1], DevID: v[2]}
	if f, reason := checkDesc(*d); reason != "" {
		return errorAt(loc{elem: i, field: f}, lenOff, false, "%s", reason)
	}
	return nil
}
