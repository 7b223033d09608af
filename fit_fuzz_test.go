package ecxfer

import (
	"fmt"
	"math"
	"math/big"
	"os"
	"strings"
	"testing"
)

// procSeeds adds this machine's own copies of the files the fit checks
// parse to f's corpus, with a few hand-written variants.
func procSeeds(f *testing.F) {
	for _, p := range []string{"/proc/meminfo", "/proc/self/cgroup", "/proc/self/mountinfo", "/proc/sysvipc/shm"} {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte("0::/user.slice/a\n3:cpu,memory:/x\n"))
	f.Add([]byte("29 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n30 1 0:27 / /mnt/mem rw - cgroup cgroup rw,memory\n"))
	f.Add([]byte("key shmid perms size\n0 1 600 18446744073709551615\n"))
	f.Add([]byte("MemAvailable: 18446744073709551615 kB\n"))
}

// FuzzFitParsers feeds the parsers of /proc/meminfo, /proc/self/cgroup,
// /proc/self/mountinfo and /proc/sysvipc/shm (the fit checks New makes)
// arbitrary text: none panics, and what each returns is consistent with
// its input.
func FuzzFitParsers(f *testing.F) {
	procSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := parseSysVPages(b, 4096), sysvPagesRef(b, 4096); got != want {
			t.Fatalf("System V pages %d, want %d", got, want)
		}
		v, ok := parseMeminfo(b, "MemAvailable")
		if want, wantOK := meminfoRef(b, "MemAvailable"); v != want || ok != wantOK {
			t.Fatalf("MemAvailable %d %v, want %d %v", v, ok, want, wantOK)
		}
		v2, v1 := parseCgroupMounts(b)
		for _, m := range []string{v2, v1} {
			if m != "" && !strings.Contains(string(b), m) {
				t.Fatalf("mount %q not in the text", m)
			}
		}
		for _, d := range parseCgroupDirs(b, "/v2", "/v1") {
			ok := (strings.HasPrefix(d.dir, "/v2") && d.limit == "memory.max" && d.usage == "memory.current") ||
				(strings.HasPrefix(d.dir, "/v1") && d.limit == "memory.limit_in_bytes" && d.usage == "memory.usage_in_bytes")
			if !ok {
				t.Fatalf("cgroup dir %+v", d)
			}
		}
	})
}

// sysvPagesRef is parseSysVPages written another way: the size column
// of every line after the header, in big numbers, rounded up to pages;
// a sum past 64 bits is the largest uint64.
func sysvPagesRef(b []byte, page uint64) uint64 {
	total := new(big.Int)
	pg := new(big.Int).SetUint64(page)
	for i, line := range strings.Split(string(b), "\n") {
		fs := strings.Fields(line)
		if i == 0 || len(fs) < 4 {
			continue
		}
		n, ok := new(big.Int).SetString(fs[3], 10)
		if !ok || n.Sign() < 0 || n.BitLen() > 64 || strings.HasPrefix(fs[3], "+") {
			continue
		}
		q, r := new(big.Int).QuoRem(n, pg, new(big.Int))
		if r.Sign() != 0 {
			q.Add(q, big.NewInt(1))
		}
		total.Add(total, q)
	}
	if total.BitLen() > 64 {
		return math.MaxUint64
	}
	return total.Uint64()
}

// meminfoRef is parseMeminfo written another way: the first line whose
// text before its first colon is field; its first word a decimal number
// of at most 64 bits, times 1,024 if the second word is kB (and the
// product fits).
func meminfoRef(b []byte, field string) (uint64, bool) {
	for _, line := range strings.Split(string(b), "\n") {
		i := strings.IndexByte(line, ':')
		if i < 0 || line[:i] != field {
			continue
		}
		fs := strings.Fields(line[i+1:])
		if len(fs) == 0 {
			return 0, false
		}
		n, ok := new(big.Int).SetString(fs[0], 10)
		if !ok || n.Sign() < 0 || strings.HasPrefix(fs[0], "+") || strings.HasPrefix(fs[0], "-") {
			return 0, false
		}
		if len(fs) > 1 && fs[1] == "kB" {
			n.Lsh(n, 10)
		}
		if n.BitLen() > 64 {
			return 0, false
		}
		return n.Uint64(), true
	}
	return 0, false
}

// The parsers on known text: sizes, units and limits as the kernel
// writes them.
func TestFitParsers(t *testing.T) {
	mi := []byte("MemTotal:       24575616 kB\nMemAvailable:   20000000 kB\nHugePages_Total:       0\n")
	if v, ok := parseMeminfo(mi, "MemAvailable"); !ok || v != 20000000<<10 {
		t.Fatalf("MemAvailable %d %v", v, ok)
	}
	if v, ok := parseMeminfo(mi, "HugePages_Total"); !ok || v != 0 {
		t.Fatalf("HugePages_Total %d %v", v, ok)
	}
	if _, ok := parseMeminfo(mi, "Nope"); ok {
		t.Fatal("a missing field")
	}
	if _, ok := parseMeminfo([]byte(fmt.Sprintf("X: %d kB\n", uint64(math.MaxUint64)>>9)), "X"); ok {
		t.Fatal("kB beyond 64 bits of bytes")
	}
	shm := []byte("       key      shmid perms                  size  cpid  lpid nattch\n" +
		"         0          1   600                  4096   10    10      1\n" +
		"         0          2   600                  4097   10    10      1\n")
	if got := parseSysVPages(shm, 4096); got != 3 {
		t.Fatalf("sysv pages %d, want 3", got)
	}
	// Sizes whose pages add up past 64 bits: the sum saturates instead of
	// wrapping to a small number that would pass the fit check.
	huge := []byte("key shmid perms size\n0 1 600 18446744073709551615\n0 2 600 18446744073709551615\n")
	if got := parseSysVPages(huge, 1); got != math.MaxUint64 {
		t.Errorf("pages of two 2^64-1 byte segments: %d", got)
	}
	mounts := []byte("29 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n" +
		"30 1 0:27 /sub /elsewhere rw - cgroup2 cgroup2 rw\n" +
		"31 1 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
	v2, v1 := parseCgroupMounts(mounts)
	if v2 != "/sys/fs/cgroup" || v1 != "/sys/fs/cgroup/memory" {
		t.Fatalf("mounts %q %q", v2, v1)
	}
	dirs := parseCgroupDirs([]byte("0::/a/b\n"), v2, "")
	want := []string{"/sys/fs/cgroup/a/b", "/sys/fs/cgroup/a", "/sys/fs/cgroup"}
	if len(dirs) != len(want) {
		t.Fatalf("dirs %+v", dirs)
	}
	for i, d := range dirs {
		if d.dir != want[i] || d.limit != "memory.max" {
			t.Fatalf("dir %d: %+v, want %s", i, d, want[i])
		}
	}
}
