package ecxfer

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// An engine-allocated region is real memory (a shared-memory segment the
// engine touches page by page): one that cannot fit gets the process, or
// its neighbours, killed by the OOM killer and can leave a file behind in
// /dev/shm. New refuses it before anything is allocated, checking it
// against what the machine can give now: MemAvailable, the memory cgroup's
// limit (v2 and v1, every level up to the root) and, when the region is
// beyond what System V shared memory allows (kernel.shmmax, shmall), free
// space in /dev/shm, each less a margin: UCX allocates System V segments
// first and falls back to a /dev/shm file. A limit that cannot be read is
// not checked; what can be read is.

// fitMargin is what must stay free besides the region: 64 MiB or 1/16 of
// the region, whichever is more.
func fitMargin(size uint64) uint64 { return max(64<<20, size/16) }

// memLimit is one bound on how much memory a new region may take.
type memLimit struct {
	what  string
	avail uint64
}

// checkRegionFits returns ErrConfig when size bytes (plus the margin) do not
// fit under every limit it can read.
func checkRegionFits(size uint64, shm bool) error {
	need := size + fitMargin(size)
	limits := memLimits()
	if shm && !fitsSysV(size) {
		if free, ok := shmFree(shmDir); ok {
			limits = append(limits, memLimit{"free space in " + shmDir, free})
		}
	}
	for _, l := range limits {
		if need > l.avail {
			return fmt.Errorf("%w: a region of %d bytes does not fit: %s is %d bytes (the region needs %d with a margin)",
				ErrConfig, size, l.what, l.avail, need)
		}
	}
	return nil
}

// fitsSysV reports whether one System V segment of size bytes is within
// this IPC namespace's limits (kernel.shmmax, and kernel.shmall in pages
// for all segments together, those already there included).
func fitsSysV(size uint64) bool {
	shmmax, ok1 := readUint("/proc/sys/kernel/shmmax")
	shmall, ok2 := readUint("/proc/sys/kernel/shmall")
	if !ok1 || !ok2 || size > shmmax {
		return false
	}
	page := uint64(os.Getpagesize())
	pages := (size + page - 1) / page
	return pages <= shmall && pages+sysVPagesInUse(page) <= shmall
}

// sysVPagesInUse sums the sizes of the System V segments that exist now,
// in pages (0 if they cannot be read).
func sysVPagesInUse(page uint64) uint64 {
	b, err := os.ReadFile("/proc/sysvipc/shm")
	if err != nil {
		return 0
	}
	return parseSysVPages(b, page)
}

// parseSysVPages sums, in pages of page bytes, the sizes in the fourth
// column of /proc/sysvipc/shm's text b (its first line is the header).
func parseSysVPages(b []byte, page uint64) uint64 {
	if page == 0 {
		return 0
	}
	var total uint64
	for i, line := range strings.Split(string(b), "\n") {
		fs := strings.Fields(line)
		if i == 0 || len(fs) < 4 {
			continue // the header
		}
		if n, err := strconv.ParseUint(fs[3], 10, 64); err == nil {
			pages := n/page + min(n%page, 1)
			if total+pages < total {
				return math.MaxUint64 // more than anything fits in
			}
			total += pages
		}
	}
	return total
}

// shmDir is where shared-memory segments live; a variable for tests.
var shmDir = "/dev/shm"

func shmFree(dir string) (uint64, bool) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, false
	}
	return st.Bavail * uint64(st.Bsize), true
}

func memLimits() []memLimit {
	var out []memLimit
	if v, ok := meminfo("MemAvailable"); ok {
		out = append(out, memLimit{"MemAvailable", v})
	}
	for _, cg := range cgroupDirs() {
		limit, ok1 := readUint(filepath.Join(cg.dir, cg.limit))
		usage, ok2 := readUint(filepath.Join(cg.dir, cg.usage))
		if !ok1 || !ok2 {
			continue
		}
		avail := uint64(0)
		if limit > usage {
			avail = limit - usage
		}
		out = append(out, memLimit{"the memory left under cgroup limit " + filepath.Join(cg.dir, cg.limit), avail})
	}
	return out
}

// meminfo returns a /proc/meminfo field in bytes.
func meminfo(field string) (uint64, bool) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	return parseMeminfo(b, field)
}

// parseMeminfo finds field in /proc/meminfo's text b ("Name:   123 kB")
// and returns it in bytes; false when it is missing, not a number, or
// too large for bytes in 64 bits.
func parseMeminfo(b []byte, field string) (uint64, bool) {
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || k != field {
			continue
		}
		fs := strings.Fields(v)
		if len(fs) == 0 {
			return 0, false
		}
		n, err := strconv.ParseUint(fs[0], 10, 64)
		if err != nil {
			return 0, false
		}
		if len(fs) > 1 && fs[1] == "kB" {
			if n > math.MaxUint64>>10 {
				return 0, false
			}
			n <<= 10
		}
		return n, true
	}
	return 0, false
}

// readUint reads a cgroup file holding one number ("max": no limit).
func readUint(path string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return n, err == nil
}

type cgroupDir struct {
	dir, limit, usage string
}

// cgroupDirs lists this process's memory cgroup and each of its ancestors
// inside the mounted hierarchy, v2 ("0::/path", memory.max and
// memory.current) and v1 ("N:...memory...:/path", memory.limit_in_bytes
// and memory.usage_in_bytes). A limit set on any level applies.
func cgroupDirs() []cgroupDir {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	v2, v1 := parseCgroupMounts(mi)
	return parseCgroupDirs(b, v2, v1)
}

// parseCgroupDirs reads /proc/self/cgroup's text b against the cgroup2
// mount v2 and the v1 memory controller's mount v1 ("" for none).
func parseCgroupDirs(b []byte, v2, v1 string) []cgroupDir {
	var out []cgroupDir
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		var mnt, limit, usage string
		switch {
		case parts[0] == "0" && parts[1] == "" && v2 != "":
			mnt, limit, usage = v2, "memory.max", "memory.current"
		case v1 != "" && hasController(parts[1], "memory"):
			mnt, limit, usage = v1, "memory.limit_in_bytes", "memory.usage_in_bytes"
		default:
			continue
		}
		for p := filepath.Clean("/" + parts[2]); ; p = filepath.Dir(p) {
			out = append(out, cgroupDir{filepath.Join(mnt, p), limit, usage})
			if p == "/" {
				break
			}
		}
	}
	return out
}

func hasController(list, name string) bool {
	for _, c := range strings.Split(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}

// parseCgroupMounts finds the cgroup2 mount and the v1 memory
// controller's mount in /proc/self/mountinfo's text b.
func parseCgroupMounts(b []byte) (v2, v1mem string) {
	for _, line := range strings.Split(string(b), "\n") {
		// id parent major:minor root mountpoint options [optional...] - fstype source superoptions
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		fs, ps := strings.Fields(pre), strings.Fields(post)
		if len(fs) < 5 || len(ps) < 1 || fs[3] != "/" {
			continue // only mounts of a hierarchy's root map paths one to one
		}
		switch {
		case ps[0] == "cgroup2" && v2 == "":
			v2 = fs[4]
		case ps[0] == "cgroup" && len(ps) >= 3 && v1mem == "" && hasController(ps[2], "memory"):
			v1mem = fs[4]
		}
	}
	return v2, v1mem
}
