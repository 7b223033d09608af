package procmem

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

const childEnv = "PROCMEM_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "serve" {
		serve()
		return
	}
	os.Exit(m.Run())
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed ^ byte(i*13) ^ byte(i>>9)
	}
	return b
}

// serve maps anonymous memory, fills it and prints its address, then waits
// to be killed.
func serve() {
	// A PROT_NONE guard page after the 4 MiB, so a read past the end
	// faults whatever the kernel maps next to it.
	all, err := unix.Mmap(-1, 0, 4<<20+4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		fmt.Println("mmap:", err)
		os.Exit(2)
	}
	if err := unix.Mprotect(all[4<<20:], unix.PROT_NONE); err != nil {
		fmt.Println("mprotect:", err)
		os.Exit(2)
	}
	mem := all[:4<<20]
	copy(mem, pattern(len(mem), 0x5a))
	fmt.Printf("%d\n", uintptr(unsafe.Pointer(&mem[0])))
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	os.Exit(0)
}

func startChild(t *testing.T) (*exec.Cmd, uint64) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=serve")
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stdin.Close(); _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	addr, err := strconv.ParseUint(strings.TrimSpace(line), 10, 64)
	if err != nil {
		t.Fatalf("child said %q", line)
	}
	return cmd, addr
}

func TestReadOtherProcess(t *testing.T) {
	cmd, addr := startChild(t)
	want := pattern(4<<20, 0x5a)
	pid := cmd.Process.Pid

	dst := make([]byte, 32<<10)
	if err := Copy(pid, dst, addr+12345); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, want[12345:12345+len(dst)]) {
		t.Fatal("single copy differs")
	}

	// A scattered batch larger than one call's iovec limit.
	r := NewReader(pid)
	const n, bs = 2500, 1000
	got := make([]byte, n*bs)
	for i := range n {
		src := (i * 7919) % (len(want)/bs - 1)
		r.Add(got[i*bs:(i+1)*bs], addr+uint64(src*bs))
	}
	if err := r.Read(); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		src := (i * 7919) % (len(want)/bs - 1)
		if !bytes.Equal(got[i*bs:(i+1)*bs], want[src*bs:(src+1)*bs]) {
			t.Fatalf("block %d differs", i)
		}
	}

	// Unmapped remote memory fails cleanly.
	if err := Copy(pid, dst, addr+uint64(len(want))-100); !errors.Is(err, ErrFault) {
		t.Fatalf("read past the mapping: %v, want ErrFault", err)
	}
	if err := Copy(pid, dst, 8); !errors.Is(err, ErrFault) {
		t.Fatalf("read of page 0: %v, want ErrFault", err)
	}

	// A dead process: ESRCH, never a hang.
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if err := Copy(pid, dst, addr); !errors.Is(err, ErrGone) {
		t.Fatalf("read from a dead process: %v, want ErrGone", err)
	}
}

func TestAdvance(t *testing.T) {
	a, b := make([]byte, 10), make([]byte, 20)
	var r Reader
	r.Add(a, 100)
	r.Add(b, 200)
	if i := advance(r.local, 0, 15); i != 1 || r.local[1].Len != 15 {
		t.Fatalf("advance 15: %d, len %d", i, r.local[1].Len)
	}
	if i := advanceRemote(r.remote, 0, 15); i != 1 || r.remote[1].Len != 15 || r.remote[1].Base != 205 {
		t.Fatalf("advanceRemote 15: %d, %+v", i, r.remote[1])
	}
	if i := advance(r.local, 1, 15); i != 2 {
		t.Fatalf("advance to the end: %d", i)
	}
}

func TestReadSelfAllocs(t *testing.T) {
	src := pattern(1<<20, 1)
	dst := make([]byte, len(src))
	r := NewReader(os.Getpid())
	allocs := testing.AllocsPerRun(100, func() {
		for i := 0; i < 16; i++ {
			r.Add(dst[i<<16:(i+1)<<16], uint64(uintptr(unsafe.Pointer(&src[i<<16]))))
		}
		if err := r.Read(); err != nil {
			t.Fatal(err)
		}
	})
	if !bytes.Equal(src, dst) {
		t.Fatal("copy differs")
	}
	if allocs != 0 {
		t.Fatalf("%.1f allocations per batch, want 0", allocs)
	}
}

func BenchmarkRead(b *testing.B) {
	for _, c := range []struct{ blocks, size int }{{1, 5120}, {1, 32 << 10}, {880, 5120}, {880, 32 << 10}} {
		src := pattern(c.blocks*c.size, 1)
		dst := make([]byte, len(src))
		r := NewReader(os.Getpid())
		b.Run(fmt.Sprintf("%dx%d", c.blocks, c.size), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			for b.Loop() {
				for i := range c.blocks {
					r.Add(dst[i*c.size:(i+1)*c.size], uint64(uintptr(unsafe.Pointer(&src[i*c.size]))))
				}
				if err := r.Read(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
