package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// machineInfo describes this host.
func machineInfo() Machine {
	m := Machine{Cores: runtime.NumCPU(), GoVersion: runtime.Version(), CPUModel: "unknown", UCXVersion: "unknown", Kernel: "unknown"}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:])
		m.Hostname = unix.ByteSliceToString(u.Nodename[:])
	}
	m.UCXVersion = ucxVersion()
	return m
}

// ucxVersion asks ucx_info, which comes with the same UCX build.
func ucxVersion() string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ucx_info", "-v").Output()
	if err != nil {
		return "unknown (ucx_info not found)"
	}
	for _, l := range bytes.Split(out, []byte("\n")) {
		s := strings.TrimSpace(strings.TrimPrefix(string(l), "#"))
		if v, ok := strings.CutPrefix(s, "Version "); ok {
			return v
		}
		if v, ok := strings.CutPrefix(s, "Library version: "); ok {
			return v
		}
	}
	return "unknown"
}

// monoNow is CLOCK_MONOTONIC in nanoseconds: the same clock in every
// process of this host.
func monoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// isTerminal reports whether fd is a terminal.
func isTerminal(fd uintptr) bool {
	_, err := unix.IoctlGetTermios(int(fd), unix.TCGETS)
	return err == nil
}

// cpuSample is the machine's busy CPU time and this process's (with its
// waited-for children) at one moment, in seconds.
type cpuSample struct{ busy, ours float64 }

// selfCPU is this process's CPU time so far (user and system), in
// seconds.
func selfCPU() float64 {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// selfCPUInts is what a producer's hello and bye tell the consumer of its
// process: its pid and CPU time so far in nanoseconds, so that a
// consumer on the same kernel (make bench-hosts: another network
// namespace) counts that CPU as the run's own, not as a disturbance.
func selfCPUInts() map[string]int64 {
	return map[string]int64{"pid": int64(unix.Getpid()), "cpu_ns": int64(selfCPU() * 1e9)}
}

// sampleCPU reads /proc/stat and getrusage. USER_HZ is 100 on Linux.
func sampleCPU() cpuSample {
	var s cpuSample
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line)
		// cpu user nice system idle iowait irq softirq steal ...
		for i, v := range f {
			if i == 0 || i == 4 || i == 5 || i > 8 {
				continue
			}
			var n float64
			fmt.Sscan(v, &n)
			s.busy += n / 100
		}
	}
	for _, who := range []int{unix.RUSAGE_SELF, unix.RUSAGE_CHILDREN} {
		var ru unix.Rusage
		if unix.Getrusage(who, &ru) == nil {
			s.ours += float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
		}
	}
	return s
}
