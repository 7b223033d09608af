package ucx

import (
	"fmt"
	"os"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
)

// TestLyingMetadata: metadata re-encoded with a valid checksum but regions
// larger than (or shifted off) the memory behind them is refused at
// LoadRemoteMetadata, both for UCX-allocated memory (checked against the
// segment mapped here) and for caller memory in a shared file (checked
// against the peer's own mappings). The truthful blob still loads.
func TestLyingMetadata(t *testing.T) {
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
		}
		got, err := cons.LoadRemoteMetadata(md)
		require.NoError(t, err, prod.Name())
		require.Equal(t, prod.Name(), got)
	}
}

// Both ways of finding a mapping (the PROCMAP_QUERY ioctl, and the maps
// text on kernels without it) agree on mappings this test makes: three
// pages with different protections (three mappings the kernel cannot
// merge with anything else), a file mapping with its path, an address
// nothing maps, and ranges that run past a mapping's end.
func TestProcMapsLookup(t *testing.T) {
	page := uint64(unix.Getpagesize())
	anon, err := unix.Mmap(-1, 0, int(3*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer unix.Munmap(anon)
	base := uint64(uintptr(unsafe.Pointer(&anon[0])))
	require.NoError(t, unix.Mprotect(anon[:page], unix.PROT_READ))
	require.NoError(t, unix.Mprotect(anon[page:2*page], unix.PROT_NONE))
	require.NoError(t, unix.Mprotect(anon[2*page:], unix.PROT_READ|unix.PROT_EXEC))
	path := t.TempDir() + "/mapped-file"
	require.NoError(t, os.WriteFile(path, make([]byte, 2*page), 0o600))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	file, err := unix.Mmap(int(f.Fd()), 0, int(2*page), unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(file)
	fbase := uint64(uintptr(unsafe.Pointer(&file[0])))

	for _, query := range []bool{true, false} {
		m, err := openMaps("self")
		require.NoError(t, err)
		m.query = query
		check := func(addr, n uint64, want *span) {
			t.Helper()
			got, err := m.within(addr, n)
			require.NoError(t, err)
			if want == nil {
				require.Nil(t, got, "query %v: [%#x,+%d)", query, addr, n)
				return
			}
			require.NotNil(t, got, "query %v: [%#x,+%d)", query, addr, n)
			require.Equal(t, *want, *got, "query %v", query)
		}
		first := &span{base, base + page, ""}
		check(base, page, first)
		check(base+8, 16, first)
		check(base, page+1, nil) // into the next mapping
		check(base+page, page, &span{base + page, base + 2*page, ""})
		check(base+2*page, page, &span{base + 2*page, base + 3*page, ""})
		check(base+page, 2*page, nil)
		check(0x1000, 1, nil) // below vm.mmap_min_addr: never mapped
		check(fbase, 2*page, &span{fbase, fbase + 2*page, path})
		check(fbase+page, page+1, nil) // past its end
		check(^uint64(0)-8, 16, nil)   // wraps
		if query && kernelAtLeast(6, 11) {
			require.True(t, m.query, "PROCMAP_QUERY refused on a kernel that has it")
		}
		m.close()
	}
}

// kernelAtLeast reports whether the running kernel is at least
// major.minor.
func kernelAtLeast(major, minor int) bool {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return false
	}
	var a, b int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &a, &b); err != nil {
		return false
	}
	return a > major || a == major && b >= minor
}
