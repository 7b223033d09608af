package msgp

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func mustHex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	require.NoError(t, err)
	return b
}

func encode(t testing.TB, vs ...any) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	for _, v := range vs {
		require.NoError(t, e.Encode(v))
	}
	return buf.Bytes()
}

func TestReadsWhatMsgpackWrites(t *testing.T) {
	uints := []uint64{0, 1, 127, 128, 255, 256, math.MaxUint16, math.MaxUint16 + 1, math.MaxUint32, math.MaxUint32 + 1, math.MaxUint64}
	for _, v := range uints {
		r := NewReader(encode(t, v))
		got, err := r.Uint()
		require.NoError(t, err, "%d", v)
		require.Equal(t, v, got)
		require.NoError(t, r.End())

		r = NewReader(encode(t, v))
		got, err = r.NonNegInt()
		require.NoError(t, err)
		require.Equal(t, v, got)
	}
	for _, s := range []string{"", "a", strings.Repeat("x", 31), strings.Repeat("y", 32), strings.Repeat("z", 300), strings.Repeat("w", 70000)} {
		r := NewReader(encode(t, s))
		got, err := r.Str(len(s))
		require.NoError(t, err)
		require.Equal(t, s, string(got))
		require.NoError(t, r.End())

		r = NewReader(encode(t, []byte(s)))
		got, err = r.Bin(len(s))
		require.NoError(t, err)
		require.Equal(t, s, string(got))
		require.NoError(t, r.End())
	}
	for _, n := range []int{0, 1, 15, 16, 65535, 65536} {
		b := make([]any, n)
		for i := range b {
			b[i] = i % 100
		}
		r := NewReader(encode(t, b))
		got, err := r.ArrayLen()
		require.NoError(t, err)
		require.Equal(t, uint64(n), got)
		require.Equal(t, n, r.Len(), "one byte per small int left")
	}
}

func TestNonNegIntSigned(t *testing.T) {
	cases := []struct {
		in   string
		want uint64
		neg  string
	}{
		{"d0 05", 5, ""},
		{"d1 01 00", 256, ""},
		{"d2 00 01 00 00", 65536, ""},
		{"d3 7f ff ff ff ff ff ff ff", math.MaxInt64, ""},
		{"ff", 0, "negative value -1"},
		{"e0", 0, "negative value -32"},
		{"d0 80", 0, "negative value -128"},
		{"d1 ff fe", 0, "negative value -2"},
		{"d2 80 00 00 00", 0, "negative value -2147483648"},
		{"d3 ff ff ff ff ff ff ff ff", 0, "negative value -1"},
	}
	for _, tc := range cases {
		r := NewReader(mustHex(t, tc.in))
		v, err := r.NonNegInt()
		if tc.neg != "" {
			require.EqualError(t, err, tc.neg+" (at byte 0)", tc.in)
			require.Zero(t, r.Off(), "nothing consumed on error")
			continue
		}
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, v)
		// Uint refuses every signed encoding, whatever the value.
		_, err = NewReader(mustHex(t, tc.in)).Uint()
		require.ErrorContains(t, err, "want an unsigned integer, got integer")
	}
}

func TestHostile(t *testing.T) {
	cases := []struct {
		name string
		in   string
		read func(r *Reader) error
		msg  string
	}{
		{"empty", "", func(r *Reader) error { _, err := r.Uint(); return err }, "truncated input (at byte 0)"},
		{"nil as uint", "c0", func(r *Reader) error { _, err := r.Uint(); return err }, "want an unsigned integer, got nil (at byte 0)"},
		{"float as uint", "ca 3f 80 00 00", func(r *Reader) error { _, err := r.Uint(); return err }, "want an unsigned integer, got float32 (at byte 0)"},
		{"uint64 cut", "cf 00 00", func(r *Reader) error { _, err := r.Uint(); return err }, "truncated input (at byte 0)"},
		{"map as array", "80", func(r *Reader) error { _, err := r.ArrayLen(); return err }, "want an array, got map (at byte 0)"},
		{"array32 cut", "dd 00 00", func(r *Reader) error { _, err := r.ArrayLen(); return err }, "truncated input (at byte 0)"},
		{"bin as str", "c4 01 41", func(r *Reader) error { _, err := r.Str(10); return err }, "want a string, got binary (at byte 0)"},
		{"str as bin", "a1 41", func(r *Reader) error { _, err := r.Bin(10); return err }, "want binary, got string (at byte 0)"},
		{"str too long", "a3 41 42 43", func(r *Reader) error { _, err := r.Str(2); return err }, "3 bytes, at most 2 allowed (at byte 0)"},
		{"str32 beyond input", "db 00 00 10 00 41", func(r *Reader) error { _, err := r.Str(math.MaxInt32); return err }, "truncated input (at byte 0)"},
		{"bin body cut", "c4 05 01 02", func(r *Reader) error { _, err := r.Bin(10); return err }, "truncated input (at byte 0)"},
		{"ext", "d4 01 00", func(r *Reader) error { _, err := r.NonNegInt(); return err }, "want a non-negative integer, got extension (at byte 0)"},
		{"unused code", "c1", func(r *Reader) error { _, err := r.ArrayLen(); return err }, "want an array, got unused type code 0xc1 (at byte 0)"},
		{"trailing", "01 02", func(r *Reader) error {
			if _, err := r.Uint(); err != nil {
				return err
			}
			return r.End()
		}, "1 trailing bytes (at byte 1)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := NewReader(mustHex(t, tc.in))
			err := tc.read(r)
			require.EqualError(t, err, tc.msg)
			var e *Error
			require.True(t, errors.As(err, &e))
			require.Zero(t, e.Off-r.Off(), "the error is at the unconsumed item")
		})
	}
}

// The bytes Str and Bin return alias the input and cannot be appended to
// over the next item.
func TestBytesAlias(t *testing.T) {
	in := mustHex(t, "a2 41 42 01")
	r := NewReader(in)
	s, err := r.Str(2)
	require.NoError(t, err)
	require.Equal(t, 2, cap(s))
	s = append(s, 'C')
	require.Equal(t, byte(0x01), in[3])
	_ = s
}

// FuzzReader reads one item of each kind from arbitrary bytes: no panic,
// nothing consumed on error, and whatever is accepted agrees with the
// msgpack library's reading of the same bytes.
func FuzzReader(f *testing.F) {
	for _, s := range []string{"", "00", "7f", "cc ff", "cf ff ff ff ff ff ff ff ff", "d3 80 00 00 00 00 00 00 00",
		"e0", "c0", "a3 61 62 63", "d9 01 61", "db ff ff ff ff", "c4 02 01 02", "c6 00 00 00 01 00",
		"93 01 02 03", "dc 00 01 01", "dd ff ff ff ff", "80", "c1", "d4 01 00"} {
		f.Add(mustHex(f, s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		check := func(kind string, read func(r *Reader) (any, error), ref func(d *msgpack.Decoder) (any, error)) {
			r := NewReader(in)
			v, err := read(r)
			if err != nil {
				var e *Error
				if !errors.As(err, &e) || e.Off != 0 || r.Off() != 0 {
					t.Fatalf("%s: error %v (offset %d) after consuming %d", kind, err, e.Off, r.Off())
				}
				return
			}
			if r.Off() <= 0 || r.Off() > len(in) {
				t.Fatalf("%s: consumed %d of %d", kind, r.Off(), len(in))
			}
			d := msgpack.NewDecoder(bytes.NewReader(in[:r.Off()]))
			want, err := ref(d)
			if err != nil {
				t.Fatalf("%s: accepted %x as %v; msgpack: %v", kind, in[:r.Off()], v, err)
			}
			if !equal(v, want) {
				t.Fatalf("%s: %x read as %v, msgpack reads %v", kind, in[:r.Off()], v, want)
			}
		}
		check("uint", func(r *Reader) (any, error) { return r.Uint() },
			func(d *msgpack.Decoder) (any, error) { return d.DecodeUint64() })
		check("nonneg", func(r *Reader) (any, error) { return r.NonNegInt() },
			func(d *msgpack.Decoder) (any, error) { return d.DecodeUint64() })
		check("str", func(r *Reader) (any, error) { return r.Str(1 << 20) },
			func(d *msgpack.Decoder) (any, error) { return d.DecodeBytes() })
		check("bin", func(r *Reader) (any, error) { return r.Bin(1 << 20) },
			func(d *msgpack.Decoder) (any, error) { return d.DecodeBytes() })
		check("array", func(r *Reader) (any, error) {
			n, err := r.ArrayLen()
			return uint64(n), err
		}, func(d *msgpack.Decoder) (any, error) {
			n, err := d.DecodeArrayLen()
			return uint64(uint32(n)), err
		})
	})
}

func equal(a, b any) bool {
	if x, ok := a.([]byte); ok {
		y, ok := b.([]byte)
		return ok && bytes.Equal(x, y)
	}
	return a == b
}
