package ucx

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/procinfo"
	"github.com/ecxfer/ecxfer/nixl"
)

// Keys as UCX 1.13 packs them on this project's hosts: engine memory in a
// shared-memory segment (four domains, one with a 12-byte key), caller
// memory (three domains, empty keys), and either over tcp alone.
var goodRkeys = map[string][]byte{
	"segment": hexBytes("17000000000000000000000c28804a030010f201e67f000000"),
	"caller":  hexBytes("130000000000000000000000"),
	"tcp":     hexBytes("01000000000000000000"),
	// A key with a system device id and two distances after its keys.
	"device": hexBytes("01000000000000000000" + "05" + "010203" + "040506"),
	// Caller memory no domain registered (UCX_TLS=posix,sysv).
	"none": hexBytes("000000000000000000"),
}

func TestCheckRkey(t *testing.T) {
	for name, k := range goodRkeys {
		require.NoError(t, checkRkey(k), name)
	}
	seg := goodRkeys["segment"]
	bad := map[string][]byte{
		"one byte":                seg[:1],
		"header only":             seg[:9],
		"half":                    seg[:len(seg)/2],
		"one byte short":          seg[:len(seg)-1],
		"no domains, a byte":      append(make([]byte, 9), 0, 0),
		"device memory":           append(append([]byte{1, 0, 0, 0, 0, 0, 0, 0}, 3), 0),
		"a domain more in map":    append([]byte{0x1f}, seg[1:]...),
		"two domains less in map": append([]byte{0x03}, seg[1:]...),
		"trailing two bytes":      append(bytes.Clone(seg), 1, 2),
		"a size byte too large":   append(append(bytes.Clone(seg[:11]), 0x0d), seg[12:]...),
		// The review's forged key: one byte of the caller key's map
		// changed (0x13 -> 0x2b), the metadata re-sealed with a valid
		// checksum, crashed the reader inside UCX at its first READ.
		"review's map byte": append([]byte{0x2b}, goodRkeys["caller"][1:]...),
	}
	for name, k := range bad {
		require.Error(t, checkRkey(k), name)
	}
}

// TestForgedRkeyLayoutRefused: metadata whose packed key does not have
// UCX's layout is refused when loaded, with a valid checksum, before any
// of it reaches UCX; the same agent's true metadata then loads and its
// memory is read.
func TestForgedRkeyLayoutRefused(t *testing.T) {
	prod := newTestAgent(t, Config{Name: "rk-prod"})
	buf := mmapBuf(t, 1<<16)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	_, err := prod.RegisterMem(buf, nixl.DRAM, 0)
	require.NoError(t, err)
	md, err := prod.LocalMetadata()
	require.NoError(t, err)
	cons := newTestAgent(t, Config{Name: "rk-cons"})
	lbuf := mmapBuf(t, 1<<16)
	_, err = cons.RegisterMem(lbuf, nixl.DRAM, 0)
	require.NoError(t, err)

	edits := map[string]func([]byte) []byte{
		"map's first byte": func(k []byte) []byte { k[0] = 0x2b; return k },
		"one byte":         func(k []byte) []byte { return k[:1] },
		"half":             func(k []byte) []byte { return k[:len(k)/2] },
		"two bytes more":   func(k []byte) []byte { return append(k, 0, 0) },
		"memory type":      func(k []byte) []byte { k[8] = 1; return k },
	}
	for name, edit := range edits {
		forged := withKey(t, md, edit)
		_, err := cons.LoadRemoteMetadata(forged)
		require.ErrorIs(t, err, nixl.ErrInvalidParam, name)
		require.ErrorContains(t, err, "rkey", name)
	}
	require.Empty(t, cons.peers)

	name, err := cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	ld, err := cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(lbuf), 16, 4096, 0), nixl.DRAM)
	require.NoError(t, err)
	rd, err := cons.PrepDlist(name, descriptors.BuildBlockDescs(addrOf(buf), 16, 4096, 0), nixl.DRAM)
	require.NoError(t, err)
	id, err := cons.MakeXfer(nixl.Read, ld, []int{0}, rd, []int{3}, nil)
	require.NoError(t, err)
	require.NoError(t, cons.PostXfer(id))
	require.NoError(t, waitXfer(t, cons, id, 5*time.Second, prod))
	require.Equal(t, buf[3*4096:4*4096], lbuf[:4096])
}

// FuzzDecodeBody reaches the body's decoder with bodies the fuzzer
// changes: FuzzDecodeMetadata's blobs carry a checksum that a mutation
// almost never keeps right. Whatever decodes has keys of UCX's layout and
// re-encodes to itself.
func FuzzDecodeBody(f *testing.F) {
	for _, m := range []*metadata{sampleMetadata(), bigMetadata()} {
		blob, err := encodeMetadata(m)
		require.NoError(f, err)
		_, body, err := openEnvelope(blob)
		require.NoError(f, err)
		f.Add(bytes.Clone(body))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		blob := envelope(t, mdMagic, mdVersion, body)
		m, err := decodeMetadata(blob)
		if err != nil {
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
			return
		}
		for _, r := range m.Region {
			require.NoError(t, checkRkey(r.Rkey))
		}
		again, err := encodeMetadata(m)
		require.NoError(t, err)
		m2, err := decodeMetadata(again)
		require.NoError(t, err)
		require.Equal(t, m, m2)
	})
}

// MetadataProcess reads the pid and start time out of metadata without
// loading it, and says no for anything that does not decode.
func TestMetadataProcess(t *testing.T) {
	a := newTestAgent(t, Config{Name: "mp"})
	md, err := a.LocalMetadata()
	require.NoError(t, err)
	pid, start, ok := a.MetadataProcess(md)
	require.True(t, ok)
	require.Equal(t, uint64(os.Getpid()), pid)
	want, err := procinfo.StartTime(os.Getpid())
	require.NoError(t, err)
	require.Equal(t, want, start)
	for _, bad := range [][]byte{nil, {0x90}, md[:len(md)/2], append(bytes.Clone(md), 0)} {
		_, _, ok := a.MetadataProcess(bad)
		require.False(t, ok, "%x", bad)
	}
	require.Empty(t, a.peers, "nothing is loaded")
}
