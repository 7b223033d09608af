// Package procinfo reads the identity of processes and of the host they run
// on from /proc: a process's start time, the kernel's boot id and the
// namespaces a process sees. Together they tell whether two processes share
// one kernel (and can reach each other's memory), and a pid together with
// its start time names one process for the lifetime of a boot, which a
// recycled pid cannot fake.
package procinfo

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrStat reports a /proc/<pid>/stat line that does not have the shape the
// kernel writes.
var ErrStat = errors.New("procinfo: malformed stat line")

// StartTime returns the start time of process pid: field 22 of
// /proc/<pid>/stat, in clock ticks after boot.
func StartTime(pid int) (uint64, error) {
	if pid <= 0 {
		return 0, fmt.Errorf("procinfo: pid %d: %w", pid, os.ErrNotExist)
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, fmt.Errorf("procinfo: %w", err)
	}
	start, err := ParseStartTime(b)
	if err != nil {
		return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return start, nil
}

// ParseStartTime returns field 22 (starttime) of a /proc/<pid>/stat line.
func ParseStartTime(stat []byte) (uint64, error) {
	// The command name (field 2) may hold spaces and parentheses; the
	// fields after it follow the last ')'.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("%w: no ')'", ErrStat)
	}
	f := strings.Fields(string(stat[i+1:]))
	// f[0] is field 3 (state), so field 22 is f[19].
	if len(f) < 20 {
		return 0, fmt.Errorf("%w: %d fields after the command", ErrStat, len(f))
	}
	v, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: starttime %q", ErrStat, f[19])
	}
	return v, nil
}

// BootID returns the kernel's boot id (/proc/sys/kernel/random/boot_id),
// cut to at most max bytes.
func BootID(max int) (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("procinfo: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if len(id) > max {
		id = id[:max]
	}
	return id, nil
}

// NSInode returns the inode of this process's namespace of the given kind
// ("net", "pid", "mnt", ...): equal inodes are one namespace.
func NSInode(kind string) (uint64, error) {
	if kind == "" || strings.ContainsAny(kind, "/.") {
		return 0, fmt.Errorf("procinfo: namespace kind %q: %w", kind, os.ErrInvalid)
	}
	var st unix.Stat_t
	path := "/proc/self/ns/" + kind
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("procinfo: stat %s: %w", path, err)
	}
	return st.Ino, nil
}
