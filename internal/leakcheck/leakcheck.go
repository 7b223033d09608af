// Package leakcheck verifies that a test gave back what it took: goroutines
// and file descriptors return to their baseline.
//
// Transports own threads, epoll sets, eventfds and engine sockets. A test
// that forgets one passes today and exhausts the process next week, so every
// test that creates a transport takes a baseline first and checks it at the
// end.
package leakcheck

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"time"
)

// TB is the part of testing.TB the checks use.
type TB interface {
	Helper()
	Errorf(format string, args ...any)
	Cleanup(func())
}

// Snapshot is a baseline of goroutines and open file descriptors.
type Snapshot struct {
	goroutines map[string]bool // IDs of the goroutines alive at Take
	fds        map[string]string
}

// Take records the goroutines alive now and the open descriptors.
func Take() Snapshot {
	base := map[string]bool{}
	for _, g := range goroutines() {
		base[g.id] = true
	}
	return Snapshot{goroutines: base, fds: openFDs()}
}

// Check registers a cleanup that fails t unless goroutines and descriptors
// return to the baseline taken now (within a grace period for goroutines
// and threads that are still winding down).
func Check(t TB) {
	t.Helper()
	base := Take()
	t.Cleanup(func() {
		t.Helper()
		if err := base.Wait(5 * time.Second); err != nil {
			t.Errorf("leakcheck: %v", err)
		}
	})
}

// Wait polls until every goroutine started since the baseline has exited
// and no descriptor opened since the baseline is still open, or the timeout
// passes; it reports what is left over. Goroutines are told apart by ID,
// not counted: a baseline goroutine that exits meanwhile cannot hide a new
// one.
func (s Snapshot) Wait(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := s.compare()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s Snapshot) compare() error {
	var problems []string
	var leaked []string
	for _, g := range goroutines() {
		if !s.goroutines[g.id] {
			leaked = append(leaked, g.stack)
		}
	}
	if len(leaked) > 0 {
		problems = append(problems, fmt.Sprintf("%d goroutines started since the baseline are still running:\n%s",
			len(leaked), strings.Join(leaked, "\n\n")))
	}
	var extra []string
	for fd, target := range openFDs() {
		if old, ok := s.fds[fd]; !ok || old != target {
			extra = append(extra, fd+" -> "+target)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		problems = append(problems, "descriptors left open: "+strings.Join(extra, ", "))
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%s", strings.Join(problems, "; "))
}

// goroutine is one goroutine of a stack dump: its ID and its whole record.
type goroutine struct {
	id, stack string
}

// goroutines lists every goroutine runtime.Stack reports, the caller's own
// included.
func goroutines() []goroutine {
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf)) // the dump was cut short
	}
	var out []goroutine
	for _, rec := range strings.Split(string(buf), "\n\n") {
		// A record starts "goroutine 42 [running]:".
		rest, ok := strings.CutPrefix(rec, "goroutine ")
		if !ok {
			continue
		}
		id, _, ok := strings.Cut(rest, " ")
		if !ok {
			continue
		}
		out = append(out, goroutine{id: id, stack: rec})
	}
	return out
}

// FDCount returns the number of open descriptors of the process.
func FDCount() int { return len(openFDs()) }

func openFDs() map[string]string {
	ents, err := os.ReadDir("/proc/self/fd")
	out := make(map[string]string, len(ents))
	if err != nil {
		return out
	}
	for _, e := range ents {
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil {
			continue // the descriptor ReadDir itself used, now closed
		}
		out[e.Name()] = target
	}
	return out
}
