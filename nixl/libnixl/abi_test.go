package libnixl

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// pinnedNIXL is the NIXL version requirements-nixl.txt pins.
func pinnedNIXL(t *testing.T) string {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "..", "requirements-nixl.txt"))
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "nixl-cu12=="); ok {
			return v
		}
	}
	t.Fatal("requirements-nixl.txt pins no nixl-cu12 version")
	return ""
}

// The library found here speaks this package's ABI, and runs on the NIXL
// release requirements-nixl.txt pins, which is the one the shim's
// declarations of NIXL's C API (shim/nixlcapi.h) are written for.
func TestABIVersion(t *testing.T) {
	needNIXL(t)
	l, err := load("")
	require.NoError(t, err)
	require.Equal(t, ABIVersion(), l.abiVersion(),
		"%s speaks ABI %d, this package %d: rebuild it (make nixl)", l.path, l.abiVersion(), ABIVersion())
	v, err := l.nixlVersion()
	require.NoError(t, err, "the shim refuses the NIXL under it")
	require.Equal(t, pinnedNIXL(t), v,
		"%s runs on NIXL %s, requirements-nixl.txt pins another: change them together", l.path, v)
}

// TestABIRoundTrip drives every function of the shim's ABI against the
// real library and checks that what goes in comes out unchanged: names at
// the length limit, backend parameters, metadata, descriptor lists, READ
// and WRITE with binary notifications (NUL bytes, a record larger than the
// engine's first notification buffer), direct notifications in order,
// invalidation and teardown. A shim and library that disagree on a
// signature or a record layout fail here.
func TestABIRoundTrip(t *testing.T) {
	needNIXL(t)
	const bs, nb = 4096, 64
	long := fmt.Sprintf("abi-%d-", os.Getpid())
	long += strings.Repeat("x", maxNameLen-len(long))
	mk := func(name string, params map[string]string) *side {
		a, err := New(Config{Name: name, BackendParams: params, MaxNotif: 1 << 20})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, a.Close()) })
		id, buf, err := a.AllocMem(bs*nb, nixl.DRAM, 0)
		require.NoError(t, err)
		require.NotZero(t, id)
		base := uint64(uintptr(unsafePointer(buf)))
		s := &side{a: a, buf: buf, bs: bs, descs: descriptors.BuildBlockDescs(base, nb, bs, 0)}
		s.local, err = a.PrepDlist("", s.descs, nixl.DRAM)
		require.NoError(t, err)
		return s
	}
	// Both sides the same mode: UCX refuses peers whose modes differ.
	none := map[string]string{"ucx_error_handling_mode": "none"}
	prod := mk(long, none)
	cons := mk(testName("abi-cons"), none)
	_, err := New(Config{Name: testName("abi-bad"), BackendParams: map[string]string{"num_workers": "not-a-number"}})
	require.Error(t, err, "a parameter NIXL's UCX backend rejects reaches it")

	pname, rdl := cons.connect(t, prod)
	require.Equal(t, long, pname, "a %d-byte name survives the metadata round trip", len(long))
	cname, cdl := prod.connect(t, cons)
	require.Equal(t, cons.a.Name(), cname)

	rng := rand.New(rand.NewSource(3))
	rng.Read(prod.buf)
	rng.Read(cons.buf)
	pm := newPump(cons.a, prod.a)

	big := make([]byte, 100<<10) // beyond the first 64 KiB notification buffer
	rng.Read(big)
	msgs := [][]byte{{0, 1, 0, 0xff, 0}, []byte("session:hash"), big}
	for i, msg := range msgs {
		local, remote := rng.Perm(nb)[:7], rng.Perm(nb)[:7]
		id, err := cons.a.MakeXfer(nixl.Read, cons.local, local, rdl, remote, msg)
		require.NoError(t, err)
		require.NoError(t, cons.a.PostXfer(id))
		pm.until(t, "a read", pm.done(id))
		require.NoError(t, pm.comps[id])
		for k := range local {
			require.True(t, bytes.Equal(cons.block(local[k]), prod.block(remote[k])), "read %d block %d", i, k)
		}
		require.NoError(t, cons.a.ReleaseXfer(id))
		pm.until(t, "its notification", func() bool { return len(pm.notifs[prod.a][cname]) > 0 })
		require.Equal(t, [][]byte{msg}, pm.notifs[prod.a][cname], "notification %d, %d bytes", i, len(msg))
		delete(pm.notifs[prod.a], cname)
		require.Equal(t, firstBuf, prod.a.ncap, "notification %d: the buffer kept the size a long record needed", i)
	}

	// WRITE, from the side with the long name.
	local, remote := rng.Perm(nb)[:5], rng.Perm(nb)[:5]
	id, err := prod.a.MakeXfer(nixl.Write, prod.local, local, cdl, remote, []byte{0})
	require.NoError(t, err)
	require.NoError(t, prod.a.PostXfer(id))
	pm.until(t, "a write", pm.done(id))
	require.NoError(t, pm.comps[id])
	for k := range local {
		require.True(t, bytes.Equal(prod.block(local[k]), cons.block(remote[k])), "write block %d", k)
	}
	require.NoError(t, prod.a.ReleaseXfer(id))
	pm.until(t, "the write's notification", func() bool { return len(pm.notifs[cons.a][pname]) > 0 })
	require.Equal(t, [][]byte{{0}}, pm.notifs[cons.a][pname])
	delete(pm.notifs[cons.a], pname)

	// Direct notifications arrive whole and in order.
	var want [][]byte
	for i := 0; i < 20; i++ {
		m := []byte(fmt.Sprintf("n%02d\x00\xfe", i))
		want = append(want, m)
		require.NoError(t, cons.a.SendNotif(pname, m))
	}
	pm.until(t, "20 notifications", func() bool { return len(pm.notifs[prod.a][cname]) == len(want) })
	require.Equal(t, want, pm.notifs[prod.a][cname])

	require.NoError(t, cons.a.ReleaseDlist(rdl))
	require.NoError(t, cons.a.InvalidateRemoteMetadata(pname))
	require.ErrorIs(t, cons.a.SendNotif(pname, []byte("x")), nixl.ErrNotFound)
	require.NoError(t, prod.a.InvalidateRemoteMetadata(cname))
}
