package ucx

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/procmaps"
	"github.com/ecxfer/ecxfer/nixl"
)

// TestLyingMetadata: metadata re-encoded with a valid checksum but regions
// larger than (or shifted off) the memory behind them is refused at
// LoadRemoteMetadata, both for UCX-allocated memory and for caller memory
// in a shared file: each region must lie inside one mapping of the peer
// process, which these lies leave (the segment check behind it is
// TestCheckTruthSegmentSmaller's). The truthful blob still loads.
func TestLyingMetadata(t *testing.T) {
	leakcheck.Check(t)
	cons := newTestAgent(t, Config{Name: "cons"})

	alloc := newTestAgent(t, Config{Name: "prod-alloc"})
	_, _, err := alloc.AllocMem(1<<20, nixl.DRAM, 0)
	require.NoError(t, err)

	caller := newTestAgent(t, Config{Name: "prod-caller"})
	fd, err := unix.MemfdCreate("ecxfer-truth", 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, 1<<20))
	buf, err := unix.Mmap(fd, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer func() { _ = unix.Munmap(buf) }()
	_, err = caller.RegisterMem(buf, nixl.DRAM, 0)
	require.NoError(t, err)

	for _, prod := range []*Agent{alloc, caller} {
		md, err := prod.LocalMetadata()
		require.NoError(t, err)
		for name, lie := range map[string]func(r *region){
			"4 MiB longer": func(r *region) { r.Len += 4 << 20 },
			"1 GiB longer": func(r *region) { r.Len += 1 << 30 },
			"starts 1 MiB early": func(r *region) {
				r.Addr -= 1 << 20
				r.Len += 1 << 20
			},
		} {
			m, err := decodeMetadata(md)
			require.NoError(t, err)
			lie(&m.Region[0])
			forged, err := encodeMetadata(m)
			require.NoError(t, err)
			_, err = cons.LoadRemoteMetadata(forged)
			require.ErrorIs(t, err, nixl.ErrInvalidParam, "%s: %s", prod.Name(), name)
			require.ErrorContains(t, err, "not mapped in the peer process", "%s: %s", prod.Name(), name)
		}
		got, err := cons.LoadRemoteMetadata(md)
		require.NoError(t, err, prod.Name())
		require.Equal(t, prod.Name(), got)
	}
}

// checkTruth's check that a region of UCX-allocated memory lies inside
// the segment its key attaches here. A forged blob meets it only where
// the peer's own mapping is larger than that segment (one not mapped in
// the peer at all is refused before, TestLyingMetadata), so it is fed
// here the peer's true mappings and a region longer than the segment.
func TestCheckTruthSegmentSmaller(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t)
	cons := newTestAgent(t, Config{Name: "cons"})
	prod := newTestAgent(t, Config{Name: "prod"})
	_, _, err := prod.AllocMem(1<<20, nixl.DRAM, 0)
	require.NoError(t, err)
	md, err := prod.LocalMetadata()
	require.NoError(t, err)
	name, err := cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	m, err := decodeMetadata(md)
	require.NoError(t, err)
	caller, spans, err := callerRegions(m)
	require.NoError(t, err)
	require.Equal(t, []bool{false}, caller, "engine memory is a UCX segment")
	require.NoError(t, truthOf(cons, name, m, caller, spans), "the true regions")
	m.Region[0].Len += 4 << 20
	err = truthOf(cons, name, m, caller, spans)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.ErrorContains(t, err, "the shared-memory segment behind it is smaller")
}

// truthOf runs checkTruth on m with the rkeys a unpacked for peer name.
// (Step by step and not inlined: written as one expression, Go 1.26.8
// failed to compile it, an internal compiler error.)
//
//go:noinline
func truthOf(a *Agent, name string, m *metadata, caller []bool, spans []procmaps.Span) error {
	p := a.peers[name]
	rk := unsafe.Slice(p.rkeys, len(m.Region))
	err := checkTruth(m, rk, caller, spans)
	return err
}

// segmentAt returns the mapping of this process that holds addr.
func segmentAt(t *testing.T, addr uint64) procmaps.Span {
	t.Helper()
	m, err := procmaps.Open("self")
	require.NoError(t, err)
	defer m.Close()
	sp, err := m.At(addr)
	require.NoError(t, err)
	require.NotNil(t, sp)
	return *sp
}

// withSharedMemory gives the test UCX's default transports, shared
// memory among them, whatever UCX_TLS the environment sets (`UCX_TLS=tcp
// make test`): the test is about shared-memory segments and the keys that
// attach them, which UCX does not make over tcp alone.
func withSharedMemory(t *testing.T) {
	t.Setenv("UCX_TLS", "all")
}

// withKey re-encodes md with region 0's packed rkey rewritten by edit.
func withKey(t *testing.T, md []byte, edit func(rk []byte) []byte) []byte {
	t.Helper()
	m, err := decodeMetadata(md)
	require.NoError(t, err)
	m.Region[0].Rkey = edit(bytes.Clone(m.Region[0].Rkey))
	out, err := encodeMetadata(m)
	require.NoError(t, err)
	return out
}

// forgerAndVictim makes two agents with engine memory in System V
// segments (it skips the test when UCX allocated other kinds) and returns
// the forger's true metadata and, as they appear in its key, its
// segment's id and the victim's.
func forgerAndVictim(t *testing.T) (md []byte, own, other [4]byte) {
	t.Helper()
	const n = 1 << 20
	victim := newTestAgent(t, Config{Name: "victim"})
	_, vbuf, err := victim.AllocMem(n, nixl.DRAM, 0)
	require.NoError(t, err)
	forger := newTestAgent(t, Config{Name: "forger"})
	_, fbuf, err := forger.AllocMem(n, nixl.DRAM, 0)
	require.NoError(t, err)
	vs, fs := segmentAt(t, addrOf(vbuf)), segmentAt(t, addrOf(fbuf))
	if !strings.HasPrefix(fs.Name, "/SYSV") || !strings.HasPrefix(vs.Name, "/SYSV") {
		t.Skipf("UCX allocated %q and %q here, not System V segments", fs.Name, vs.Name)
	}
	md, err = forger.LocalMetadata()
	require.NoError(t, err)
	binary.LittleEndian.PutUint32(own[:], uint32(fs.Ino)) // a System V mapping's inode is its id
	binary.LittleEndian.PutUint32(other[:], uint32(vs.Ino))
	return md, own, other
}

// A peer's metadata that names its own UCX segment (address and length
// true, so the mapping checks pass) but whose rkey carries another agent's
// System V id is refused: the key must attach the segment the peer maps
// there. (It loaded, and READs of the peer returned the other agent's
// memory.)
func TestForgedSegmentKeyRefused(t *testing.T) {
	leakcheck.Check(t)
	md, own, other := forgerAndVictim(t)
	forged := withKey(t, md, func(rk []byte) []byte {
		require.Equal(t, 1, bytes.Count(rk, own[:]), "the segment id once in the key")
		return bytes.Replace(rk, own[:], other[:], 1)
	})
	cons := newTestAgent(t, Config{Name: "cons"})
	_, err := cons.LoadRemoteMetadata(forged)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.ErrorContains(t, err, "another shared-memory segment")
	name, err := cons.LoadRemoteMetadata(md)
	require.NoError(t, err, "the true metadata")
	require.Equal(t, "forger", name)
}

// The same forged key in metadata that also claims another host or
// network namespace, loaded in error mode NONE (where UCX reaches a
// same-host peer over shared memory whatever its metadata says): refused
// too. (The host check skipped the key checks, and READs of the forger
// returned the victim's memory.)
func TestForgedSegmentKeyClaimingOtherHostRefused(t *testing.T) {
	leakcheck.Check(t)
	md, own, other := forgerAndVictim(t)
	for _, c := range []struct {
		claim string
		edit  func(h *hostID)
		want  string
	}{
		{"another machine", func(h *hostID) { h.Boot = "another-host" }, "names another host"},
		{"another network namespace", func(h *hostID) { h.NetNS++ }, "another shared-memory segment"},
	} {
		t.Run(c.claim, func(t *testing.T) {
			m, err := decodeMetadata(md)
			require.NoError(t, err)
			m.Region[0].Rkey = bytes.Replace(bytes.Clone(m.Region[0].Rkey), own[:], other[:], 1)
			c.edit(&m.Host)
			forged, err := encodeMetadata(m)
			require.NoError(t, err)
			cons := newTestAgent(t, Config{Name: "cons", ErrMode: ErrModeNone})
			_, err = cons.LoadRemoteMetadata(forged)
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
			require.ErrorContains(t, err, c.want)
		})
	}
	// The true metadata claiming another network namespace is checked
	// and loads.
	m, err := decodeMetadata(md)
	require.NoError(t, err)
	m.Host.NetNS++
	other2, err := encodeMetadata(m)
	require.NoError(t, err)
	cons := newTestAgent(t, Config{Name: "cons", ErrMode: ErrModeNone})
	name, err := cons.LoadRemoteMetadata(other2)
	require.NoError(t, err)
	require.Equal(t, "forger", name)
}

// A region in the peer's own memory (caller memory, reached with emulated
// gets) whose rkey is another agent's shared-memory key is refused at its
// first transfer, when the key is unpacked, and the peer with it: such a
// key would make gets copy from a segment the region check never saw
// (past its end, here). (READs of it ran.)
func TestCallerMemoryWithSegmentKeyRefused(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t)
	const n = 1 << 20
	victim := newTestAgent(t, Config{Name: "victim"})
	_, vbuf, err := victim.AllocMem(n, nixl.DRAM, 0)
	require.NoError(t, err)
	vmd, err := victim.LocalMetadata()
	require.NoError(t, err)
	vm, err := decodeMetadata(vmd)
	require.NoError(t, err)
	forger := newTestAgent(t, Config{Name: "forger"})
	fbuf := mmapBuf(t, 2*n)
	_, err = forger.RegisterMem(fbuf, nixl.DRAM, 0)
	require.NoError(t, err)
	md, err := forger.LocalMetadata()
	require.NoError(t, err)
	var va, fa [8]byte
	binary.LittleEndian.PutUint64(va[:], addrOf(vbuf))
	binary.LittleEndian.PutUint64(fa[:], addrOf(fbuf))
	forged := withKey(t, md, func([]byte) []byte {
		rk := vm.Region[0].Rkey
		require.Equal(t, 1, bytes.Count(rk, va[:]), "the owner's address once in the key")
		return bytes.Replace(bytes.Clone(rk), va[:], fa[:], 1)
	})

	cons := newTestAgent(t, Config{Name: "cons"})
	cbuf := mmapBuf(t, n)
	_, err = cons.RegisterMem(cbuf, nixl.DRAM, 0)
	require.NoError(t, err)
	name, err := cons.LoadRemoteMetadata(forged)
	require.NoError(t, err, "caller memory: its key waits for the first transfer")
	local, err := cons.PrepDlist("", descriptors.List{{Addr: addrOf(cbuf), Len: 4096}}, nixl.DRAM)
	require.NoError(t, err)
	remote, err := cons.PrepDlist(name, descriptors.List{{Addr: addrOf(fbuf) + n, Len: 4096}}, nixl.DRAM)
	require.NoError(t, err)
	id, err := cons.MakeXfer(nixl.Read, local, []int{0}, remote, []int{0}, nil)
	require.NoError(t, err)
	err = cons.PostXfer(id)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.ErrorContains(t, err, "carries a shared-memory key")
	require.NoError(t, cons.ReleaseXfer(id))
	// The peer is gone with it.
	_, err = cons.MakeXfer(nixl.Read, local, []int{0}, remote, []int{0}, nil)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
}
