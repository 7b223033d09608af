package ecxfer

import (
	"fmt"
	"math"
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
		_ = parseSysVPages(b, 4096)
		if parseSysVPages(b, 0) != 0 {
			t.Fatal("pages of 0 bytes")
		}
		if v, ok := parseMeminfo(b, "MemAvailable"); ok && !strings.Contains(string(b), "MemAvailable:") {
			t.Fatalf("MemAvailable %d from text without it", v)
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
		if len(parseCgroupDirs(b, "", "")) != 0 {
			t.Fatal("cgroup dirs without a mounted hierarchy")
		}
	})
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
