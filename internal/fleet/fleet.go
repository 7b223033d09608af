// Package fleet measures ecxfer the way a deployment uses it: one consumer
// against many producer agents (Peers), and one producer serving many
// consumer processes (Consumers). Every party but the orchestrator is a
// real process: this binary re-executed in a child role (see Child), so a
// program that uses the package must call Child first thing in main (and
// a test binary in TestMain).
package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ecxfer/ecxfer/internal/ctrl"
)

// RoleEnv names the child role of a re-executed process.
const RoleEnv = "ECXFER_FLEET_ROLE"

// Child runs the child role named by RoleEnv, if any, and returns the
// process's exit code and true; without a role it returns (0, false).
func Child() (int, bool) {
	role := os.Getenv(RoleEnv)
	if role == "" {
		return 0, false
	}
	// A Ctrl-C at the terminal reaches the whole process group: the
	// parent stops its children (it closes their stdin), and a child that
	// died mid-setup could leave UCX's shared-memory files behind.
	signal.Ignore(os.Interrupt)
	c, err := ctrl.ChildConn()
	if err != nil {
		fmt.Fprintf(os.Stderr, "fleet %s (pid %d): %v\n", role, os.Getpid(), err)
		return 1, true
	}
	switch role {
	case "agents":
		err = agentsChild(c)
	case "producer":
		err = producerChild(c)
	case "consumer":
		err = consumerChild(c)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "fleet %s (pid %d): %v\n", role, os.Getpid(), err)
		return 1, true
	}
	return 0, true
}

// Proc is a started child.
type Proc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout io.Closer
	C      *ctrl.Conn
	exited chan struct{}
	err    error
}

// Spawn starts this executable in a child role. wrap, if not empty, is a
// command the child runs under (for example ip netns exec NS); env is
// added to this process's environment.
func Spawn(role string, wrap []string, env []string) (*Proc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	argv := append(append([]string(nil), wrap...), exe)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), env...), RoleEnv+"="+role)
	stdin, stdout, err := ctrl.StartPiped(cmd)
	if err != nil {
		return nil, err
	}
	p := &Proc{cmd: cmd, stdin: stdin, stdout: stdout, C: ctrl.New(stdout, stdin), exited: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// Stop closes the child's stdin, which tells it to clean up and exit, and
// waits; after timeout it kills it. Then it closes the child's stdout:
// until Stop, what the child wrote before it exited can still be read.
func (p *Proc) Stop(timeout time.Duration) error {
	defer func() { _ = p.stdout.Close() }()
	_ = p.stdin.Close()
	select {
	case <-p.exited:
		return p.err
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("fleet: child %d did not exit within %v", p.cmd.Process.Pid, timeout)
	}
}

// group is the children of one run. Once its context is done (the tool
// got SIGINT or SIGTERM) every child in it, and every child added later,
// is told to stop (its stdin closed) and, if still there after
// stopGrace, killed: the run's blocking reads from them then fail instead
// of the run going on to its end as if nothing had happened. (Killed at
// once, a child in the middle of UCX's setup left its shared-memory file
// in /dev/shm.)
type group struct {
	mu     sync.Mutex
	procs  []*Proc
	killed bool
}

// watch kills the group's children when ctx is done; the returned function
// ends the watch.
func (g *group) watch(ctx context.Context) (stop func()) {
	end := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			g.mu.Lock()
			g.killed = true
			procs := g.procs
			g.mu.Unlock()
			for _, p := range procs {
				p.halt()
			}
		case <-end:
		}
	}()
	return func() { close(end) }
}

func (g *group) add(p *Proc) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.procs = append(g.procs, p)
	if g.killed {
		p.halt()
	}
}

// stopGrace is how long a child told to stop may take before it is killed.
const stopGrace = 3 * time.Second

// halt tells p to stop and kills it if it has not within stopGrace.
func (p *Proc) halt() {
	_ = p.stdin.Close()
	go func() {
		select {
		case <-p.exited:
		case <-time.After(stopGrace):
			_ = p.cmd.Process.Kill()
		}
	}()
}

// stopAll stops every child (see Proc.Stop).
func (g *group) stopAll() {
	g.mu.Lock()
	procs := g.procs
	g.mu.Unlock()
	for _, p := range procs {
		_ = p.Stop(30 * time.Second)
	}
}

// interrupted returns ctx's error, naming what was cut short, when ctx is
// done, and err otherwise.
func interrupted(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("fleet: %s interrupted: %w", what, ctx.Err())
	}
	return err
}

// waitEOF blocks until the orchestrator closes the child's stdin.
func waitEOF(c *ctrl.Conn) error {
	m, err := c.Recv()
	switch {
	case errors.Is(err, io.EOF):
		return nil
	case err != nil:
		return err
	}
	return fmt.Errorf("unexpected %q", m.Kind)
}

// Mem is a process's memory as the kernel sees it.
type Mem struct {
	RSS        int64 // resident set
	SharedMaps int   // mappings of shared memory: System V, /dev/shm, memfd
	SharedSize int64 // their total size (mapped, not necessarily resident)
	FDs        int
	Goroutines int
}

// ReadMem reads this process's figures from /proc.
func ReadMem() Mem {
	var m Mem
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				m.RSS = kb << 10
			}
		}
	}
	if b, err := os.ReadFile("/proc/self/maps"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) < 6 {
				continue
			}
			path := strings.Join(f[5:], " ")
			if !(strings.Contains(path, "SYSV") || strings.HasPrefix(path, "/dev/shm/") || strings.HasPrefix(path, "/memfd:")) {
				continue
			}
			var lo, hi int64
			if _, err := fmt.Sscanf(f[0], "%x-%x", &lo, &hi); err == nil {
				m.SharedMaps++
				m.SharedSize += hi - lo
			}
		}
	}
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		m.FDs = len(ents)
	}
	m.Goroutines = runtime.NumGoroutine()
	return m
}

// quantile of sorted durations (nearest rank: the smallest value with at
// least q of the values at or below it).
func quantile(s []time.Duration, q float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(s)))) - 1
	i = max(0, min(len(s)-1, i))
	return s[i]
}

func sortDurations(s []time.Duration) {
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
}

// monoNow is CLOCK_MONOTONIC in ns: the same clock in every process of
// the machine, network namespaces included.
func monoNow() int64 {
	var ts unixTimespec
	clockMonotonic(&ts)
	return ts.Sec*1e9 + ts.Nsec
}
