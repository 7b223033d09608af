package ucx

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// localHost returns this process's host identity.
func localHost() (hostID, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return hostID{}, err
	}
	var h hostID
	h.Boot = strings.TrimSpace(string(boot))
	if len(h.Boot) > maxBootLen {
		h.Boot = h.Boot[:maxBootLen]
	}
	if h.NetNS, err = nsInode("/proc/self/ns/net"); err != nil {
		return hostID{}, err
	}
	if h.PidNS, err = nsInode("/proc/self/ns/pid"); err != nil {
		return hostID{}, err
	}
	return h, nil
}

func nsInode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Ino, nil
}

// procStart returns the start time (field 22 of /proc/<pid>/stat, clock
// ticks after boot) of pid; with the pid it names one process for the
// lifetime of the boot, which a recycled pid cannot fake.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may contain spaces and parentheses; the
	// fields after it follow the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no ')'", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); field 22 is f[19].
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	return strconv.ParseUint(f[19], 10, 64)
}
