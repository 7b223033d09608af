package ecxfer

import (
	"bytes"
	"fmt"
	"math"
	"math/rand"
	"sort"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// The threat model, checked: a peer's metadata and descriptor list are
// input. Whatever they say, a READ never touches memory outside the
// regions the peer advertised (on its side) or outside our registered
// region (on ours); names are validated; sizes are bounded.

// ---------------------------------------------------------------------------
// Metadata rewriting. Only fields that are pure Go checks are changed
// (names, and, for loopback, regions): the bytes that reach UCX (worker
// address, rkeys) stay the genuine ones.

type lbMeta struct {
	magic   string
	version uint64
	name    string
	inc     uint64
	regions [][2]uint64
}

func decodeLoopbackMeta(t testing.TB, md []byte) lbMeta {
	t.Helper()
	d := msgpack.NewDecoder(bytes.NewReader(md))
	var m lbMeta
	n, err := d.DecodeArrayLen()
	require.NoError(t, err)
	require.Equal(t, 5, n)
	m.magic, err = d.DecodeString()
	require.NoError(t, err)
	m.version, err = d.DecodeUint64()
	require.NoError(t, err)
	m.name, err = d.DecodeString()
	require.NoError(t, err)
	m.inc, err = d.DecodeUint64()
	require.NoError(t, err)
	n, err = d.DecodeArrayLen()
	require.NoError(t, err)
	for i := 0; i < n; i++ {
		_, err = d.DecodeArrayLen()
		require.NoError(t, err)
		var r [2]uint64
		r[0], err = d.DecodeUint64()
		require.NoError(t, err)
		r[1], err = d.DecodeUint64()
		require.NoError(t, err)
		m.regions = append(m.regions, r)
	}
	return m
}

func (m lbMeta) encode(t testing.TB) []byte {
	t.Helper()
	var b bytes.Buffer
	e := msgpack.NewEncoder(&b)
	require.NoError(t, e.EncodeArrayLen(5))
	require.NoError(t, e.EncodeString(m.magic))
	require.NoError(t, e.EncodeUint(m.version))
	require.NoError(t, e.EncodeString(m.name))
	require.NoError(t, e.EncodeUint(m.inc))
	require.NoError(t, e.EncodeArrayLen(len(m.regions)))
	for _, r := range m.regions {
		require.NoError(t, e.EncodeArrayLen(2))
		require.NoError(t, e.EncodeUint(r[0]))
		require.NoError(t, e.EncodeUint(r[1]))
	}
	return b.Bytes()
}

// renameUCXMeta returns a ucx metadata blob with the name replaced and a
// valid checksum; everything else is the genuine bytes.
func renameUCXMeta(t testing.TB, md []byte, name string) []byte {
	t.Helper()
	d := msgpack.NewDecoder(bytes.NewReader(md))
	n, err := d.DecodeArrayLen()
	require.NoError(t, err)
	require.Equal(t, 4, n)
	magic, err := d.DecodeString()
	require.NoError(t, err)
	ver, err := d.DecodeUint64()
	require.NoError(t, err)
	body, err := d.DecodeBytes()
	require.NoError(t, err)

	bd := msgpack.NewDecoder(bytes.NewReader(body))
	n, err = bd.DecodeArrayLen()
	require.NoError(t, err)
	require.Equal(t, 9, n)
	_, err = bd.DecodeString() // the old name
	require.NoError(t, err)
	var nb bytes.Buffer
	e := msgpack.NewEncoder(&nb)
	require.NoError(t, e.EncodeArrayLen(9))
	require.NoError(t, e.EncodeString(name))
	rest := body[len(body)-bd.Buffered().(*bytes.Reader).Len():]
	nb.Write(rest)

	var out bytes.Buffer
	e = msgpack.NewEncoder(&out)
	require.NoError(t, e.EncodeArrayLen(4))
	require.NoError(t, e.EncodeString(magic))
	require.NoError(t, e.EncodeUint(ver))
	require.NoError(t, e.EncodeBytes(nb.Bytes()))
	require.NoError(t, e.EncodeUint(xxhash.Sum64(nb.Bytes())))
	return out.Bytes()
}

// renameMeta rewrites the agent name in a backend's metadata.
func renameMeta(t testing.TB, backend string, md []byte, name string) []byte {
	if backend == "ucx" {
		return renameUCXMeta(t, md, name)
	}
	m := decodeLoopbackMeta(t, md)
	m.name = name
	return m.encode(t)
}

func encDescs(t testing.TB, l descriptors.List) []byte {
	t.Helper()
	b, err := descriptors.Encode(l)
	require.NoError(t, err)
	return b
}

// rawDescs encodes descriptors without Encode's checks (wrapping ones).
func rawDescs(t testing.TB, l [][3]uint64) []byte {
	t.Helper()
	var b bytes.Buffer
	e := msgpack.NewEncoder(&b)
	require.NoError(t, e.EncodeArrayLen(len(l)))
	for _, d := range l {
		require.NoError(t, e.EncodeArrayLen(3))
		for _, v := range d {
			require.NoError(t, e.EncodeUint(v))
		}
	}
	return b.Bytes()
}

func runThreat(t *testing.T, backend string) {
	const bs, nb = 4096, 16
	setup := func(t *testing.T) (prod, cons *Transport, pname string) {
		leakcheck.Check(t)
		return env{t: t, backend: backend}.pair(bs, nb, 99)
	}

	t.Run("DescriptorsOutsideRegions", func(t *testing.T) {
		prod, cons, pname := setup(t)
		base := uint64(addrOf(prod.Region()))
		end := base + bs*nb
		cases := map[string][]byte{
			"below":              encDescs(t, descriptors.List{{Addr: base - bs, Len: bs}}),
			"straddles start":    encDescs(t, descriptors.List{{Addr: base - 1, Len: bs}}),
			"straddles end":      encDescs(t, descriptors.List{{Addr: end - bs + 1, Len: bs}}),
			"at end":             encDescs(t, descriptors.List{{Addr: end, Len: bs}}),
			"far away":           encDescs(t, descriptors.List{{Addr: 0x1000, Len: bs}}),
			"null":               encDescs(t, descriptors.List{{Addr: 0, Len: bs}}),
			"huge":               encDescs(t, descriptors.List{{Addr: base, Len: 1 << 62}}),
			"region plus a byte": encDescs(t, descriptors.List{{Addr: base, Len: bs*nb + 1}}),
			"max len":            encDescs(t, descriptors.List{{Addr: base, Len: math.MaxUint64 - base}}),
			"wraps":              rawDescs(t, [][3]uint64{{base, math.MaxUint64, 0}}),
			"wraps to base":      rawDescs(t, [][3]uint64{{math.MaxUint64 - 15, base + 16 + bs, 0}}),
			"zero length":        rawDescs(t, [][3]uint64{{base, 0, 0}}),
			"last of many bad": encDescs(t, append(descriptors.BuildBlockDescs(base, nb, bs, 0),
				descriptors.Desc{Addr: end, Len: bs})),
			"one block too many": encDescs(t, descriptors.BuildBlockDescs(base, nb+1, bs, 0)),
			"huge count":         {0xdd, 0xff, 0xff, 0xff, 0xff, 0x93, 0x01, 0x01, 0x00},
			"empty":              {0x90},
		}
		peers := cons.Stats().Peers
		for name, desc := range cases {
			got, err := cons.AddRemotePeer(prod.AgentMetadata(), desc)
			require.ErrorIs(t, err, ErrBadDescriptor, name)
			require.Empty(t, got, name)
		}
		require.Equal(t, peers, cons.Stats().Peers)
		// The good list is still in place: the last block reads fine.
		h, err := cons.PostRead([]int{0}, pname, []int{nb - 1}, nil)
		require.NoError(t, err)
		_, err = wait(t, cons, h)
		require.NoError(t, err)
		require.Equal(t, block(prod, bs, nb-1), block(cons, bs, 0))
		require.NoError(t, cons.ReleaseXferHandle(h))
	})

	t.Run("DescriptorsInsideButOdd", func(t *testing.T) {
		// Unaligned and overlapping descriptors inside the region are
		// legitimate: they read exactly the bytes they name.
		prod, cons, pname := setup(t)
		base := uint64(addrOf(prod.Region()))
		odd := descriptors.List{{Addr: base + 1, Len: bs}, {Addr: base + 2, Len: bs}, {Addr: base + bs*nb - bs, Len: bs}}
		// A descriptor of another size than the block is refused at
		// AddRemotePeer: no READ could use it.
		_, err := cons.AddRemotePeer(prod.AgentMetadata(), encDescs(t, append(odd, descriptors.Desc{Addr: base, Len: 2 * bs})))
		require.ErrorIs(t, err, ErrBadDescriptor)
		got, err := cons.AddRemotePeer(prod.AgentMetadata(), encDescs(t, odd))
		require.NoError(t, err)
		require.Equal(t, pname, got)
		h, err := cons.PostRead([]int{3, 4, 5}, pname, []int{0, 1, 2}, nil)
		require.NoError(t, err)
		_, err = wait(t, cons, h)
		require.NoError(t, err)
		require.Equal(t, prod.Region()[1:bs+1], block(cons, bs, 3))
		require.Equal(t, prod.Region()[2:bs+2], block(cons, bs, 4))
		require.Equal(t, block(prod, bs, nb-1), block(cons, bs, 5))
		require.NoError(t, cons.ReleaseXferHandle(h))
		require.Equal(t, int64(0), cons.Stats().LiveHandles)
	})

	t.Run("AgentNames", func(t *testing.T) {
		prod, cons, _ := setup(t)
		md := prod.AgentMetadata()
		bad := map[string]string{
			"too long":    strings.Repeat("n", 257),
			"space":       "a b",
			"newline":     "a\nb",
			"nul":         "a\x00b",
			"escape":      "\x1b[31mred",
			"del":         "a\x7f",
			"non-ascii":   "caf\u00e9",
			"invalid utf": "a\xff",
		}
		if backend == "loopback" {
			bad["empty"] = "" // the ucx decoder's own length check covers it there
		}
		var accepted []string
		for what, name := range bad {
			got, err := cons.AddRemotePeer(renameMeta(t, backend, md, name), prod.MemDescriptor())
			if err == nil {
				accepted = append(accepted, fmt.Sprintf("%s %q", what, got))
				require.NoError(t, cons.RemoveRemotePeer(got))
				continue
			}
			require.ErrorIs(t, err, ErrBadMetadata, "%s: %q", what, name)
		}
		sort.Strings(accepted)
		require.Empty(t, accepted, "names New would refuse were loaded from metadata")
		// A valid 256-byte name is fine: the loaded peer just is not that
		// agent, so its READs fail, never touching anything else.
		long := strings.Repeat("x", 256)
		got, err := cons.AddRemotePeer(renameMeta(t, backend, md, long), prod.MemDescriptor())
		require.NoError(t, err)
		require.Equal(t, long, got)
		require.NoError(t, cons.RemoveRemotePeer(long))
	})

	t.Run("MetadataSize", func(t *testing.T) {
		prod, cons, _ := setup(t)
		huge := make([]byte, 17<<20)
		copy(huge, prod.AgentMetadata())
		_, err := cons.AddRemotePeer(huge, prod.MemDescriptor())
		require.ErrorIs(t, err, ErrBadMetadata)
		_, err = cons.AddRemotePeer(append(prod.AgentMetadata(), 0xc0), prod.MemDescriptor())
		require.ErrorIs(t, err, ErrBadMetadata, "trailing bytes")
	})
}

func TestThreatLoopback(t *testing.T) {
	runThreat(t, "loopback")

	t.Run("LyingRegions", func(t *testing.T) {
		// Metadata may advertise regions the peer does not have; the
		// engine still moves bytes only within memory the peer really
		// registered, so such a READ fails instead of reading elsewhere.
		leakcheck.Check(t)
		prod, cons, _ := env{t: t, backend: "loopback"}.pair(4096, 16, 5)
		m := decodeLoopbackMeta(t, prod.AgentMetadata())
		base := m.regions[0][0]
		m.regions = [][2]uint64{{base, 1 << 40}}
		fake := descriptors.List{{Addr: base + 1<<30, Len: 4096}, {Addr: base, Len: 4096}}
		name, err := cons.AddRemotePeer(m.encode(t), encDescs(t, fake))
		require.NoError(t, err)
		h, err := cons.PostRead([]int{0}, name, []int{0}, nil)
		require.NoError(t, err)
		st, err := wait(t, cons, h)
		require.Equal(t, StateErr, st)
		require.ErrorIs(t, err, ErrEngine)
		require.NoError(t, cons.ReleaseXferHandle(h))
	})
}

func TestThreatUCX(t *testing.T) {
	runThreat(t, "ucx")

	t.Run("FailedReplacementKeepsPeer", func(t *testing.T) {
		// New metadata under a known name (a restarted producer) whose
		// block list does not fit it is refused, and the peer that was
		// there keeps working: the engine loads the new metadata beside
		// the old peer and replaces it only once everything is ready.
		leakcheck.Check(t)
		const bs, nb = 4096, 16
		e := env{t: t, backend: "ucx"}
		for _, direct := range []DirectMode{DirectOff, DirectOn} {
			prod, cons, pname := e.pair(bs, nb, 3)
			if direct == DirectOff {
				cons = e.transport(uniqueName("cons"), bs, nb, func(c *Config) { c.Direct = DirectOff })
				_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
				require.NoError(t, err)
			}
			path := cons.PeerPath(pname)
			read := func(from *Transport) {
				t.Helper()
				clear(block(cons, bs, 0))
				h, err := cons.PostRead([]int{0}, pname, []int{5}, nil)
				require.NoError(t, err)
				_, err = wait(t, cons, h)
				require.NoError(t, err)
				require.Equal(t, block(from, bs, 5), block(cons, bs, 0))
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			read(prod)

			// The restarted producer advertises no region (its Direct is
			// off), so its block list is checked by the engine alone.
			restarted := e.transport(pname, bs, nb, func(c *Config) { c.Direct = DirectOff })
			rand.New(rand.NewSource(4)).Read(restarted.Region())
			// The old producer's block list with the new metadata: its
			// blocks are not in the restarted producer's memory.
			_, err := cons.AddRemotePeer(restarted.AgentMetadata(), prod.MemDescriptor())
			require.ErrorIs(t, err, ErrBadDescriptor, "direct %v", direct)
			require.Equal(t, path, cons.PeerPath(pname), "direct %v", direct)
			require.Equal(t, 1, cons.Stats().Peers)
			read(prod)

			// With its own list it replaces the old one.
			got, err := cons.AddRemotePeer(restarted.AgentMetadata(), restarted.MemDescriptor())
			require.NoError(t, err)
			require.Equal(t, pname, got)
			require.Equal(t, "engine", cons.PeerPath(pname))
			read(restarted)
		}
	})
}
