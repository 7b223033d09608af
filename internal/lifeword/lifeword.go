// Package lifeword lets a process on the same host learn that another has
// died with one load from shared memory instead of a system call.
//
// A producer (Hold) keeps a 32-bit word in a sealed memfd. One of its
// threads, locked to a goroutine that only sleeps, writes its thread id
// into the word and registers the word as the one entry of its robust
// futex list (set_robust_list(2)). When that thread exits, however the
// process ends (exit, a signal, SIGKILL, exec), the kernel, walking the
// list before it releases the process's memory, finds the word still
// holding the thread's id and sets FUTEX_OWNER_DIED in it. That happens
// before the process's pidfd becomes readable, so a reader that sees the
// word unmarked knows at least what a poll(2) of the pidfd would have told
// it.
//
// A consumer (Watch) maps the producer's memfd read-only through
// /proc/<pid>/fd/<fd> and loads the word. The page also carries its
// holder's random id, which the consumer learns with the descriptor: a
// descriptor whose number a later holder of the same process took after
// Stop closed it holds another id, and the Watcher says Retired. The word is the producer's to
// write, so it vouches only for a producer that is not lying, as the
// pidfd vouches only for the process it names: it is a liveness check,
// not a security boundary.
//
// Hold's Stop writes Retired into the word, for good, and puts the
// thread's own robust list (glibc's) back: the producer closed what the
// word vouched for (its transport) and may live on, and a Watcher learns
// that from the same load. Retired carries no thread id, so the kernel
// never marks it, and a reader that knows only thread ids and
// FUTEX_OWNER_DIED (an older build) takes it for a word that says nothing
// and asks the kernel (the pidfd) instead, as it did before words were
// retired.
package lifeword

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Layout of the memfd (one page).
const (
	size      = 4096
	offHead   = 0   // struct robust_list_head {next; futex_offset; list_op_pending}
	offEntry  = 64  // struct robust_list {next}: the list's one entry
	offWord   = 128 // the futex word the kernel marks
	offStop   = 192 // Stop's futex: the holding thread sleeps on it
	offID     = 256 // the holder's id (u32, random, never 0; 0 in older builds' pages)
	headLen   = 24  // sizeof(struct robust_list_head) on 64-bit Linux
	memfdName = "ecxfer-life"
	// linkName is what /proc/<pid>/fd/<fd> reads for the memfd.
	linkName = "/memfd:" + memfdName + " (deleted)"
)

// Word values (linux/futex.h).
const (
	tidMask   = 0x3fffffff // FUTEX_TID_MASK
	ownerDied = 0x40000000 // FUTEX_OWNER_DIED
	// Closed: the word says nothing (a page no thread holds yet).
	Closed = 0
	// wordRetired: the holder stopped (Stop): its process closed the
	// transport the word vouched for. FUTEX_WAITERS with no thread id,
	// which the kernel never marks and older readers take for Closed.
	wordRetired = 0x80000000

	futexWait = 0 // FUTEX_WAIT
	futexWake = 1 // FUTEX_WAKE
)

// requiredSeals are what make the page safe to map: its owner can no
// longer shrink it under a reader (SIGBUS) or change the seals.
const requiredSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// ErrNotLifeword is the error of Watch for a descriptor that is not a
// producer's lifeword memfd.
var ErrNotLifeword = errors.New("lifeword: not a lifeword")

// State is what a word says about its holder.
type State uint8

const (
	// Unknown: the word holds no thread id (and is not Retired); ask
	// the kernel (the pidfd).
	Unknown State = iota
	// Alive: the holding thread has not exited.
	Alive
	// Died: the kernel marked the word: the holding thread, and with it
	// the process, is gone.
	Died
	// Retired: the holder stopped: the process closed the transport the
	// word vouched for, and may live on.
	Retired
)

func (s State) String() string {
	switch s {
	case Alive:
		return "alive"
	case Died:
		return "died"
	case Retired:
		return "retired"
	}
	return "unknown"
}

func stateOf(w uint32) State {
	switch {
	case w == wordRetired:
		return Retired
	case w&ownerDied != 0:
		return Died
	case w&tidMask != 0:
		return Alive
	}
	return Unknown
}

// Holder keeps a word alive for this process.
type Holder struct {
	id        uint32
	fd        int
	mem       []byte
	tid       int
	done      chan error
	once      sync.Once // Retire
	closeOnce sync.Once // Stop
	err       error
}

// Hold creates the word and the thread that holds it. The word says Alive
// when Hold returns.
func Hold() (*Holder, error) {
	fd, err := unix.MemfdCreate(memfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("lifeword: memfd_create: %w", err)
	}
	fail := func(what string, err error) (*Holder, error) {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("lifeword: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, requiredSeals); err != nil {
		return fail("seal", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap", err)
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		_ = unix.Munmap(mem)
		return fail("random id", err)
	}
	h := &Holder{id: binary.LittleEndian.Uint32(b[:]) | 1, fd: fd, mem: mem, done: make(chan error, 1)}
	atomic.StoreUint32(h.u32(offID), h.id)
	ready := make(chan error, 1)
	go h.hold(ready)
	if err := <-ready; err != nil {
		<-h.done
		_ = unix.Munmap(mem)
		_ = unix.Close(fd)
		return nil, fmt.Errorf("lifeword: %w", err)
	}
	return h, nil
}

func (h *Holder) u32(off int) *uint32 { return (*uint32)(unsafe.Pointer(&h.mem[off])) }
func (h *Holder) u64(off int) *uint64 { return (*uint64)(unsafe.Pointer(&h.mem[off])) }

// hold runs on a thread of its own until Stop: it registers the word in
// the thread's robust list, sleeps, and puts the old list back.
func (h *Holder) hold(ready chan<- error) {
	runtime.LockOSThread()
	// Every UnlockOSThread below leaves the thread's robust list as it
	// found it, so the thread may go back to the runtime's pool.
	var oldHead, oldLen uintptr
	if _, _, e := unix.RawSyscall(unix.SYS_GET_ROBUST_LIST, 0,
		uintptr(unsafe.Pointer(&oldHead)), uintptr(unsafe.Pointer(&oldLen))); e != 0 {
		runtime.UnlockOSThread()
		ready <- fmt.Errorf("get_robust_list: %w", e)
		h.done <- nil
		return
	}
	base := uintptr(unsafe.Pointer(&h.mem[0]))
	h.tid = unix.Gettid()
	*h.u64(offHead) = uint64(base + offEntry)         // head.list.next: the entry
	*h.u64(offHead + 8) = uint64(offWord - offEntry)  // head.futex_offset
	*h.u64(offHead + 16) = 0                          // head.list_op_pending
	*h.u64(offEntry) = uint64(base + offHead)         // entry.next: back to the head
	atomic.StoreUint32(h.u32(offWord), uint32(h.tid)) // held by this thread
	if _, _, e := unix.RawSyscall(unix.SYS_SET_ROBUST_LIST, base+offHead, headLen, 0); e != 0 {
		atomic.StoreUint32(h.u32(offWord), Closed)
		runtime.UnlockOSThread()
		ready <- fmt.Errorf("set_robust_list: %w", e)
		h.done <- nil
		return
	}
	ready <- nil
	stop := h.u32(offStop)
	for atomic.LoadUint32(stop) == 0 {
		// FUTEX_WAIT (shared: the page is a shared mapping) until Stop
		// stores 1 and wakes it; EINTR and spurious wake-ups loop.
		_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(stop)), futexWait, 0, 0, 0, 0)
	}
	// The word first: from here on the thread's exit must not mark it,
	// and watchers learn the transport is closed.
	atomic.StoreUint32(h.u32(offWord), wordRetired)
	if _, _, e := unix.RawSyscall(unix.SYS_SET_ROBUST_LIST, oldHead, oldLen, 0); e != 0 {
		// The list is still ours: returning while locked ends the thread
		// instead of handing it back to the pool with it.
		h.done <- fmt.Errorf("lifeword: restoring the robust list: %w", e)
		return
	}
	runtime.UnlockOSThread()
	h.done <- nil
}

// FD is the memfd's descriptor in this process, for Watch in another.
func (h *Holder) FD() int { return h.fd }

// ID is the holder's id (random, never 0), for Watch in another process:
// it tells this word from another holder's that took its descriptor's
// number after Stop closed it.
func (h *Holder) ID() uint32 { return h.id }

// TID is the id of the thread that holds the word.
func (h *Holder) TID() int { return h.tid }

// State is what the word says now (Alive until Stop).
func (h *Holder) State() State { return stateOf(atomic.LoadUint32(h.u32(offWord))) }

// Retire writes Retired into the word and gives the thread back; the
// memfd stays open, so a consumer that looks the descriptor up from now on
// (Watch) still finds the word and learns the holder retired, until Stop.
// It returns once the thread has let go. Idempotent; the error says if the
// thread's robust list could not be put back (the thread then ends with
// its goroutine).
func (h *Holder) Retire() error {
	h.once.Do(func() {
		stop := h.u32(offStop)
		atomic.StoreUint32(stop, 1)
		_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(stop)), futexWake, 1, 0, 0, 0)
		h.err = <-h.done
	})
	return h.err
}

// Stop retires the word (Retire) and closes the memfd here (readers keep
// their mappings): a Watch after it finds no word under the descriptor,
// or another holder's. Call it once nothing can make a consumer look the
// word up any more. Idempotent; its error is Retire's.
func (h *Holder) Stop() error {
	err := h.Retire()
	h.closeOnce.Do(func() {
		_ = unix.Munmap(h.mem)
		h.mem = nil
		_ = unix.Close(h.fd)
	})
	return err
}

// Watcher reads another process's word.
type Watcher struct {
	mem  []byte
	word *uint32
	// gone: the descriptor holds another holder's word (the one asked
	// for was stopped, its descriptor closed, and its number taken):
	// Retired for good.
	gone bool
}

// Watch maps the word of process pid's memfd fd, the holder's whose ID is
// id (0: any, as for a holder of an older build, whose page has none).
// A descriptor that now holds another holder's word (the one with id was
// stopped and a new one took its number) gives a Watcher that says
// Retired. The caller must make sure afterwards that pid still names the
// process it means (a pidfd opened before, and the process's start time
// read after): the descriptor was looked up by pid.
func Watch(pid, fd int, id uint32) (*Watcher, error) {
	if pid <= 0 || fd < 0 {
		return nil, fmt.Errorf("%w: pid %d, fd %d", ErrNotLifeword, pid, fd)
	}
	link := fmt.Sprintf("/proc/%d/fd/%d", pid, fd)
	if name, err := os.Readlink(link); err != nil {
		return nil, fmt.Errorf("lifeword: %w", err)
	} else if name != linkName {
		return nil, fmt.Errorf("%w: %s is %q", ErrNotLifeword, link, name)
	}
	// O_NONBLOCK: should the link have changed since, nothing (a FIFO)
	// blocks the open; the checks below refuse what it opened.
	f, err := unix.Open(link, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("lifeword: open %s: %w", link, err)
	}
	defer unix.Close(f)
	var st unix.Stat_t
	if err := unix.Fstat(f, &st); err != nil {
		return nil, fmt.Errorf("lifeword: fstat %s: %w", link, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != size {
		return nil, fmt.Errorf("%w: %s: mode %#o, %d bytes", ErrNotLifeword, link, st.Mode, st.Size)
	}
	seals, err := unix.FcntlInt(uintptr(f), unix.F_GET_SEALS, 0)
	if err != nil || seals&requiredSeals != requiredSeals {
		return nil, fmt.Errorf("%w: %s: seals %#x (%v)", ErrNotLifeword, link, seals, err)
	}
	mem, err := unix.Mmap(f, 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("lifeword: mmap %s: %w", link, err)
	}
	// A page of an older build has no id: its word is taken as it is.
	if have := atomic.LoadUint32((*uint32)(unsafe.Pointer(&mem[offID]))); id != 0 && have != 0 && have != id {
		_ = unix.Munmap(mem)
		return &Watcher{gone: true}, nil
	}
	return &Watcher{mem: mem, word: (*uint32)(unsafe.Pointer(&mem[offWord]))}, nil
}

// State loads the word: no system call.
func (w *Watcher) State() State {
	if w.gone {
		return Retired
	}
	return stateOf(atomic.LoadUint32(w.word))
}

// Close unmaps the word. Not safe to call beside State.
func (w *Watcher) Close() {
	if w.mem != nil {
		_ = unix.Munmap(w.mem)
		w.mem, w.word = nil, nil
	}
}
