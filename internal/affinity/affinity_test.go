package affinity

import (
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestParseCPUList(t *testing.T) {
	cases := []struct {
		in   string
		want []int
		bad  bool
	}{
		{"0", []int{0}, false},
		{"0-3", []int{0, 1, 2, 3}, false},
		{"0-1,4,6-7", []int{0, 1, 4, 6, 7}, false},
		{"", nil, false},
		{"a", nil, true},
		{"3-1", nil, true},
		{"-1", nil, true},
		{"0-999999", nil, true},
		{"0-40000,0-40000", nil, true}, // more CPUs than any machine has
		{"1,", nil, true},
		{"1-", nil, true},
		{"+1", []int{1}, false}, // strconv's sign: harmless
	}
	for _, c := range cases {
		got, err := ParseCPUList(c.in)
		if c.bad {
			require.Error(t, err, c.in)
			continue
		}
		require.NoError(t, err, c.in)
		require.Equal(t, len(c.want), len(got), c.in)
		for i := range c.want {
			require.Equal(t, c.want[i], got[i])
		}
	}
}

// FuzzParseCPUList: any input either fails or gives CPUs that, written
// back one by one, parse to the same list, and never more than maxCPUList.
func FuzzParseCPUList(f *testing.F) {
	for _, s := range []string{"0", "0-3", "0-1,4,6-7", "", "3-1", "0-65536", "1,,2", "0-1-2"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := ParseCPUList(s)
		if err != nil {
			return
		}
		if len(got) > maxCPUList {
			t.Fatalf("%q: %d CPUs", s, len(got))
		}
		parts := make([]string, len(got))
		for i, c := range got {
			if c < 0 {
				t.Fatalf("%q: CPU %d", s, c)
			}
			parts[i] = strconv.Itoa(c)
		}
		again, err := ParseCPUList(strings.Join(parts, ","))
		if err != nil || len(again) != len(got) {
			t.Fatalf("%q gave %v; written back: %v, %v", s, got, again, err)
		}
		for i := range got {
			if again[i] != got[i] {
				t.Fatalf("%q gave %v; written back: %v", s, got, again)
			}
		}
	})
}

func TestPinThread(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var orig unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &orig))
	defer func() { _ = unix.SchedSetaffinity(0, &orig) }()

	allowed, err := Allowed()
	require.NoError(t, err)
	require.NotEmpty(t, allowed)
	last := allowed[len(allowed)-1]
	require.NoError(t, PinThread(last))
	now, err := ThreadCPUs()
	require.NoError(t, err)
	require.Equal(t, []int{last}, now)

	require.ErrorIs(t, PinThread(100000), ErrNoCPU)
	require.ErrorIs(t, PinThread(-1), ErrNoCPU)
}

func TestNodes(t *testing.T) {
	c, err := PickCPU(0)
	require.NoError(t, err)
	require.GreaterOrEqual(t, c, 0)
	_, err = NodeCPUs(4000)
	require.ErrorIs(t, err, ErrNoNode)
	_, err = PickCPU(-1)
	require.ErrorIs(t, err, ErrNoNode)
}

func TestBindMemory(t *testing.T) {
	buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	defer func() { _ = unix.Munmap(buf) }()
	require.NoError(t, BindMemory(buf, 0))
	buf[0], buf[len(buf)-1] = 1, 2 // pages are usable after binding
	require.ErrorIs(t, BindMemory(buf, 4000), ErrNoNode)
	require.ErrorIs(t, BindMemory(buf, -1), ErrNoNode)
	require.NoError(t, BindMemory(nil, 0))
}

// A buffer that does not start or end on a page boundary (a slice of a
// caller's mapping) binds the whole pages inside it, none of the pages it
// shares with what lies around it. (mbind refused it: EINVAL.)
func TestBindMemoryUnaligned(t *testing.T) {
	page := unix.Getpagesize()
	buf, err := unix.Mmap(-1, 0, 8*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	defer func() { _ = unix.Munmap(buf) }()
	require.NoError(t, BindMemory(buf[64:7*page-64], 0))
	for i, want := range []int{mpolDefault, mpolBind, mpolBind, mpolBind, mpolBind, mpolBind, mpolDefault, mpolDefault} {
		require.Equal(t, want, policyAt(t, &buf[i*page]), "page %d", i)
	}
	require.NoError(t, BindMemory(buf[10:20], 0), "no whole page inside: nothing to bind")
}

const mpolDefault = 0

// policyAt is the memory policy of the page at p (get_mempolicy with
// MPOL_F_ADDR).
func policyAt(t *testing.T, p *byte) int {
	t.Helper()
	var mode int32
	var mask [maxNodeBitsLen / 64]uint64
	_, _, e := unix.Syscall6(unix.SYS_GET_MEMPOLICY, uintptr(unsafe.Pointer(&mode)), uintptr(unsafe.Pointer(&mask[0])),
		maxNodeBitsLen, uintptr(unsafe.Pointer(p)), 2 /* MPOL_F_ADDR */, 0)
	require.Zero(t, e, "get_mempolicy")
	return int(mode)
}
