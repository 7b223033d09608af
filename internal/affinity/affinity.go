// Package affinity pins threads to CPUs and memory to NUMA nodes.
//
// The reactor is one OS thread that should stay on one CPU, near the memory
// it moves, so its caches stay warm and it never migrates mid-burst. This
// package is the small amount of Linux plumbing that takes: sched_setaffinity
// for the thread, the sysfs node topology to choose a CPU, and mbind for a
// region's pages.
package affinity

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrNoNode is returned for a NUMA node the machine does not have.
var ErrNoNode = errors.New("affinity: no such NUMA node")

// ErrNoCPU is returned for a CPU the process may not run on.
var ErrNoCPU = errors.New("affinity: CPU not available")

// sysNode is where the kernel describes NUMA nodes; a variable for tests.
var sysNode = "/sys/devices/system/node"

// Allowed returns the CPUs the calling thread may run on.
func Allowed() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("affinity: sched_getaffinity: %w", err)
	}
	var cpus []int
	for c := 0; c < len(set)*64; c++ {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

// PinThread restricts the calling OS thread to cpu. The caller must have
// locked its goroutine to the thread (runtime.LockOSThread).
func PinThread(cpu int) error {
	allowed, err := Allowed()
	if err != nil {
		return err
	}
	if !slices.Contains(allowed, cpu) {
		return fmt.Errorf("%w: CPU %d (allowed: %v)", ErrNoCPU, cpu, allowed)
	}
	var set unix.CPUSet
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("affinity: sched_setaffinity(%d): %w", cpu, err)
	}
	return nil
}

// ThreadCPUs returns the CPUs the calling thread is restricted to.
func ThreadCPUs() ([]int, error) { return Allowed() }

// NodeCPUs returns the CPUs of NUMA node n, as the kernel lists them. A
// machine without NUMA information has one node, 0, holding every allowed
// CPU.
func NodeCPUs(n int) ([]int, error) {
	if n < 0 {
		return nil, fmt.Errorf("%w: %d", ErrNoNode, n)
	}
	b, err := os.ReadFile(fmt.Sprintf("%s/node%d/cpulist", sysNode, n))
	if err != nil {
		if os.IsNotExist(err) {
			if _, serr := os.Stat(sysNode); os.IsNotExist(serr) && n == 0 {
				return Allowed()
			}
			return nil, fmt.Errorf("%w: %d", ErrNoNode, n)
		}
		return nil, fmt.Errorf("affinity: %w", err)
	}
	return ParseCPUList(strings.TrimSpace(string(b)))
}

// PickCPU returns the first CPU of node n that the calling thread may run
// on.
func PickCPU(node int) (int, error) {
	cpus, err := NodeCPUs(node)
	if err != nil {
		return -1, err
	}
	allowed, err := Allowed()
	if err != nil {
		return -1, err
	}
	for _, c := range cpus {
		if slices.Contains(allowed, c) {
			return c, nil
		}
	}
	return -1, fmt.Errorf("%w: node %d has none of the allowed CPUs %v", ErrNoCPU, node, allowed)
}

// maxCPUList bounds how many CPUs a list may name (Linux's NR_CPUS is at
// most 8,192): a short hostile list of wide ranges cannot make a huge
// slice.
const maxCPUList = 1 << 16

// ParseCPUList parses the kernel's list format ("0-3,8,10-11").
func ParseCPUList(s string) ([]int, error) {
	var out []int
	if s == "" {
		return out, nil
	}
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 {
			return nil, fmt.Errorf("affinity: bad CPU list %q", s)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a || b-a > maxCPUList {
				return nil, fmt.Errorf("affinity: bad CPU list %q", s)
			}
		}
		if len(out)+(b-a+1) > maxCPUList {
			return nil, fmt.Errorf("affinity: CPU list %.40q names more than %d CPUs", s, maxCPUList)
		}
		for c := a; c <= b; c++ {
			out = append(out, c)
		}
	}
	return out, nil
}

const (
	mpolBind       = 2
	mpolMfMove     = 1 << 1
	maxNodeBitsLen = 1024
)

// BindMemory asks the kernel to place buf's pages on NUMA node n (mbind
// with MPOL_BIND, moving pages already touched): the whole pages inside
// buf, so that a buf that does not start or end on a page boundary (a
// slice of a caller's mapping) binds none of its neighbours' bytes. The
// pages it shares with them at either end are left as they are.
func BindMemory(buf []byte, n int) error {
	if n < 0 || n >= maxNodeBitsLen {
		return fmt.Errorf("%w: %d", ErrNoNode, n)
	}
	if _, err := NodeCPUs(n); err != nil {
		return err
	}
	page := uintptr(unix.Getpagesize())
	if len(buf) == 0 {
		return nil
	}
	start := uintptr(unsafe.Pointer(&buf[0]))
	lo := (start + page - 1) &^ (page - 1)
	hi := (start + uintptr(len(buf))) &^ (page - 1)
	if hi <= lo {
		return nil // no whole page inside
	}
	var mask [maxNodeBitsLen / 64]uint64
	mask[n/64] |= 1 << (n % 64)
	_, _, e := unix.Syscall6(unix.SYS_MBIND, lo, hi-lo,
		mpolBind, uintptr(unsafe.Pointer(&mask[0])), maxNodeBitsLen, mpolMfMove)
	if e != 0 {
		return fmt.Errorf("affinity: mbind node %d: %w", n, e)
	}
	return nil
}
