package loopback

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// TestMain checks for leaks: after the tests no agent may be registered
// and the process must hold as many file descriptors as before.
func TestMain(m *testing.M) {
	// Let the runtime open what it opens on first use (the network
	// poller, which timers also use).
	time.Sleep(time.Millisecond)
	if r, w, err := os.Pipe(); err == nil {
		r.Close()
		w.Close()
	}
	before := openFDs()
	code := m.Run()
	if code == 0 {
		if live := LiveAgents(); len(live) != 0 {
			fmt.Fprintf(os.Stderr, "leak: agents still registered: %q\n", live)
			code = 1
		}
		if after := openFDs(); after != before {
			fmt.Fprintf(os.Stderr, "leak: %d file descriptors open before the tests, %d after\n", before, after)
			ents, _ := os.ReadDir("/proc/self/fd")
			for _, e := range ents {
				l, _ := os.Readlink("/proc/self/fd/" + e.Name())
				fmt.Fprintln(os.Stderr, e.Name(), l)
			}
			code = 1
		}
	}
	os.Exit(code)
}

func openFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		panic(err)
	}
	return len(ents)
}

// newAgent creates an agent that is closed when the test ends.
func newAgent(t testing.TB, name string, opts ...Option) *Agent {
	t.Helper()
	a, err := New(name, opts...)
	if err != nil {
		t.Fatalf("New(%q): %v", name, err)
	}
	t.Cleanup(func() {
		if err := a.Close(); err != nil {
			t.Errorf("Close(%q): %v", name, err)
		}
	})
	return a
}

func mustIs(t testing.TB, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("error %v, want %v", err, target)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// side is one agent with a region cut into blocks and a local list over it.
type side struct {
	a      *Agent
	mem    nixl.MemID
	buf    []byte
	descs  descriptors.List
	dlocal nixl.DlistID
}

const (
	blockSize = 512
	numBlocks = 16
)

func newSide(t testing.TB, name string, opts ...Option) *side {
	t.Helper()
	a := newAgent(t, name, opts...)
	mem, buf, err := a.AllocMem(blockSize*numBlocks, nixl.DRAM, 0)
	must(t, err)
	s := &side{a: a, mem: mem, buf: buf, descs: descriptors.BuildBlockDescs(nixl.Addr(buf), numBlocks, blockSize, 0)}
	s.dlocal, err = a.PrepDlist("", s.descs, nixl.DRAM)
	must(t, err)
	return s
}

// link loads to's metadata into from and prepares a list over to's blocks.
func link(t testing.TB, from, to *side) nixl.DlistID {
	t.Helper()
	md, err := to.a.LocalMetadata()
	must(t, err)
	name, err := from.a.LoadRemoteMetadata(md)
	must(t, err)
	if name != to.a.Name() {
		t.Fatalf("loaded name %q, want %q", name, to.a.Name())
	}
	d, err := from.a.PrepDlist(name, to.descs, nixl.DRAM)
	must(t, err)
	return d
}

func fill(rng *rand.Rand, b []byte) {
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
}

func block(b []byte, i int) []byte { return b[i*blockSize : (i+1)*blockSize] }

// waitDone progresses a until the request finishes and returns its error.
func waitDone(t testing.TB, a *Agent, id nixl.XferID) error {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := a.Progress(); err != nil {
			t.Fatalf("Progress: %v", err)
		}
		done, err := a.XferStatus(id)
		if done {
			return err
		}
		if err != nil {
			t.Fatalf("XferStatus(%d): %v", id, err)
		}
	}
	t.Fatalf("request %d did not finish", id)
	return nil
}

// drainCompletions polls a until it reports nothing more.
func drainCompletions(a *Agent) []nixl.Completion {
	var out []nixl.Completion
	buf := make([]nixl.Completion, 4)
	for {
		n := a.PollCompletions(buf)
		if n == 0 {
			return out
		}
		out = append(out, buf[:n]...)
	}
}

func notifs(a *Agent) map[string][][]byte {
	m := map[string][][]byte{}
	a.GetNotifs(m)
	return m
}

func sameBytes(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		t.Fatalf("%s: bytes differ", what)
	}
}
