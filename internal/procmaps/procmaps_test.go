package procmaps

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Both ways of looking mappings up (PROCMAP_QUERY and the text) agree on
// three anonymous pages with different protections (three mappings the
// kernel cannot merge with anything else), a file mapped at an offset with
// its path, device, inode and offset, an address nothing maps, and ranges
// that run past a mapping's end.
func TestLookup(t *testing.T) {
	page := uint64(unix.Getpagesize())
	anon, err := unix.Mmap(-1, 0, int(3*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer unix.Munmap(anon)
	base := uint64(uintptr(unsafe.Pointer(&anon[0])))
	require.NoError(t, unix.Mprotect(anon[:page], unix.PROT_READ))
	require.NoError(t, unix.Mprotect(anon[page:2*page], unix.PROT_NONE))
	require.NoError(t, unix.Mprotect(anon[2*page:], unix.PROT_READ|unix.PROT_EXEC))
	path := t.TempDir() + "/mapped-file"
	require.NoError(t, os.WriteFile(path, make([]byte, 3*page), 0o600))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(int(f.Fd()), &st))
	file, err := unix.Mmap(int(f.Fd()), int64(page), int(2*page), unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(file)
	fbase := uint64(uintptr(unsafe.Pointer(&file[0])))

	for _, query := range []bool{true, false} {
		m, err := Open("self")
		require.NoError(t, err)
		m.query = query
		check := func(addr, n uint64, want *Span) {
			t.Helper()
			got, err := m.Within(addr, n)
			require.NoError(t, err)
			if want == nil {
				require.Nil(t, got, "query %v: [%#x,+%d)", query, addr, n)
				return
			}
			require.NotNil(t, got, "query %v: [%#x,+%d)", query, addr, n)
			got.Offset = want.Offset // an anonymous mapping's offset is the kernel's business
			require.Equal(t, *want, *got, "query %v", query)
		}
		first := &Span{Start: base, End: base + page}
		check(base, page, first)
		check(base+8, 16, first)
		check(base, page+1, nil) // into the next mapping
		check(base+page, page, &Span{Start: base + page, End: base + 2*page})
		check(base+2*page, page, &Span{Start: base + 2*page, End: base + 3*page})
		check(base+page, 2*page, nil)
		check(0x1000, 1, nil) // below vm.mmap_min_addr: never mapped
		sp, err := m.At(fbase + page)
		require.NoError(t, err)
		require.Equal(t, Span{Start: fbase, End: fbase + 2*page, Offset: page, Dev: st.Dev, Ino: st.Ino, Name: path}, *sp, "query %v", query)
		check(fbase+page, page+1, nil) // past its end
		check(^uint64(0)-8, 16, nil)   // wraps
		if query && kernelAtLeast(6, 11) {
			require.True(t, m.query, "PROCMAP_QUERY refused on a kernel that has it")
		}
		m.Close()
	}
}

// Another process's mappings, by pid, as the direct path reads a
// producer's.
func TestOtherProcess(t *testing.T) {
	m, err := Open(strconv.Itoa(os.Getppid()))
	if err != nil {
		t.Skipf("parent's maps not readable here: %v", err)
	}
	defer m.Close()
	_, err = m.At(0x1000)
	require.NoError(t, err)
	_, err = Open("999999999")
	require.Error(t, err)
}

// The text parser skips lines it cannot read instead of inventing spans.
func TestParseHostile(t *testing.T) {
	text := "" +
		"00400000-00401000 r-xp 00000000 08:01 1234 /bin/x\n" +
		"zz-00402000 r-xp 00000000 08:01 1 /bad/start\n" +
		"00403000-00402000 r-xp 00000000 08:01 1 /end/before/start\n" +
		"00404000-00405000 r-xp 00000000 0801 1 /no/colon\n" +
		"00405000-00406000 r-xp 00000000 08:01\n" +
		"00406000-00407000 rw-p 00001000 00:00 0\n" +
		"\n"
	spans, err := parse(bytes.NewBufferString(text))
	require.NoError(t, err)
	require.Equal(t, []Span{
		{Start: 0x400000, End: 0x401000, Dev: unix.Mkdev(8, 1), Ino: 1234, Name: "/bin/x"},
		{Start: 0x406000, End: 0x407000, Offset: 0x1000, Writable: true},
	}, spans)
}

// Writable walks the mappings over a range: true only when every byte of
// it is mapped writable, else the first address that is not; both ways
// of asking the kernel agree.
func TestWritable(t *testing.T) {
	page := uint64(unix.Getpagesize())
	m5, err := unix.Mmap(-1, 0, int(5*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer unix.Munmap(m5)
	require.NoError(t, unix.Mprotect(m5[4*page:], unix.PROT_NONE)) // a guard after the four pages
	m4 := m5[:4*page]
	base := uint64(uintptr(unsafe.Pointer(&m4[0])))
	// Pages 0-1 and 2-3 in two mappings of different kinds, still writable.
	require.NoError(t, unix.Madvise(m4[2*page:], unix.MADV_DONTFORK))
	for _, query := range []bool{true, false} {
		m, err := Open("self")
		require.NoError(t, err)
		m.query = query
		ok, _, err := m.Writable(base, 4*page)
		require.NoError(t, err)
		require.True(t, ok, "query %v", query)
		ok, at, err := m.Writable(base, 5*page) // into the guard
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, base+4*page, at, "query %v", query)
		ok, _, _ = m.Writable(0x1000, 1)
		require.False(t, ok, "the first pages are never mapped")
		m.Close()
	}
	require.NoError(t, unix.Mprotect(m4[page:2*page], unix.PROT_READ))
	for _, query := range []bool{true, false} {
		m, err := Open("self")
		require.NoError(t, err)
		m.query = query
		ok, at, err := m.Writable(base, 4*page)
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, base+page, at, "query %v: the read-only page", query)
		m.Close()
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

// The text parser on anything: no panic, spans sorted and non-empty.
func FuzzParse(f *testing.F) {
	f.Add([]byte("00400000-00401000 r-xp 00000000 08:01 1234 /bin/x\n7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]\n"))
	f.Add([]byte("ffffffffffffffff-0 ---p 0 0:0 0\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		spans, err := parse(bytes.NewReader(b))
		if err != nil {
			return
		}
		for i, sp := range spans {
			if sp.End <= sp.Start || i > 0 && spans[i-1].Start > sp.Start {
				t.Fatalf("span %d: %+v", i, sp)
			}
		}
	})
}
