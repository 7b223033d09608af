package libnixl

import (
	"encoding/binary"
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/nixl"
)

// mdWriter writes blobs in the record layout md.go reads, for tests.
type mdWriter struct{ b []byte }

func newMDWriter() *mdWriter { return &mdWriter{b: []byte(mdMagic)} }

func (w *mdWriter) rec(tag string, v []byte) *mdWriter {
	w.b = append(w.b, tag...)
	w.b = binary.LittleEndian.AppendUint64(w.b, uint64(len(v)))
	w.b = append(w.b, v...)
	w.b = append(w.b, '|')
	return w
}

func u64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

func desc(addr, n, dev uint64, meta string) []byte {
	d := binary.LittleEndian.AppendUint64(nil, addr)
	d = binary.LittleEndian.AppendUint64(d, n)
	d = binary.LittleEndian.AppendUint64(d, dev)
	return append(d, meta...)
}

// sampleMD is a blob shaped like a NIXL agent's with one UCX connection
// and two DRAM regions.
func sampleMD(name string) []byte {
	w := newMDWriter().rec("Agent", []byte(name)).rec("Conns", u64(1)).
		rec("t", []byte("UCX")).rec("c", []byte("worker-address-bytes")).
		rec("", []byte("MemSection")).rec("nixlSecElms", u64(1)).
		rec("bknd", []byte("UCX")).rec("nixlDList", []byte("nixlSDList")).
		rec("t", []byte{0, 0, 0, 0}).rec("n", u64(2)).
		rec("", desc(0x10000, 4096, 0, "rkey-1")).
		rec("", desc(0x40000, 8192, 0, "rkey-2"))
	return w.b
}

func TestParseMD(t *testing.T) {
	md, err := parseMD(sampleMD("prod-1"))
	require.NoError(t, err)
	require.Equal(t, "prod-1", md.name)
	require.True(t, md.known)
	require.Equal(t, []nixl.Span{{Addr: 0x10000, Len: 4096}, {Addr: 0x40000, Len: 8192}}, md.regions)
}

func TestParseMDOtherLayout(t *testing.T) {
	// A NIXL with another layout after the name: the name is enough.
	b := newMDWriter().rec("Agent", []byte("p")).rec("Something", []byte("else")).b
	md, err := parseMD(b)
	require.NoError(t, err)
	require.Equal(t, "p", md.name)
	require.False(t, md.known)
	require.Nil(t, md.regions)
}

func TestParseMDBad(t *testing.T) {
	good := sampleMD("prod")
	cases := map[string][]byte{
		"nil":         nil,
		"empty":       {},
		"no magic":    []byte("not metadata at all"),
		"magic only":  []byte(mdMagic),
		"empty name":  newMDWriter().rec("Agent", nil).b,
		"nul in name": sampleMD("prod\x00x"),
		"not utf-8":   sampleMD("prod-\xff\xfe"),
		"other tag":   newMDWriter().rec("Agnet", []byte("x")).b,
		"huge len":    append([]byte(mdMagic+"Agent"), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f),
	}
	for name, b := range cases {
		_, err := parseMD(b)
		require.ErrorIs(t, err, nixl.ErrInvalidParam, name)
	}
	// Every cut of a good blob short of its end is refused, so NIXL never
	// half-loads one.
	for n := 0; n < len(good); n++ {
		_, err := parseMD(good[:n])
		require.ErrorIs(t, err, nixl.ErrInvalidParam, "cut at %d of %d", n, len(good))
	}
}

func TestParseMDTruncatedIsNotLayout(t *testing.T) {
	good := sampleMD("prod")
	_, err := parseMD(good[:len(good)-3])
	require.True(t, errors.Is(err, errTruncated), "%v", err)
}

func FuzzParseMD(f *testing.F) {
	f.Add(sampleMD("prod"))
	f.Add(newMDWriter().rec("Agent", []byte("p")).b)
	f.Add([]byte(mdMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := parseMD(b)
		if err != nil {
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
			return
		}
		// The name is the first record's value, as NIXL hands names
		// back: no NUL (a C string would cut it), UTF-8, at most 4 KiB.
		require.NotEmpty(t, md.name)
		require.LessOrEqual(t, len(md.name), 4096)
		require.NotContains(t, md.name, "\x00")
		require.True(t, utf8.ValidString(md.name))
		r := &mdReader{b: b, off: len(mdMagic)}
		first, err := r.record("Agent")
		require.NoError(t, err)
		require.Equal(t, md.name, string(first))
		// The first connection's address format is read whatever the
		// layout after it (NIXL connects to it before reading on).
		wantFormat := -1
		if conns, err := r.count("Conns"); err == nil && conns > 0 && conns <= 64 {
			if _, err := r.record("t"); err == nil {
				if c, err := r.record("c"); err == nil && len(c) > 0 {
					wantFormat = int(c[0] & 0x0f)
				}
			}
		}
		require.Equal(t, wantFormat, md.addrFormat)
		if md.known {
			// The whole walk succeeded: every region lies inside the
			// blob's records, so there are at most as many as bytes.
			require.LessOrEqual(t, len(md.regions), len(b)/basicDescSize)
			_, err := nixl.NewSpanIndex(md.regions)
			require.NoError(t, err, "decoded regions are non-empty and do not wrap")
		}
	})
}
