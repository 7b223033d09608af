package shmview

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/procinfo"
)

const childEnv = "SHMVIEW_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "write-view" {
		childWriteView()
		return
	}
	if os.Getenv(childEnv) == "lease" {
		os.Exit(childLease())
	}
	os.Exit(m.Run())
}

// shmFile creates a /dev/shm file of size bytes mapped MAP_SHARED, like
// vLLM's region, and removes it at the end of the test.
func shmFile(t testing.TB, size int) ([]byte, string) {
	t.Helper()
	path := filepath.Join("/dev/shm", fmt.Sprintf("ecxfer_shmview_test_%d_%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "_")))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(mem); _ = os.Remove(path) })
	return mem, path
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7)
	}
}

func TestFindSharedFile(t *testing.T) {
	mem, path := shmFile(t, 1<<20)
	b, err := Find(mem[8192:16384])
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if b.Path != path || b.Offset != 8192 || b.Dev != st.Dev || b.Ino != st.Ino {
		t.Fatalf("Find = %+v, want %s at 8192 (%#x, %d)", b, path, st.Dev, st.Ino)
	}
}

func TestFindRefuses(t *testing.T) {
	anon, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(anon)
	if _, err := Find(anon); !errors.Is(err, ErrNoFile) {
		t.Errorf("anonymous shared memory: %v, want ErrNoFile", err)
	}
	heap := make([]byte, 100)
	if _, err := Find(heap); !errors.Is(err, ErrNoFile) {
		t.Errorf("Go heap: %v, want ErrNoFile", err)
	}
	if _, err := Find(nil); !errors.Is(err, ErrNoFile) {
		t.Errorf("empty: %v, want ErrNoFile", err)
	}
	// A private mapping of a file is not shared with anyone.
	_, path := shmFile(t, 1<<16)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	priv, err := unix.Mmap(int(f.Fd()), 0, 1<<16, unix.PROT_READ, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(priv)
	if _, err := Find(priv); !errors.Is(err, ErrNoFile) {
		t.Errorf("private file mapping: %v, want ErrNoFile", err)
	}
}

func TestFindInListing(t *testing.T) {
	const maps = `00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/dbus-daemon
7f0000000000-7f0000010000 rw-s 00000000 00:1a 42  /dev/shm/a file
7f0000010000-7f0000020000 r--s 00010000 00:1a 42  /dev/shm/a file
7f0000020000-7f0000030000 rw-s 00000000 00:1a 43  /dev/shm/b
7f0000030000-7f0000040000 rw-s 00000000 00:01 44  /memfd:x (deleted)
7f0000040000-7f0000050000 rw-p 00000000 00:00 0
7f000005f000-7f0000070000 rw-s 00000000 00:01 720946                     /SYSV00000000 (deleted)
`
	cases := []struct {
		lo, hi uint64
		want   Backing
		err    bool
	}{
		{0x7f0000000000, 0x7f0000020000, Backing{Path: "/dev/shm/a file", Dev: unix.Mkdev(0, 0x1a), Ino: 42}, false},
		{0x7f0000008000, 0x7f0000018000, Backing{Path: "/dev/shm/a file", Offset: 0x8000, Dev: unix.Mkdev(0, 0x1a), Ino: 42}, false},
		{0x7f0000060000, 0x7f0000061000, Backing{SysV: true, Path: "/SYSV00000000", Offset: 0x1000, Dev: unix.Mkdev(0, 1), Ino: 720946}, false},
		{0x7f0000018000, 0x7f0000028000, Backing{}, true}, // two files
		{0x7f0000030000, 0x7f0000031000, Backing{}, true}, // deleted
		{0x7f0000040000, 0x7f0000041000, Backing{}, true}, // private anonymous
		{0x7f0000050000, 0x7f0000051000, Backing{}, true}, // unmapped
		{0x7f000004f000, 0x7f0000051000, Backing{}, true}, // runs off the end
	}
	for _, c := range cases {
		got, err := findIn(strings.NewReader(maps), c.lo, c.hi)
		if c.err != (err != nil) || (!c.err && got != c.want) {
			t.Errorf("[%#x, %#x): %+v, %v; want %+v (error %v)", c.lo, c.hi, got, err, c.want, c.err)
		}
	}
	if _, err := findIn(strings.NewReader("zzz\n"), 1, 2); err == nil {
		t.Error("garbage listing accepted")
	}
}

func testAdvert() Advert {
	return Advert{Kind: KindFile, Host: Host{Boot: "2b4e1c5a-0000-4000-8000-000000000001", NetNS: 1, PidNS: 2, MntNS: 3},
		PID: 1234, Start: 99, Base: 0x7f0000000000, Size: 1 << 20, Path: "/dev/shm/vllm_ec_x.mmap", Offset: 4096, Dev: 5, Ino: 6, Notify: 0x1234567890abcdef,
		NotifyKey: [NotifyKeyLen]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}}
}

func TestAdvertRoundTrip(t *testing.T) {
	for _, a := range []Advert{testAdvert(), {Kind: KindProc, Host: Host{Boot: "b"}, PID: 7, Base: 4096, Size: 10}} {
		b := a.Append(nil)
		got, err := DecodeAdvert(b)
		if err != nil || got != a {
			t.Fatalf("round trip of %+v: %+v, %v", a, got, err)
		}
		md := []byte("engine metadata")
		w := Wrap(md, &a)
		m, p, err := Split(w)
		if err != nil || p == nil || *p != a || !bytes.Equal(m, md) {
			t.Fatalf("Split(Wrap) = %q, %+v, %v", m, p, err)
		}
	}
	m, p, err := Split([]byte("plain"))
	if err != nil || p != nil || string(m) != "plain" {
		t.Fatalf("Split of plain metadata = %q, %v, %v", m, p, err)
	}
}

func TestAdvertHostile(t *testing.T) {
	a := testAdvert()
	good := a.Append(nil)
	mut := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	cases := map[string][]byte{
		"empty":          nil,
		"short":          good[:20],
		"magic":          mut(func(b []byte) []byte { b[0] = 'X'; return b }),
		"version":        mut(func(b []byte) []byte { b[4] = 1; return b }),
		"socket, no key": (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: 1, Size: 2, Path: "/x", Notify: 3}).Append(nil),
		"key, no socket": (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: 1, Size: 2, Path: "/x",
			NotifyKey: [NotifyKeyLen]byte{15: 1}}).Append(nil),
		"kind":       mut(func(b []byte) []byte { b[5] = 9; return b }),
		"trailing":   append(append([]byte(nil), good...), 0),
		"truncated":  good[:len(good)-1],
		"zero size":  (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: 1, Path: "/x"}).Append(nil),
		"wraps":      (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: ^uint64(0), Size: 2, Path: "/x"}).Append(nil),
		"rel path":   (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: 1, Size: 2, Path: "x"}).Append(nil),
		"nul path":   (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: 1, Size: 2, Path: "/x\x00"}).Append(nil),
		"no boot":    (&Advert{Kind: KindFile, PID: 1, Base: 1, Size: 2, Path: "/x"}).Append(nil),
		"pid 0":      (&Advert{Kind: KindFile, Host: a.Host, Base: 1, Size: 2, Path: "/x"}).Append(nil),
		"proc+path":  (&Advert{Kind: KindProc, Host: a.Host, PID: 1, Base: 1, Size: 2, Path: "/x"}).Append(nil),
		"file range": (&Advert{Kind: KindFile, Host: a.Host, PID: 1, Base: 1, Size: 2, Offset: ^uint64(0), Path: "/x"}).Append(nil),
	}
	for name, b := range cases {
		if _, err := DecodeAdvert(b); !errors.Is(err, ErrBadAdvert) {
			t.Errorf("%s: %v, want ErrBadAdvert", name, err)
		}
	}
	w := Wrap([]byte("md"), &a)
	w[len(w)-wrapTail] = 0xff // length larger than the blob
	if _, _, err := Split(w); !errors.Is(err, ErrBadAdvert) {
		t.Errorf("oversized trailer: %v", err)
	}
	w = Wrap([]byte("md"), &a)
	w[2] = 'Y' // corrupt the advertisement's magic
	if _, _, err := Split(w); !errors.Is(err, ErrBadAdvert) {
		t.Errorf("corrupt trailer: %v", err)
	}
}

func TestSelfAlive(t *testing.T) {
	a, err := ProcAdvert(make([]byte, 10))
	if err != nil {
		t.Fatal(err)
	}
	if !a.Alive() {
		t.Fatal("this process is not alive")
	}
	h, err := LocalHost()
	if err != nil || !h.SameHost(a.Host) {
		t.Fatalf("LocalHost %+v, %v; advert %+v", h, err, a.Host)
	}
	a.Start++
	if a.Alive() {
		t.Fatal("a different start time counts as alive")
	}
}

func TestOpenMemfd(t *testing.T) {
	leakcheck.Check(t)
	base := Mapped()
	r, err := Alloc("test", 3*4096+100)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fill(r.Mem, 1)
	a, err := r.Advert()
	if err != nil {
		t.Fatal(err)
	}
	v, err := Open(&a)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(v.Bytes(), r.Mem) {
		t.Fatal("view differs from the region")
	}
	r.Mem[5000] = 0xAB // the view is shared, not a snapshot
	got, ok := v.Slice(a.Base+5000, 1)
	if !ok || got[0] != 0xAB {
		t.Fatalf("Slice = %v, %v", got, ok)
	}
	for _, c := range []struct{ addr, n uint64 }{
		{a.Base - 1, 1}, {a.Base + a.Size, 1}, {a.Base + a.Size - 1, 2}, {a.Base, a.Size + 1}, {a.Base + 10, ^uint64(0)},
	} {
		if _, ok := v.Slice(c.addr, c.n); ok || a.Contains(c.addr, c.n) {
			t.Errorf("[%#x, +%d) outside the region accepted", c.addr, c.n)
		}
	}
	if Mapped() != base+1 {
		t.Fatalf("Mapped = %d, want %d", Mapped(), base+1)
	}
	v.Close()
	v.Close()
	if Mapped() != base {
		t.Fatalf("Mapped = %d after Close, want %d", Mapped(), base)
	}
}

// openFile opens a view of region, a window of a shmFile, closed at the
// end of the test.
func openFile(t *testing.T, region []byte) (*View, Advert) {
	t.Helper()
	a, err := FileAdvert(region)
	if err != nil {
		t.Fatal(err)
	}
	v, err := Open(&a)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(v.Close)
	return v, a
}

func TestOpenSharedFileAtOffset(t *testing.T) {
	mem, _ := shmFile(t, 1<<20)
	fill(mem, 3)
	region := mem[4096+512 : 4096+512+10000] // not page aligned
	v, a := openFile(t, region)
	if !bytes.Equal(v.Bytes(), region) {
		t.Fatal("view of an unaligned window differs")
	}
	// The window starts 512 bytes into the mapping's first page: the
	// whole window is the whole mapping, from that page's start.
	if got := v.Populate(descriptors.List{{Addr: a.Base, Len: a.Size}}); got != uint64(len(v.mem)) {
		t.Errorf("Populate of the whole window asked for %d bytes, want the mapping's %d", got, len(v.mem))
	}
}

// TestOpenRefusesWindowPastFileEnd: a producer may map its file past the
// file's end (mmap allows it; the pages past it fault) and advertise the
// whole mapping. The producer does map that file at that offset, so only
// the file's size tells: Open refuses the window, rather than a consumer
// mapping pages that fault when copied from.
func TestOpenRefusesWindowPastFileEnd(t *testing.T) {
	leakcheck.Check(t)
	path := filepath.Join("/dev/shm", fmt.Sprintf("ecxfer_shmview_short_%d", os.Getpid()))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	defer f.Close()
	if err := f.Truncate(4096); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, 4*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	a, err := FileAdvert(mem)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.mappedBy(); err != nil {
		t.Fatalf("the producer maps the file at the window: %v", err)
	}
	v, err := Open(&a)
	if err == nil {
		v.Close()
		t.Fatal("opened a window past the file's end")
	}
	if !errors.Is(err, ErrIdentity) || !strings.Contains(err.Error(), "window ends at") {
		t.Fatalf("refused with %v, want the file's size", err)
	}
	// The part inside the file opens.
	in, err := FileAdvert(mem[:4096])
	if err != nil {
		t.Fatal(err)
	}
	v, err = Open(&in)
	if err != nil {
		t.Fatal(err)
	}
	v.Close()
}

func TestOpenRefuses(t *testing.T) {
	leakcheck.Check(t)
	r, err := Alloc("test", 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	a, _ := r.Advert()
	for name, f := range map[string]func(a *Advert){
		"other inode": func(a *Advert) { a.Ino++ },
		"other dev":   func(a *Advert) { a.Dev++ },
		"too large":   func(a *Advert) { a.Size = 8193 },
		"past end":    func(a *Advert) { a.Offset = 4096 },
		"no file":     func(a *Advert) { a.Path = "/nonexistent/x" },
		"directory":   func(a *Advert) { a.Path = "/dev/shm" },
		"proc kind":   func(a *Advert) { *a = Advert{Kind: KindProc, Host: a.Host, PID: a.PID, Base: a.Base, Size: a.Size} },
	} {
		b := a
		f(&b)
		if v, err := Open(&b); err == nil {
			v.Close()
			t.Errorf("%s: opened", name)
		}
	}

	// A FIFO advertised with its own identity: refused as not a regular
	// file, without blocking (a read-only open of a FIFO waits for a
	// writer).
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(fifo, &st); err != nil {
		t.Fatal(err)
	}
	b := a
	b.Path, b.Dev, b.Ino = fifo, st.Dev, st.Ino
	res := make(chan error, 1)
	go func() {
		v, err := Open(&b)
		if err == nil {
			v.Close()
		}
		res <- err
	}()
	select {
	case err := <-res:
		if !errors.Is(err, ErrIdentity) {
			t.Errorf("fifo: %v, want ErrIdentity", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Open blocked on a FIFO")
	}
}

func TestRefcount(t *testing.T) {
	r, err := Alloc("test", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fill(r.Mem, 9)
	a, _ := r.Advert()
	base := Mapped()
	v, err := Open(&a)
	if err != nil {
		t.Fatal(err)
	}
	if !v.Acquire() {
		t.Fatal("Acquire failed on an open view")
	}
	v.Close()
	if v.Acquire() {
		t.Fatal("Acquire succeeded after Close")
	}
	// The running copy still reads the mapping.
	dst := make([]byte, 4096)
	if err := Copy(dst, v.Bytes()); err != nil || !bytes.Equal(dst, r.Mem) {
		t.Fatalf("copy after Close: %v", err)
	}
	if Mapped() != base+1 {
		t.Fatal("unmapped under a running copy")
	}
	v.Release()
	if Mapped() != base {
		t.Fatal("not unmapped after the last release")
	}
}

func TestRefcountRace(t *testing.T) {
	r, err := Alloc("test", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	a, _ := r.Advert()
	base := Mapped()
	for range 50 {
		v, err := Open(&a)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				dst := make([]byte, 1<<16)
				for range 20 {
					if !v.Acquire() {
						return
					}
					if err := Copy(dst, v.Bytes()); err != nil {
						t.Error(err)
					}
					v.Release()
				}
			})
		}
		v.Close()
		wg.Wait()
	}
	if Mapped() != base {
		t.Fatalf("Mapped = %d, want %d", Mapped(), base)
	}
}

// A producer that truncates its file makes the consumer's next read of the
// lost pages fault; Copy turns that into ErrFault.
func TestCopyTruncated(t *testing.T) {
	r, err := Alloc("test", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fill(r.Mem, 5)
	a, _ := r.Advert()
	v, err := Open(&a)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	dst := make([]byte, 1<<20)
	if err := Copy(dst, v.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(r.FD(), 4096); err != nil {
		t.Fatal(err)
	}
	if err := Copy(dst[:4096], v.Bytes()[:4096]); err != nil {
		t.Fatalf("copy of the page that is left: %v", err)
	}
	if err := Copy(dst, v.Bytes()); !errors.Is(err, ErrFault) {
		t.Fatalf("copy past the truncation: %v, want ErrFault", err)
	}
	// The goroutine's setting is restored.
	func() {
		defer func() {
			if recover() == nil {
				t.Error("nil dereference did not panic")
			}
		}()
		var p *int
		_ = *p
	}()
}

func childWriteView() {
	r, err := Alloc("child", 4096)
	if err != nil {
		fmt.Println("alloc:", err)
		os.Exit(2)
	}
	a, _ := r.Advert()
	v, err := Open(&a)
	if err != nil {
		fmt.Println("open:", err)
		os.Exit(2)
	}
	fmt.Println("writing")
	v.Bytes()[0] = 1 // must fault: the view is PROT_READ
	fmt.Println("wrote")
	os.Exit(0)
}

// The consumer's view is read-only: a write through it kills the writer
// (here a child process), and the producer's bytes are untouched.
func TestViewReadOnly(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=write-view", "GOTRACEBACK=single")
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "writing") || strings.Contains(string(out), "wrote") {
		t.Fatalf("write through the view: err %v, output:\n%s", err, out)
	}
	if !strings.Contains(string(out), "SIGSEGV") && !strings.Contains(string(out), "unexpected fault") {
		t.Fatalf("child did not die of a fault:\n%s", out)
	}
}

// UCX allocates engine regions as System V segments; a consumer attaches
// them read-only after checking who created them.
func TestSysV(t *testing.T) {
	leakcheck.Check(t)
	const size = 1 << 20
	id, err := unix.SysvShmGet(unix.IPC_PRIVATE, size, unix.IPC_CREAT|0o600)
	if err != nil {
		t.Skipf("shmget: %v", err)
	}
	seg, err := unix.SysvShmAttach(id, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Removed at once, as UCX does: it lives while attached.
	if _, err := unix.SysvShmCtl(id, unix.IPC_RMID, nil); err != nil {
		t.Fatal(err)
	}
	defer unix.SysvShmDetach(seg)
	fill(seg, 7)
	region := seg[8192 : 8192+100000]
	a, err := Describe(region)
	if err != nil {
		t.Fatal(err)
	}
	if a.Kind != KindSysV || a.Ino != uint64(id) || a.Offset != 8192 {
		t.Fatalf("Describe = %+v, want sysv %d at 8192", a, id)
	}
	got, err := DecodeAdvert(a.Append(nil))
	if err != nil || got != a {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	base := Mapped()
	v, err := Open(&a)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(v.Bytes(), region) {
		t.Fatal("view differs")
	}
	v.Close()
	if Mapped() != base {
		t.Fatal("segment still attached")
	}
	// A segment the advertised process created but does not map at Base
	// (a segment outlives its creator, whose pid may name another process
	// by now): its creator's pid is not enough.
	other, err := unix.SysvShmGet(unix.IPC_PRIVATE, size, unix.IPC_CREAT|0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = unix.SysvShmCtl(other, unix.IPC_RMID, nil) }()
	hole, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Munmap(hole); err != nil {
		t.Fatal(err)
	}
	for name, f := range map[string]func(a *Advert){
		"other creator":               func(a *Advert) { a.PID++ },
		"too large":                   func(a *Advert) { a.Size = size },
		"no segment":                  func(a *Advert) { a.Ino = 1<<31 - 1 },
		"a segment it does not map":   func(a *Advert) { a.Ino = uint64(other) },
		"nothing mapped at Base":      func(a *Advert) { a.Base = uint64(uintptr(unsafe.Pointer(&hole[0]))) },
		"mapped at another offset":    func(a *Advert) { a.Offset = 0 },
		"its pid now another process": func(a *Advert) { a.Start++ },
	} {
		b := a
		f(&b)
		if v, err := Open(&b); err == nil {
			v.Close()
			t.Errorf("%s: opened", name)
		}
	}
}

func TestDescribe(t *testing.T) {
	mem, _ := shmFile(t, 1<<16)
	if a, err := Describe(mem); err != nil || a.Kind != KindFile {
		t.Fatalf("file region: %+v, %v", a, err)
	}
	anon, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(anon)
	if a, err := Describe(anon); err != nil || a.Kind != KindProc {
		t.Fatalf("anonymous region: %+v, %v", a, err)
	}
}

// mappedBytes returns the Rss of the mapping that starts at mem[0], from
// /proc/self/smaps: how much of it has pages mapped.
func mappedBytes(t *testing.T, mem []byte) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skipf("smaps: %v", err)
	}
	start := fmt.Sprintf("%x-", uintptr(unsafe.Pointer(&mem[0])))
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":"):
			in = strings.HasPrefix(f[0], start)
		case in && len(f) == 3 && f[0] == "Rss:":
			kb, err := strconv.ParseUint(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no mapping at %s in smaps", start)
	return 0
}

// A view faults in the pages of the blocks it is given, not the whole
// region: a peer may advertise far more than its block list uses.
func TestPopulateOnlyBlocks(t *testing.T) {
	const size = 16 << 20
	page := uint64(os.Getpagesize())
	mem, _ := shmFile(t, size)
	fill(mem, 9) // every page of the file exists
	v, a := openFile(t, mem)
	if got := mappedBytes(t, v.mem); got != 0 {
		t.Fatalf("Open mapped %d bytes, want none before Populate", got)
	}
	blk := func(off, n uint64) descriptors.Desc { return descriptors.Desc{Addr: a.Base + off, Len: n} }
	descs := descriptors.List{
		blk(8<<20, 5120),        // pages 2048-2049
		blk(0, 5120),            // pages 0-1, out of order
		blk(5120, 5120),         // pages 1-2, overlaps the one before
		blk(8<<20, 100),         // again
		blk(size-100, 100),      // the last page
		blk(size-100, 200),      // outside the region: skipped
		blk(12<<20+page-1, 2),   // straddles two pages
		blk(12<<20+page+10, 10), // inside the last one
	}
	want := (3 + 2 + 1 + 2) * page
	if got := v.Populate(descs); got != want {
		t.Errorf("Populate asked for %d bytes, want %d", got, want)
	}
	// The kernel maps the neighbours of a faulted page that are in the
	// page cache too (fault-around, 64 KiB by default), so more than the
	// blocks' pages may be mapped, but nowhere near the whole region.
	if got := mappedBytes(t, v.mem); got < want || got > 1<<20 {
		t.Errorf("%d bytes mapped after Populate, want %d (fault-around: up to 1 MiB) of the %d", got, want, size)
	}
	grid := make(descriptors.List, size/5120)
	for i := range grid {
		grid[i] = blk(uint64(i)*5120, 5120)
	}
	v.Populate(grid)
	if got, all := mappedBytes(t, v.mem), uint64(len(grid))*5120/page*page; got < all {
		t.Errorf("%d bytes mapped after populating every block, want at least %d", got, all)
	}
}

// Populate maps only the pages the producer's file holds: the holes of a
// sparse region (vLLM's file until its blocks are filled) stay holes,
// rather than being allocated in the producer's file and charged to the
// consumer. A READ of such a block still sees zeros.
func TestPopulateSkipsHoles(t *testing.T) {
	const size = 16 << 20
	page := uint64(os.Getpagesize())
	mem, path := shmFile(t, size)
	written := []uint64{0, 3 << 20, 3<<20 + 5120, size - 5120} // offsets of the blocks the producer wrote
	for _, off := range written {
		fill(mem[off:off+5120], byte(off))
	}
	allocated := func() uint64 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			t.Fatal(err)
		}
		return uint64(st.Blocks) * 512
	}
	before := allocated()
	v, a := openFile(t, mem)
	grid := make(descriptors.List, size/5120)
	for i := range grid {
		grid[i] = descriptors.Desc{Addr: a.Base + uint64(i)*5120, Len: 5120}
	}
	got := v.Populate(grid)
	if after := allocated(); after != before {
		t.Fatalf("the producer's file grew from %d to %d bytes: Populate allocated its holes", before, after)
	}
	if got == 0 || got > before {
		t.Errorf("Populate asked for %d bytes, want the file's %d resident ones at most (and some)", got, before)
	}
	if m := mappedBytes(t, v.mem); m == 0 || m > before {
		t.Errorf("%d bytes mapped, want some and at most the file's %d", m, before)
	}
	// The blocks written read back; a hole reads as zeros.
	for _, off := range written {
		want := make([]byte, 5120)
		fill(want, byte(off))
		if !bytes.Equal(v.data[off:off+5120], want) {
			t.Fatalf("block at %d reads wrong through the view", off)
		}
	}
	if hole := v.data[8<<20 : 8<<20+page]; !bytes.Equal(hole, make([]byte, page)) {
		t.Fatal("a hole does not read as zeros")
	}
}

// childLease is a producer that maps its region file and holds a write
// lease on it, ignoring the kernel's signal to give it up, until its
// stdin closes. It prints the mapping's address.
func childLease() int {
	signal.Ignore(unix.SIGIO)
	fd, err := unix.Open(os.Getenv("LEASE_PATH"), unix.O_RDWR|unix.O_CREAT|unix.O_TRUNC, 0o600)
	if err != nil {
		fmt.Println("open:", err)
		return 2
	}
	if err := unix.Ftruncate(fd, 1<<16); err != nil {
		fmt.Println("truncate:", err)
		return 2
	}
	mem, err := unix.Mmap(fd, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		fmt.Println("mmap:", err)
		return 2
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_WRLCK); err != nil {
		fmt.Println("lease:", err)
		return 2
	}
	fmt.Printf("ready %d\n", uintptr(unsafe.Pointer(&mem[0])))
	_, _ = os.Stdin.Read(make([]byte, 1))
	return 0
}

// A producer's lease on its region file does not hold Open for the
// kernel's lease-break time (45 s by default): the open fails at once.
func TestOpenLeasedFile(t *testing.T) {
	leakcheck.Check(t)
	path := filepath.Join("/dev/shm", fmt.Sprintf("ecxfer_shmview_lease_%d", os.Getpid()))
	defer os.Remove(path)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=lease", "LEASE_PATH="+path)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
	var base uint64
	if n, err := fmt.Fscanf(stdout, "ready %d\n", &base); n != 1 || err != nil {
		t.Fatalf("producer: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	start, err := procinfo.StartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	h, err := LocalHost()
	if err != nil {
		t.Fatal(err)
	}
	a := Advert{Kind: KindFile, Host: h, PID: uint32(cmd.Process.Pid), Start: start, Base: base, Size: 4096,
		Path: path, Dev: st.Dev, Ino: st.Ino}
	done := make(chan error, 1)
	go func() {
		v, err := Open(&a)
		if err == nil {
			v.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, unix.EWOULDBLOCK) {
			t.Fatalf("Open of a leased file: %v, want EWOULDBLOCK", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Open waited for the producer's lease")
		// (The goroutine returns once the kernel breaks the lease.)
	}
}

// TestLifeToken: a token names the descriptor it was made with (0 to
// 65,534), never 0, and one made without a descriptor names none, even
// when its random bits spell the tag.
func TestLifeToken(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	for _, fd := range []int{0, 1, 3, 1000, lifeFDMax} {
		for range 100 {
			a := Advert{Notify: LifeToken(rng.Uint64(), fd)}
			got, ok := a.LifeFD()
			require.True(t, ok, "fd %d", fd)
			require.Equal(t, fd, got)
			require.NotZero(t, a.Notify)
		}
	}
	for _, fd := range []int{-1, lifeFDMax + 1, 1 << 30} {
		for _, rnd := range []uint64{0, lifeTag << 16, lifeTag<<16 | 5, 0xFFFF_FFFF_FFFF_FFFF, rng.Uint64()} {
			a := Advert{Notify: LifeToken(rnd, fd)}
			_, ok := a.LifeFD()
			require.False(t, ok, "fd %d, random bits %#x", fd, rnd)
			require.NotZero(t, a.Notify)
		}
	}
	// A tag with no descriptor (low 16 bits 0) names none.
	a := Advert{Notify: lifeTag << 16}
	_, ok := a.LifeFD()
	require.False(t, ok)
}
