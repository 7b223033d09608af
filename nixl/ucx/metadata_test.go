package ucx

import (
	"bytes"
	"encoding/hex"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

func sampleMetadata() *metadata {
	return &metadata{
		Name:   "encoder-0",
		Host:   hostID{Boot: "6f1c0e9e-0c4b-4c8e-9d51-5e0c2d7a9b10", NetNS: 4026531840, PidNS: 4026531836},
		Pid:    4242,
		Start:  123456,
		UCX:    1<<16 | 13,
		Worker: bytes.Repeat([]byte{0x11, 0x22, 0x33}, 50),
		Region: []region{
			{Addr: 0x7f0000000000, Len: 5 << 20, Rkey: hexBytes("17000000000000000000000c28804a030010f201e67f000000")},
			{Addr: 0x7f1000000000, Len: 4096, Rkey: hexBytes("01000000000000000000")},
		},
	}
}

// hexBytes decodes a hex literal of a test.
func hexBytes(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

// envelope builds a blob around an arbitrary body with a correct checksum,
// so tests reach the body checks.
func envelope(t testing.TB, magic string, version uint64, body []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	e := msgpack.NewEncoder(&b)
	require.NoError(t, e.EncodeArrayLen(4))
	require.NoError(t, e.EncodeString(magic))
	require.NoError(t, e.EncodeUint(version))
	require.NoError(t, e.EncodeBytes(body))
	require.NoError(t, e.EncodeUint(xxhash.Sum64(body)))
	return b.Bytes()
}

// body encodes the v1 body fields given as values.
func body(t testing.TB, fields ...any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(fields)
	require.NoError(t, err)
	return b
}

// bigMetadata is sampleMetadata from an agent with LargeTCPSegments.
func bigMetadata() *metadata {
	m := sampleMetadata()
	m.UCX = ucxFeatures(1, 13, featGather|featBigSegments)
	return m
}

// envelopeVersion reads the version field of a blob's envelope with the
// plain msgpack decoder, apart from the code under test.
func envelopeVersion(t testing.TB, blob []byte) uint64 {
	t.Helper()
	var env []any
	require.NoError(t, msgpack.Unmarshal(blob, &env))
	require.Len(t, env, 4)
	switch v := env[1].(type) {
	case uint64:
		return v
	case int8:
		return uint64(v)
	case uint8:
		return uint64(v)
	case int64:
		return uint64(v)
	}
	t.Fatalf("version %T %v", env[1], env[1])
	return 0
}

func TestMetadataRoundTrip(t *testing.T) {
	for name, m := range map[string]*metadata{"v1": sampleMetadata(), "big": bigMetadata()} {
		t.Run(name, func(t *testing.T) {
			blob, err := encodeMetadata(m)
			require.NoError(t, err)
			got, err := decodeMetadata(blob)
			require.NoError(t, err)
			require.Equal(t, m, got)
		})
	}
}

// TestMetadataVersionBig: an agent with featBigSegments sends version 2,
// which builds from before the feature (version 1 alone) refuse whole;
// every other sends version 1, which they read. A blob whose version and
// bit disagree is refused.
func TestMetadataVersionBig(t *testing.T) {
	small, err := encodeMetadata(sampleMetadata())
	require.NoError(t, err)
	require.Equal(t, uint64(1), envelopeVersion(t, small))
	big, err := encodeMetadata(bigMetadata())
	require.NoError(t, err)
	require.Equal(t, uint64(2), envelopeVersion(t, big))

	rebody := func(blob []byte) []byte {
		var env []any
		require.NoError(t, msgpack.Unmarshal(blob, &env))
		return env[2].([]byte)
	}
	for name, blob := range map[string][]byte{
		"bit in version 1":    envelope(t, mdMagic, 1, rebody(big)),
		"version 2 no bit":    envelope(t, mdMagic, 2, rebody(small)),
		"version 3 big":       envelope(t, mdMagic, 3, rebody(big)),
		"version 0":           envelope(t, mdMagic, 0, rebody(small)),
		"version 1<<32 small": envelope(t, mdMagic, 1<<32|1, rebody(small)),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := decodeMetadata(blob)
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
			require.ErrorContains(t, err, "version")
		})
	}
	for _, blob := range [][]byte{envelope(t, mdMagic, 1, rebody(small)), envelope(t, mdMagic, 2, rebody(big))} {
		_, err := decodeMetadata(blob)
		require.NoError(t, err)
	}
}

func TestMetadataHostile(t *testing.T) {
	good, err := encodeMetadata(sampleMetadata())
	require.NoError(t, err)
	m := sampleMetadata()
	regs := func(rs ...[]any) []any {
		out := make([]any, len(rs))
		for i, r := range rs {
			out[i] = r
		}
		return out
	}
	fields := func(name any, worker any, regions any) []any {
		return []any{name, m.Host.Boot, m.Host.NetNS, m.Host.PidNS, m.Pid, m.Start, m.UCX, worker, regions}
	}
	flipped := bytes.Clone(good)
	flipped[len(flipped)/2] ^= 0x40
	hugeBin := append([]byte{0x94, 0xaa}, "ecxfer/ucx"...)
	hugeBin = append(hugeBin, 0x01, 0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2, 3)

	cases := map[string][]byte{
		"empty":          nil,
		"not msgpack":    []byte("hello world"),
		"nil":            {0xc0},
		"wrong magic":    envelope(t, "nixl", mdVersion, body(t, fields(m.Name, m.Worker, regs())...)),
		"wrong version":  envelope(t, mdMagic, 3, body(t, fields(m.Name, m.Worker, regs())...)),
		"bad checksum":   flipped,
		"huge bin":       hugeBin,
		"trailing bytes": append(bytes.Clone(good), 0),
		"empty name":     envelope(t, mdMagic, mdVersion, body(t, fields("", m.Worker, regs())...)),
		"long name":      envelope(t, mdMagic, mdVersion, body(t, fields(string(make([]byte, 300)), m.Worker, regs())...)),
		"name not str":   envelope(t, mdMagic, mdVersion, body(t, fields(42, m.Worker, regs())...)),
		"worker not bin": envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, "abc", regs())...)),
		"empty worker":   envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, []byte{}, regs())...)),
		"huge worker":    envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, make([]byte, maxWorkerAddr+1), regs())...)),
		"short body":     envelope(t, mdMagic, mdVersion, body(t, m.Name, m.Host.Boot)),
		"zero region":    envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, m.Worker, regs([]any{uint64(4096), uint64(0), []byte{1}}))...)),
		"wrapping region": envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, m.Worker,
			regs([]any{^uint64(0) - 10, uint64(100), []byte{1}}))...)),
		"overlapping regions": envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, m.Worker,
			regs([]any{uint64(4096), uint64(8192), []byte{1}}, []any{uint64(8192), uint64(8192), []byte{1}}))...)),
		"negative addr": envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, m.Worker,
			regs([]any{int64(-4096), uint64(4096), []byte{1}}))...)),
		"empty rkey": envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, m.Worker,
			regs([]any{uint64(4096), uint64(4096), []byte{}}))...)),
		"region not array": envelope(t, mdMagic, mdVersion, body(t, fields(m.Name, m.Worker, []any{uint64(1)})...)),
	}
	for i := 1; i < len(good); i += max(1, len(good)/40) {
		cases["truncated/"+string(rune('a'+i%26))+string(rune('0'+i/26%10))] = good[:i]
	}
	for name, blob := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := decodeMetadata(blob)
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
		})
	}
}

// TestLoadHostileMetadata feeds hostile blobs to a live agent: each fails
// with ErrInvalidParam before reaching UCX, and the agent stays usable.
func TestLoadHostileMetadata(t *testing.T) {
	leakcheck.Check(t)
	a := newTestAgent(t, Config{Name: "victim"})
	b := newTestAgent(t, Config{Name: "peer"})
	_, _, err := b.AllocMem(8192, nixl.DRAM, 0)
	require.NoError(t, err)
	good, err := b.LocalMetadata()
	require.NoError(t, err)
	m, err := decodeMetadata(good)
	require.NoError(t, err)

	garbage := *m
	garbage.Worker = bytes.Repeat([]byte{0xff}, len(m.Worker)) // wrong address format
	gblob, err := encodeMetadata(&garbage)
	require.NoError(t, err)
	otherUCX := *m
	otherUCX.UCX = 9 << 16
	ublob, err := encodeMetadata(&otherUCX)
	require.NoError(t, err)
	hostile := [][]byte{good[:len(good)/2], good[:1], append([]byte{0x90}, good...), gblob, ublob}
	for i := 0; i < len(good); i += 7 {
		c := bytes.Clone(good)
		c[i] ^= 0xa5
		hostile = append(hostile, c)
	}
	for i, h := range hostile {
		_, err := a.LoadRemoteMetadata(h)
		require.ErrorIs(t, err, nixl.ErrInvalidParam, "blob %d", i)
	}
	require.Empty(t, a.peers)
	name, err := a.LoadRemoteMetadata(good)
	require.NoError(t, err)
	require.Equal(t, "peer", name)
}

func FuzzDecodeMetadata(f *testing.F) {
	good, err := encodeMetadata(sampleMetadata())
	require.NoError(f, err)
	empty := sampleMetadata()
	empty.Region = nil
	noRegions, err := encodeMetadata(empty)
	require.NoError(f, err)
	big, err := encodeMetadata(bigMetadata())
	require.NoError(f, err)
	f.Add(good)
	f.Add(big)
	f.Add(noRegions)
	f.Add(good[:len(good)/2])
	f.Add([]byte{0x94})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, blob []byte) {
		m, err := decodeMetadata(blob)
		if err != nil {
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
			require.Nil(t, m)
			return
		}
		// Whatever decodes re-encodes to a blob that decodes the same.
		again, err := encodeMetadata(m)
		require.NoError(t, err)
		m2, err := decodeMetadata(again)
		require.NoError(t, err)
		require.Equal(t, m, m2)
	})
}
