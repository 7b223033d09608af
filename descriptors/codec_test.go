package descriptors

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// goldenEntry is one record of testdata/golden.json, written by
// testdata/gen.py.
type goldenEntry struct {
	Name   string `json:"name"`
	Expr   string `json:"expr"`
	Len    int    `json:"len"`
	SHA256 string `json:"sha256"`
	File   string `json:"file"`
}

const blockBase = 0x7f0000000000

// widthBoundaries are the integers on either side of every msgpack unsigned
// width change, the same tuple gen.py uses.
var widthBoundaries = []uint64{0, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, math.MaxUint64}

// goldenLists holds, for every vector in golden.json, the Go list that its
// Python expression describes.
var goldenLists = map[string]func() List{
	"empty":                func() List { return List{} },
	"blocks_1_5120":        func() List { return BuildBlockDescs(blockBase, 1, 5120, 0) },
	"blocks_15_5120":       func() List { return BuildBlockDescs(blockBase, 15, 5120, 0) },
	"blocks_16_5120":       func() List { return BuildBlockDescs(blockBase, 16, 5120, 0) },
	"blocks_16_32768_dev3": func() List { return BuildBlockDescs(blockBase, 16, 32768, 3) },
	"blocks_880_5120":      func() List { return BuildBlockDescs(blockBase, 880, 5120, 0) },
	"blocks_880_32768":     func() List { return BuildBlockDescs(blockBase, 880, 32768, 0) },
	"blocks_65535_32768":   func() List { return BuildBlockDescs(blockBase, 65535, 32768, 0) },
	"blocks_65536_32768":   func() List { return BuildBlockDescs(blockBase, 65536, 32768, 0) },
	"widths_addr": func() List {
		var l List
		for _, a := range widthBoundaries[:len(widthBoundaries)-1] {
			l = append(l, Desc{Addr: a, Len: 1})
		}
		return append(l, Desc{Addr: math.MaxUint64 - 1, Len: 1})
	},
	"widths_len": func() List {
		l := List{{Len: 1}}
		for _, n := range widthBoundaries[1:] {
			l = append(l, Desc{Len: n})
		}
		return l
	},
	"widths_dev": func() List {
		var l List
		for _, d := range widthBoundaries {
			l = append(l, Desc{Len: 1, DevID: d})
		}
		return l
	},
	"widths_mixed": func() List {
		return List{
			{Addr: math.MaxUint64 - 1, Len: 1, DevID: math.MaxUint64},
			{Addr: 1 << 32, Len: 1<<32 - 1, DevID: 65536},
			{Addr: 65535, Len: 256, DevID: 255},
			{Addr: 128, Len: 127, DevID: 0},
			{Addr: 0, Len: math.MaxUint64, DevID: 1 << 32},
		}
	},
}

func loadGoldenIndex(tb testing.TB) []goldenEntry {
	tb.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", "golden.json"))
	require.NoError(tb, err)
	var idx []goldenEntry
	require.NoError(tb, json.Unmarshal(raw, &idx))
	require.NotEmpty(tb, idx)
	return idx
}

// readHexFile reads a .hex vector: hex digits, whitespace ignored.
func readHexFile(tb testing.TB, name string) []byte {
	tb.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(tb, err)
	b, err := hex.DecodeString(strings.Join(strings.Fields(string(raw)), ""))
	require.NoError(tb, err, name)
	return b
}

func TestGoldenIndexCoversGoLists(t *testing.T) {
	idx := loadGoldenIndex(t)
	names := map[string]bool{}
	for _, e := range idx {
		assert.False(t, names[e.Name], "duplicate vector %s", e.Name)
		names[e.Name] = true
		assert.Contains(t, goldenLists, e.Name, "vector %s (%s) has no Go list", e.Name, e.Expr)
	}
	for name := range goldenLists {
		assert.True(t, names[name], "Go list %s has no vector in golden.json", name)
	}
}

func TestGolden(t *testing.T) {
	for _, e := range loadGoldenIndex(t) {
		t.Run(e.Name, func(t *testing.T) {
			mk, ok := goldenLists[e.Name]
			require.True(t, ok, "no Go list for %s", e.Name)
			want := mk()

			got, err := Encode(want)
			require.NoError(t, err)
			require.Len(t, got, e.Len)
			sum := sha256.Sum256(got)
			require.Equal(t, e.SHA256, hex.EncodeToString(sum[:]), "Encode differs from %s", e.Expr)
			assert.Equal(t, len(got), cap(got), "Encode should size its buffer exactly")

			golden := got
			if e.File != "" {
				golden = readHexFile(t, e.File)
				fileSum := sha256.Sum256(golden)
				require.Equal(t, e.SHA256, hex.EncodeToString(fileSum[:]), "%s does not match golden.json", e.File)
				require.True(t, bytes.Equal(golden, got), "Encode differs from %s\n got %x\nwant %x", e.File, head(got), head(golden))
			}

			dec, err := Decode(golden)
			require.NoError(t, err)
			require.NotNil(t, dec)
			require.Equal(t, want, dec)
		})
	}
}

func head(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}

// TestArrayHeaderBoundaries pins the header of the lists on either side of
// the fixarray/array16 and array16/array32 boundaries.
func TestArrayHeaderBoundaries(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want []byte
	}{
		{0, []byte{0x90}},
		{1, []byte{0x91}},
		{15, []byte{0x9f}},
		{16, []byte{0xdc, 0x00, 0x10}},
		{65535, []byte{0xdc, 0xff, 0xff}},
		{65536, []byte{0xdd, 0x00, 0x01, 0x00, 0x00}},
	} {
		b, err := Encode(BuildBlockDescs(0, tc.n, 1, 0))
		require.NoError(t, err)
		require.True(t, bytes.HasPrefix(b, tc.want), "n=%d: header %x, want %x", tc.n, head(b), tc.want)
		require.Equal(t, tc.want, b[:len(tc.want)])
	}
}

func TestEncodeNilIsEmptyArray(t *testing.T) {
	b, err := Encode(nil)
	require.NoError(t, err)
	require.Equal(t, []byte{0x90}, b)
	l, err := Decode(b)
	require.NoError(t, err)
	require.NotNil(t, l)
	require.Empty(t, l)
}

// TestGoldenMatchesPython re-runs testdata/gen.py to confirm that every
// stored vector is what its recorded Python expression produces. It needs a
// Python with the msgpack module (Debian's python3-msgpack).
func TestGoldenMatchesPython(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Python")
	}
	py := ""
	for _, cand := range []string{"/usr/bin/python3", "python3"} {
		p, err := exec.LookPath(cand)
		if err == nil && exec.Command(p, "-c", "import msgpack").Run() == nil {
			py = p
			break
		}
	}
	if py == "" {
		t.Skip("no python3 with msgpack")
	}
	out, err := exec.Command(py, filepath.Join("testdata", "gen.py"), "check").CombinedOutput()
	require.NoError(t, err, "gen.py check:\n%s", out)
}

func TestEncodeRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		l    List
		frag string
	}{
		{"zero length", List{{Addr: 1, Len: 1}, {Addr: 2, Len: 0}}, "descriptors: element 1: field 1 (len): zero length"},
		{"overflow", List{{Addr: math.MaxUint64, Len: 1}}, "element 0: field 1 (len): addr 0xffffffffffffffff + len 0x1 overflows uint64"},
		{"overflow by far", List{{Addr: 1 << 63, Len: 1 << 63}}, "overflows uint64"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Encode(tc.l)
			require.Error(t, err)
			assert.Nil(t, b)
			assert.ErrorIs(t, err, ErrMalformed)
			assert.NotErrorIs(t, err, ErrTooMany)
			assert.Contains(t, err.Error(), tc.frag)
		})
	}
}

// The largest legal range ends exactly at 2^64-1.
func TestEncodeLastByte(t *testing.T) {
	l := List{{Addr: math.MaxUint64 - 1, Len: 1}, {Addr: 0, Len: math.MaxUint64}}
	b, err := Encode(l)
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, l, got)
}

func mustHex(s string) []byte {
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		panic(err)
	}
	return b
}

// TestDecodeAcceptsAnyIntegerWidth feeds encodings Encode never writes but
// msgpack allows: signed integers holding non-negative values, wider than
// needed integers and array headers.
func TestDecodeAcceptsAnyIntegerWidth(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want List
	}{
		{"int8", "91 93 d0 05 d0 7f d0 00", List{{5, 127, 0}}},
		{"int16", "91 93 d1 00 10 d1 7f ff d1 00 00", List{{16, 32767, 0}}},
		{"int32", "91 93 d2 00 01 00 00 d2 7f ff ff ff d2 00 00 00 01", List{{65536, math.MaxInt32, 1}}},
		{"int64", "91 93 d3 7f ff ff ff ff ff ff fe d3 00 00 00 00 00 00 00 01 d3 00 00 00 00 00 00 00 00", List{{math.MaxInt64 - 1, 1, 0}}},
		{"wide uint", "91 93 cf 00 00 00 00 00 00 00 07 ce 00 00 00 08 cd 00 09", List{{7, 8, 9}}},
		{"uint8 small", "91 93 cc 00 cc 01 cc 02", List{{0, 1, 2}}},
		{"array16 top", "dc 00 01 93 01 02 03", List{{1, 2, 3}}},
		{"array32 top", "dd 00 00 00 01 93 01 02 03", List{{1, 2, 3}}},
		{"array16 element", "91 dc 00 03 01 02 03", List{{1, 2, 3}}},
		{"array32 element", "91 dd 00 00 00 03 01 02 03", List{{1, 2, 3}}},
		{"empty array16", "dc 00 00", List{}},
		{"empty array32", "dd 00 00 00 00", List{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := mustHex(tc.in)
			got, err := Decode(in)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			canon, err := Encode(got)
			require.NoError(t, err)
			assert.Less(t, len(canon), len(in), "the canonical form is shorter")
		})
	}
}

// elems17 is a list whose header declares 18 descriptors but that holds
// only the first 17: callers append element 17.
func elems17(tb testing.TB) []byte {
	b, err := Encode(BuildBlockDescs(blockBase, 17, 5120, 0))
	require.NoError(tb, err)
	require.Equal(tb, []byte{0xdc, 0x00, 17}, b[:3])
	b[2] = 18
	return b
}

func TestDecodeRejects(t *testing.T) {
	el17 := func(tail string) []byte {
		b := bytes.Clone(elems17(t))
		return append(b, mustHex(tail)...)
	}
	for _, tc := range []struct {
		name    string
		in      []byte
		max     int // 0: Decode
		frag    string
		tooMany bool
	}{
		{"nil input", nil, 0, "descriptors: top level: truncated input (at byte 0)", false},
		{"empty input", []byte{}, 0, "top level: truncated input", false},
		{"top map", mustHex("80"), 0, "descriptors: top level: want an array, got map (at byte 0)", false},
		{"top nil", mustHex("c0"), 0, "top level: want an array, got nil", false},
		{"top int", mustHex("01"), 0, "top level: want an array, got integer", false},
		{"top string", mustHex("a1 61"), 0, "top level: want an array, got string", false},
		{"top binary", mustHex("c4 01 00"), 0, "top level: want an array, got binary", false},
		{"top unused code", mustHex("c1"), 0, "top level: want an array, got unused type code 0xc1", false},
		{"top array16 cut", mustHex("dc 00"), 0, "top level: truncated input", false},
		{"top array32 cut", mustHex("dd 00 00 00"), 0, "top level: truncated input", false},
		{"element int", mustHex("91 01 01 01 01"), 0, "descriptors: element 0: want an array, got integer (at byte 1)", false},
		{"element map", mustHex("91 81 01 01 01"), 0, "element 0: want an array, got map", false},
		{"element nil", mustHex("91 c0 c0 c0 c0"), 0, "element 0: want an array, got nil", false},
		{"element of 2", mustHex("91 92 01 01 01"), 0, "element 0: want a 3-element array [addr, len, dev], got an array of 2", false},
		{"element of 4", mustHex("91 94 01 01 01 01"), 0, "element 0: want a 3-element array [addr, len, dev], got an array of 4", false},
		{"element of 0", mustHex("91 90 00 00 00"), 0, "got an array of 0", false},
		{"element array16 of 65535", mustHex("91 dc ff ff 01 01 01"), 0, "element 0: want a 3-element array [addr, len, dev], got an array of 65535", false},
		{"negative fixint addr", mustHex("91 93 ff 01 00"), 0, "descriptors: element 0: field 0 (addr): negative value -1 (at byte 2)", false},
		{"negative int8 len", mustHex("91 93 00 d0 80 00"), 0, "element 0: field 1 (len): negative value -128", false},
		{"negative int16 dev", mustHex("91 93 00 01 d1 ff fe"), 0, "element 0: field 2 (dev): negative value -2", false},
		{"negative int32 addr", mustHex("91 93 d2 80 00 00 00 01 00"), 0, "field 0 (addr): negative value -2147483648", false},
		{"negative int64 len", mustHex("91 93 00 d3 ff ff ff ff ff ff ff ff 00"), 0, "field 1 (len): negative value -1", false},
		{"nil dev", mustHex("91 93 00 01 c0"), 0, "element 0: field 2 (dev): want a non-negative integer, got nil", false},
		{"bool addr", mustHex("91 93 c3 01 00"), 0, "field 0 (addr): want a non-negative integer, got bool", false},
		{"false len", mustHex("91 93 00 c2 00"), 0, "field 1 (len): want a non-negative integer, got bool", false},
		{"float32 addr", mustHex("91 93 ca 3f 80 00 00 01 00"), 0, "field 0 (addr): want a non-negative integer, got float32", false},
		{"float64 len", mustHex("91 93 00 cb 3f f0 00 00 00 00 00 00 00"), 0, "field 1 (len): want a non-negative integer, got float64", false},
		{"string dev", mustHex("91 93 00 01 a1 30"), 0, "field 2 (dev): want a non-negative integer, got string", false},
		{"str8 addr", mustHex("91 93 d9 01 30 01 00"), 0, "field 0 (addr): want a non-negative integer, got string", false},
		{"binary len", mustHex("91 93 00 c4 01 01 00"), 0, "field 1 (len): want a non-negative integer, got binary", false},
		{"map dev", mustHex("91 93 00 01 80"), 0, "field 2 (dev): want a non-negative integer, got map", false},
		{"array addr", mustHex("91 93 90 01 00"), 0, "field 0 (addr): want a non-negative integer, got array", false},
		{"ext len", mustHex("91 93 00 d4 01 00 00"), 0, "field 1 (len): want a non-negative integer, got extension", false},
		{"unused code dev", mustHex("91 93 00 01 c1"), 0, "field 2 (dev): want a non-negative integer, got unused type code 0xc1", false},
		{"zero length", mustHex("91 93 00 00 00"), 0, "descriptors: element 0: field 1 (len): zero length (at byte 3)", false},
		{"zero length as int64", mustHex("91 93 00 d3 00 00 00 00 00 00 00 00 00"), 0, "element 0: field 1 (len): zero length", false},
		{"zero length element 17", el17("93 00 00 00"), 0, "descriptors: element 17: field 1 (len): zero length", false},
		{"negative element 17", el17("93 00 01 e0"), 0, "descriptors: element 17: field 2 (dev): negative value -32", false},
		{"overflow", mustHex("91 93 cf ff ff ff ff ff ff ff ff 01 00"), 0, "element 0: field 1 (len): addr 0xffffffffffffffff + len 0x1 overflows uint64", false},
		{"overflow big", mustHex("91 93 cf 80 00 00 00 00 00 00 00 cf 80 00 00 00 00 00 00 00 00"), 0, "addr 0x8000000000000000 + len 0x8000000000000000 overflows uint64", false},
		{"truncated value", mustHex("91 93 cf 00 00"), 0, "descriptors: element 0: field 0 (addr): truncated input (at byte 2)", false},
		{"truncated uint16", mustHex("91 93 cf 00 00 00 00 00 00 00 01 cd 00"), 0, "element 0: field 1 (len): truncated input", false},
		{"truncated before dev", mustHex("92 93 cf 00 00 00 00 00 00 00 01 01 01 93 01 01"), 0, "element 1: field 2 (dev): truncated input", false},
		{"truncated element header", mustHex("92 93 cf 00 00 00 00 00 00 00 01 01 01 dc 00"), 0, "element 1: truncated input", false},
		{"missing elements", mustHex("92 93 01 01 01"), 0, "top level: truncated input: list declares 2 descriptors but only 4 bytes follow", false},
		{"missing element 17", elems17(t), 0, "descriptors: element 17: truncated input", false},
		{"count far beyond input", mustHex("dd 00 10 00 00"), 0, "truncated input: list declares 1048576 descriptors but only 0 bytes follow", false},
		{"trailing byte", mustHex("90 00"), 0, "descriptors: top level: 1 trailing bytes after the list (at byte 1)", false},
		{"two lists", mustHex("91 93 01 01 01 91 93 01 01 01"), 0, "top level: 5 trailing bytes after the list (at byte 5)", false},
		{"count 2^32-1", mustHex("dd ff ff ff ff"), 0, "descriptors: top level: list declares 4294967295 descriptors, the limit is 4194304", true},
		{"count just over default", mustHex("dd 00 40 00 01"), 0, "list declares 4194305 descriptors, the limit is 4194304", true},
		{"over custom limit", mustHex("93 93 01 01 01 93 01 01 01 93 01 01 01"), 2, "list declares 3 descriptors, the limit is 2", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var l List
			var err error
			if tc.max == 0 {
				l, err = Decode(tc.in)
			} else {
				l, err = DecodeMax(tc.in, tc.max)
			}
			require.Error(t, err)
			assert.Nil(t, l)
			assert.ErrorIs(t, err, ErrMalformed)
			assert.Equal(t, tc.tooMany, errors.Is(err, ErrTooMany), "ErrTooMany")
			assert.Contains(t, err.Error(), tc.frag)
		})
	}
}

func TestDecodeMaxLimit(t *testing.T) {
	b, err := Encode(BuildBlockDescs(0, 3, 8, 0))
	require.NoError(t, err)
	for _, max := range []int{3, 4, 0, -1} {
		l, err := DecodeMax(b, max)
		require.NoError(t, err, "max %d", max)
		require.Len(t, l, 3)
	}
	_, err = DecodeMax(b, 2)
	require.ErrorIs(t, err, ErrTooMany)
}

// TestDecodeHostileCountDoesNotAllocate checks that headers claiming huge
// lists are refused before the list is allocated: a 4M-entry List would be
// 96 MiB.
func TestDecodeHostileCountDoesNotAllocate(t *testing.T) {
	for _, in := range [][]byte{
		mustHex("dd ff ff ff ff"),
		mustHex("dd 00 40 00 00"), // exactly DefaultMaxDescs, nothing behind it
		append(mustHex("dd 00 40 00 00"), make([]byte, 4096)...),
	} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		for range 10 {
			_, err := Decode(in)
			require.ErrorIs(t, err, ErrMalformed)
		}
		runtime.ReadMemStats(&after)
		assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(1<<20), "input %x", head(in))
	}
}

func TestErrorMessagesNameThePackage(t *testing.T) {
	_, err := Decode(mustHex("91 93 00 00 00"))
	require.Error(t, err)
	assert.Equal(t, "descriptors: element 0: field 1 (len): zero length (at byte 3)", err.Error())
	var target *codecError
	require.ErrorAs(t, err, &target)
}
