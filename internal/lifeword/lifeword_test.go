package lifeword

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// TestMain: run as a holder process when asked (re-exec of the test
// binary): hold LIFEWORD_HOLDERS words, print their descriptors, then
// do what LIFEWORD_END says once stdin has a line.
func TestMain(m *testing.M) {
	if n := os.Getenv("LIFEWORD_HOLDERS"); n != "" {
		holderMain(n)
		return
	}
	os.Exit(m.Run())
}

func holderMain(n string) {
	count, _ := strconv.Atoi(n)
	var fds []string
	var hs []*Holder
	for range count {
		h, err := Hold()
		if err != nil {
			fmt.Println("error", err)
			os.Exit(3)
		}
		hs = append(hs, h)
		fds = append(fds, strconv.Itoa(h.FD()))
	}
	fmt.Println(strings.Join(fds, " "))
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	switch os.Getenv("LIFEWORD_END") {
	case "stop": // Stop every word, then stay until killed
		for _, h := range hs {
			if err := h.Stop(); err != nil {
				fmt.Println("error", err)
				os.Exit(3)
			}
		}
		fmt.Println("stopped")
		select {}
	case "exit":
		os.Exit(0)
	case "exec": // become another program: the holding threads go
		_ = syscall.Exec("/bin/sleep", []string{"sleep", "60"}, os.Environ())
		os.Exit(4)
	default: // wait to be killed
		select {}
	}
}

type holderProc struct {
	cmd   *exec.Cmd
	stdin *os.File
	out   *bufio.Reader
	fds   []int
}

func startHolders(t *testing.T, n int, end string) *holderProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "LIFEWORD_HOLDERS="+strconv.Itoa(n), "LIFEWORD_END="+end)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stdin = r
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	_ = r.Close()
	p := &holderProc{cmd: cmd, stdin: w, out: bufio.NewReader(out)}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = w.Close()
	})
	line, err := p.out.ReadString('\n')
	require.NoError(t, err)
	for _, f := range strings.Fields(line) {
		fd, err := strconv.Atoi(f)
		require.NoError(t, err, "holder said %q", line)
		p.fds = append(p.fds, fd)
	}
	require.Len(t, p.fds, n, "holder said %q", line)
	return p
}

func (p *holderProc) watch(t *testing.T) []*Watcher {
	t.Helper()
	var ws []*Watcher
	for _, fd := range p.fds {
		w, err := Watch(p.cmd.Process.Pid, fd, 0)
		require.NoError(t, err)
		t.Cleanup(w.Close)
		ws = append(ws, w)
	}
	return ws
}

func requireStates(t *testing.T, ws []*Watcher, want State) {
	t.Helper()
	for i, w := range ws {
		require.Equal(t, want, w.State(), "word %d", i)
	}
}

// TestKilledHolderMarked: SIGKILL, which runs no code of the process, still
// marks every word: the kernel does it. Checked once the process is gone
// (reaped), and the words said Alive before.
func TestKilledHolderMarked(t *testing.T) {
	p := startHolders(t, 3, "")
	ws := p.watch(t)
	requireStates(t, ws, Alive)
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
	_ = p.cmd.Wait()
	requireStates(t, ws, Died)
}

// TestKilledHolderMarkedBeforeReaped: the word is marked before the pidfd
// reports the exit, so no check that trusted the word would have passed
// where the pidfd's would have failed.
func TestKilledHolderMarkedBeforeReaped(t *testing.T) {
	for range 20 {
		p := startHolders(t, 1, "")
		ws := p.watch(t)
		pidfd, err := unix.PidfdOpen(p.cmd.Process.Pid, 0)
		require.NoError(t, err)
		require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 10_000)
		require.NoError(t, err)
		require.Equal(t, 1, n, "the pidfd never reported the exit")
		require.Equal(t, Died, ws[0].State(), "pidfd readable, word not marked")
		_ = unix.Close(pidfd)
	}
}

func TestExitingHolderMarked(t *testing.T) {
	p := startHolders(t, 2, "exit")
	ws := p.watch(t)
	requireStates(t, ws, Alive)
	_, _ = p.stdin.WriteString("go\n")
	_ = p.cmd.Wait()
	requireStates(t, ws, Died)
}

// TestExecingHolderMarked: after exec the pid runs another program; the
// memory the words vouched for is gone.
func TestExecingHolderMarked(t *testing.T) {
	if _, err := os.Stat("/bin/sleep"); err != nil {
		t.Skip("no /bin/sleep to exec")
	}
	p := startHolders(t, 2, "exec")
	ws := p.watch(t)
	requireStates(t, ws, Alive)
	_, _ = p.stdin.WriteString("go\n")
	// Each word is marked as its own thread goes, and exec takes the
	// threads one after the other: wait for every word, not the first.
	deadline := time.Now().Add(10 * time.Second)
	for slices.ContainsFunc(ws, func(w *Watcher) bool { return w.State() == Alive }) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	requireStates(t, ws, Died)
	// The process itself lives on (as sleep): the word, not the pid, told.
	require.NoError(t, p.cmd.Process.Signal(syscall.Signal(0)))
}

// TestStoppedHolderRetired: after Stop the word says Retired (the process
// closed its transport and lives on), and the thread that held it, which
// goes back to the runtime, no longer marks it when it exits: killing the
// process leaves it Retired.
func TestStoppedHolderRetired(t *testing.T) {
	p := startHolders(t, 4, "stop")
	ws := p.watch(t)
	requireStates(t, ws, Alive)
	_, _ = p.stdin.WriteString("go\n")
	line, err := p.out.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "stopped\n", line)
	requireStates(t, ws, Retired)
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
	_ = p.cmd.Wait()
	requireStates(t, ws, Retired)
}

// TestRetiredWordOldReaders: a retired word holds neither a thread id nor
// FUTEX_OWNER_DIED, the only bits a reader of an older build looks at, so
// such a reader asks the pidfd about a retired producer, as it did about
// any stopped one; and a word that says nothing is not taken for retired.
func TestRetiredWordOldReaders(t *testing.T) {
	require.Zero(t, uint32(wordRetired)&(tidMask|ownerDied))
	require.Equal(t, Retired, stateOf(wordRetired))
	require.Equal(t, Unknown, stateOf(Closed))
	require.Equal(t, Died, stateOf(wordRetired|ownerDied), "a mark the kernel made is never read as retired")
	require.Equal(t, Alive, stateOf(wordRetired|1234), "FUTEX_WAITERS on a held word is still held")
}

// TestHoldInProcess: a holder and a watcher in one process; Stop gives the
// thread back with its own robust list, and leaves no goroutine or
// descriptor.
func TestHoldInProcess(t *testing.T) {
	leakcheck.Check(t)
	var hs []*Holder
	for range 8 {
		h, err := Hold()
		require.NoError(t, err)
		hs = append(hs, h)
	}
	tids := map[int]bool{}
	for _, h := range hs {
		require.Equal(t, Alive, h.State())
		tids[h.TID()] = true
		w, err := Watch(os.Getpid(), h.FD(), h.ID())
		require.NoError(t, err)
		require.Equal(t, Alive, w.State())
		require.NoError(t, h.Stop())
		require.NoError(t, h.Stop(), "Stop is idempotent")
		require.Equal(t, Retired, w.State())
		w.Close()
		w.Close()
	}
	require.Len(t, tids, 8, "each word is held by a thread of its own")
}

// TestRetireKeepsTheDescriptor: after Retire a consumer that looks the
// word up for the first time finds it, retired; after Stop the descriptor
// is gone and the look-up fails.
func TestRetireKeepsTheDescriptor(t *testing.T) {
	leakcheck.Check(t)
	h, err := Hold()
	require.NoError(t, err)
	require.NoError(t, h.Retire())
	require.NoError(t, h.Retire(), "Retire is idempotent")
	w, err := Watch(os.Getpid(), h.FD(), h.ID())
	require.NoError(t, err, "the retired word is still there to watch")
	require.Equal(t, Retired, w.State())
	w.Close()
	require.NoError(t, h.Stop())
	_, err = Watch(os.Getpid(), h.FD(), h.ID())
	require.Error(t, err, "Stop closed the descriptor")
}

// TestStopRestoresRobustList: the thread a holder used has its previous
// robust list back (glibc's, in a cgo program) once Stop returns. Checked
// from the outside: get_robust_list of that thread id.
func TestStopRestoresRobustList(t *testing.T) {
	h, err := Hold()
	require.NoError(t, err)
	tid := h.TID()
	var head, n uintptr
	_, _, e := unix.RawSyscall(unix.SYS_GET_ROBUST_LIST, uintptr(tid),
		uintptr(unsafe.Pointer(&head)), uintptr(unsafe.Pointer(&n)))
	require.Zero(t, e)
	mem := uintptr(unsafe.Pointer(&h.mem[0]))
	require.Equal(t, mem+offHead, head, "the holding thread's list is the word's")
	require.NoError(t, h.Stop())
	_, _, e = unix.RawSyscall(unix.SYS_GET_ROBUST_LIST, uintptr(tid),
		uintptr(unsafe.Pointer(&head)), uintptr(unsafe.Pointer(&n)))
	if e == unix.ESRCH {
		return // the runtime let the thread go: nothing of ours is left on it
	}
	require.Zero(t, e)
	require.NotEqual(t, mem+offHead, head, "Stop left the word's list on the thread")
}

// TestWatchRefusesOtherFiles: hostile or stale descriptors (another file,
// a memfd that is not sealed, of another size or name, no descriptor, a
// pid that is not there) are refused without being mapped.
func TestWatchRefusesOtherFiles(t *testing.T) {
	leakcheck.Check(t)
	pid := os.Getpid()
	f, err := os.CreateTemp(t.TempDir(), "word")
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(size))
	mk := func(name string, n int64, seals int) int {
		fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Close(fd) })
		require.NoError(t, unix.Ftruncate(fd, n))
		if seals != 0 {
			_, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals)
			require.NoError(t, err)
		}
		return fd
	}
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	cases := map[string]struct{ pid, fd int }{
		"a regular file":          {pid, int(f.Fd())},
		"a pipe":                  {pid, int(r.Fd())},
		"unsealed memfd":          {pid, mk(memfdName, size, 0)},
		"memfd that can shrink":   {pid, mk(memfdName, size, unix.F_SEAL_GROW|unix.F_SEAL_SEAL)},
		"memfd of another size":   {pid, mk(memfdName, 2*size, requiredSeals)},
		"memfd of another name":   {pid, mk("other", size, requiredSeals)},
		"a closed descriptor":     {pid, 1 << 20},
		"a negative descriptor":   {pid, -1},
		"no such process":         {1 << 30, 3},
		"pid zero":                {0, 3},
		"a process not ours (1)?": {1, 0},
	}
	for name, c := range cases {
		wt, err := Watch(c.pid, c.fd, 0)
		require.Error(t, err, name)
		require.Nil(t, wt, name)
	}
	good := mk(memfdName, size, requiredSeals)
	wt, err := Watch(pid, good, 0)
	require.NoError(t, err, "a memfd shaped like a word is accepted (its word says Unknown)")
	require.Equal(t, Unknown, wt.State())
	wt.Close()
	_, err = Watch(pid, int(f.Fd()), 0)
	require.True(t, errors.Is(err, ErrNotLifeword), "%v", err)
}

// A holder stopped closes its descriptor, and a holder made after it in
// the same process (another transport) may take the number. A consumer
// that watches the first by that number then maps the second's word,
// which says Alive: READs of the closed transport's region would end
// DONE. The id the consumer has with the number tells them apart: the
// watcher says Retired. A page without an id (an older build) is taken
// as it is.
func TestWatchTellsAnotherHoldersWord(t *testing.T) {
	h1, err := Hold()
	require.NoError(t, err)
	id1, fd1 := h1.ID(), h1.FD()
	require.NotZero(t, id1)
	require.NoError(t, h1.Stop())
	h2, err := Hold()
	require.NoError(t, err)
	defer func() { require.NoError(t, h2.Stop()) }()
	require.NotEqual(t, id1, h2.ID())
	if h2.FD() != fd1 {
		// Not the same number by chance: make it so.
		require.NoError(t, unix.Dup3(h2.FD(), fd1, unix.O_CLOEXEC))
		defer unix.Close(fd1)
	}
	pid := os.Getpid()
	for _, c := range []struct {
		id   uint32
		want State
	}{{id1, Retired}, {h2.ID(), Alive}, {0, Alive}} {
		w, err := Watch(pid, fd1, c.id)
		require.NoError(t, err)
		require.Equal(t, c.want, w.State(), "id %#x", c.id)
		w.Close()
	}
	// A page of an older build has no id.
	atomic.StoreUint32(h2.u32(offID), 0)
	w, err := Watch(pid, fd1, id1)
	require.NoError(t, err)
	require.Equal(t, Alive, w.State())
	w.Close()
}
