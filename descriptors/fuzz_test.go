package descriptors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
)

// refAppendUint is an independent, byte-level statement of the encoding
// Encode must produce for one integer: the smallest of positive fixint,
// uint8, uint16, uint32 and uint64, big endian.
func refAppendUint(b []byte, v uint64) []byte {
	switch {
	case v < 0x80:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	default:
		return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
	}
}

// refEncode is the reference for Encode: fixarray, array16 or array32
// headers and refAppendUint for every value.
func refEncode(l List) []byte {
	var b []byte
	switch n := len(l); {
	case n < 16:
		b = append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
	}
	for _, d := range l {
		b = append(b, 0x93)
		b = refAppendUint(b, d.Addr)
		b = refAppendUint(b, d.Len)
		b = refAppendUint(b, d.DevID)
	}
	return b
}

func FuzzDecode(f *testing.F) {
	for _, e := range loadGoldenIndex(f) {
		if e.File != "" && e.Len <= 4096 {
			f.Add(readHexFile(f, e.File))
		}
	}
	for _, s := range []string{
		"", "90", "c0", "80", "dd ff ff ff ff", "dd 00 40 00 00", "dc 00 10",
		"91 93 01 01 01", "91 93 00 00 00", "91 93 ff 01 00", "91 93 d3 00 00 00 00 00 00 00 05 01 00",
		"91 dc 00 03 01 02 03", "91 93 cf ff ff ff ff ff ff ff ff 01 00", "91 93 ca 3f 80 00 00 01 00",
		"91 93 01 01 01 00", "92 93 01 01 01", "91 92 01 01",
	} {
		f.Add(mustHex(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		l, err := Decode(in)
		if err != nil {
			if l != nil {
				t.Fatalf("error %v with a non-nil list", err)
			}
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			if !strings.HasPrefix(err.Error(), "descriptors: ") {
				t.Fatalf("error %q does not name the package", err)
			}
			return
		}
		if l == nil {
			t.Fatal("nil list without an error")
		}
		out, err := Encode(l)
		if err != nil {
			t.Fatalf("Encode of a decoded list: %v", err)
		}
		if want := refEncode(l); !bytes.Equal(out, want) {
			t.Fatalf("Encode = %x, reference %x", out, want)
		}
		// Every accepted encoding is at least as long as the canonical one.
		if len(out) > len(in) {
			t.Fatalf("canonical form (%d bytes) longer than the input (%d bytes)", len(out), len(in))
		}
		again, err := Decode(out)
		if err != nil {
			t.Fatalf("Decode(Encode(l)): %v", err)
		}
		if !slices.Equal(l, again) {
			t.Fatalf("round trip changed the list: %v -> %v", l, again)
		}
	})
}

// FuzzDecodeMax: with a small limit, DecodeMax accepts what Decode
// accepts when it holds at most max descriptors, the same list, and
// refuses the rest with ErrTooMany (and ErrMalformed) when Decode accepts
// them, with Decode's error otherwise: the limit is checked against the
// declared count, before the elements are read.
func FuzzDecodeMax(f *testing.F) {
	for _, s := range []string{"90", "91 93 01 01 01", "92 93 01 01 01 93 02 01 00", "93 93 01 01 01",
		"dc 00 02 93 01 01 01 93 02 01 00", "dd 00 00 00 05", "92 93 01 01 01"} {
		f.Add(mustHex(s), uint8(1))
	}
	f.Fuzz(func(t *testing.T, in []byte, max uint8) {
		limit := int(max%8) + 1
		l, err := DecodeMax(in, limit)
		full, ferr := Decode(in)
		switch {
		case err == nil:
			if ferr != nil || !slices.Equal(l, full) || len(l) > limit {
				t.Fatalf("DecodeMax(%d) = %v; Decode = %v, %v", limit, l, full, ferr)
			}
		case errors.Is(err, ErrTooMany):
			if !errors.Is(err, ErrMalformed) || l != nil {
				t.Fatalf("ErrTooMany %v without ErrMalformed, or with a list", err)
			}
			if ferr == nil && len(full) <= limit {
				t.Fatalf("refused %d descriptors, limit %d: %v", len(full), limit, err)
			}
		default:
			if ferr == nil && len(full) <= limit {
				t.Fatalf("DecodeMax(%d) refused %v that Decode accepts: %v", limit, full, err)
			}
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
		}
	})
}

// fuzzList reads descriptors from data, 24 bytes each (addr, len, dev,
// little endian); a short tail is ignored.
func fuzzList(data []byte) List {
	l := List{}
	for ; len(data) >= 24; data = data[24:] {
		l = append(l, Desc{
			Addr:  binary.LittleEndian.Uint64(data),
			Len:   binary.LittleEndian.Uint64(data[8:]),
			DevID: binary.LittleEndian.Uint64(data[16:]),
		})
	}
	return l
}

func listBytes(l List) []byte {
	var b []byte
	for _, d := range l {
		b = binary.LittleEndian.AppendUint64(b, d.Addr)
		b = binary.LittleEndian.AppendUint64(b, d.Len)
		b = binary.LittleEndian.AppendUint64(b, d.DevID)
	}
	return b
}

func FuzzRoundTrip(f *testing.F) {
	f.Add([]byte{})
	f.Add(listBytes(BuildBlockDescs(blockBase, 3, 5120, 0)))
	f.Add(listBytes(BuildBlockDescs(blockBase, 17, 32768, 1)))
	for _, mk := range goldenLists {
		if l := mk(); len(l) <= 32 {
			f.Add(listBytes(l))
		}
	}
	f.Add(listBytes(List{{Addr: math.MaxUint64, Len: 1}}))       // overflow
	f.Add(listBytes(List{{Addr: 1, Len: 1}, {Addr: 2, Len: 0}})) // zero length
	f.Fuzz(func(t *testing.T, data []byte) {
		in := fuzzList(data)
		bad := -1
		for i, d := range in {
			if d.Len == 0 || d.Addr+d.Len < d.Addr {
				bad = i
				break
			}
		}
		out, err := Encode(in)
		if bad >= 0 {
			if err == nil || !errors.Is(err, ErrMalformed) {
				t.Fatalf("Encode accepted invalid element %d (%+v): err %v", bad, in[bad], err)
			}
			return
		}
		if err != nil {
			t.Fatalf("Encode: %v", err)
		}
		if want := refEncode(in); !bytes.Equal(out, want) {
			t.Fatalf("Encode = %x, reference %x", out, want)
		}
		got, err := Decode(out)
		if err != nil {
			t.Fatalf("Decode(Encode(l)): %v", err)
		}
		if !slices.Equal(in, got) {
			t.Fatalf("round trip: %v -> %v", in, got)
		}
	})
}
