package reactor

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/copypool"
	"github.com/ecxfer/ecxfer/internal/lifeword"
	"github.com/ecxfer/ecxfer/internal/procmem"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/internal/testhook"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/ring"
)

// The direct path: READs of a peer on this host whose region this process
// can see, without the engine.
//
// Where a copy happens: a READ of at most InlineBytes is copied by the
// caller inside Post, which returns a handle that is already DONE; a
// larger one goes through the submission ring like any READ, and the
// reactor hands it to the copy pool instead of the engine, so the reactor
// thread never copies a byte. What must stay serialized stays with the
// loop, whoever holds its engine token: the end of a READ on the copy
// workers and its notification (sent once the last chunk has landed,
// exactly once, over the producer's socket when it has one, else through
// the engine), published by the reactor thread or, while it sleeps, by
// the goroutine that copied the last chunk (endFinished); cancellation,
// peer removal and replacement, and the liveness watch (the peer's
// pidfd, in the reactor's epoll set) stay on the reactor thread.
//
// Lifetimes: a Direct's view is reference counted. Every copy holds a
// reference for its whole run, so removing, replacing or closing a peer
// unmaps nothing under a copy: new copies do not start, the chunks of a
// running one not yet started are skipped (failDirectReads), and the
// mapping goes when the last running chunk ends.
// A READ whose copy faults (the producer truncated its file) or finds the
// process gone ends in ErrRemoteDisconnect and marks the peer gone.

// Direct is a same-host peer's region as this process reaches it.
type Direct struct {
	adv   shmview.Advert
	view  *shmview.View     // nil for a kernel copy (KindProc)
	pidfd int               // the producer's process, open while refs > 0
	life  *lifeword.Watcher // the producer's lifeword, or nil; mapped while refs > 0
	// liveness is what Liveness reports, fixed when d is made.
	liveness string
	// dead: READs of this region fail, because the producer exited or a
	// copy faulted (it truncated its file). exitSeen: the producer
	// exited, so its notifications have nobody to go to; a producer
	// whose file was truncated still gets those of READs that were DONE.
	dead, exitSeen atomic.Bool
	// retired: the producer closed its transport (its lifeword says so).
	retired atomic.Bool
	// copyFailed is why an inline copy (on a caller's goroutine) found
	// the producer gone; the loop reports the peer dead with it.
	copyFailed atomic.Pointer[string]
	// refs counts the opener's reference and one per running copy or
	// liveness check; the view and the pidfd go when it drops to 0.
	refs atomic.Int64
	shut atomic.Bool
	// notify is the producer's notification socket (nil: it advertised
	// none, notifications go through the engine). The loop sends to it
	// with unix.Sendto, which writes into it as it encodes it, so callers
	// (sendNow) use notifyRaw, the same address encoded once, instead.
	notify       *unix.SockaddrUnix
	notifyRaw    unix.RawSockaddrUnix
	notifyRawLen uint32
	notifyKey    notifKey // what every datagram to notify starts with
}

// OpenDirect maps (or, for anonymous memory, prepares kernel copies of) an
// advertised region, and faults in the pages of descs, the peer's blocks
// (not the rest of the region). The advertised process must be alive.
func OpenDirect(adv *shmview.Advert, descs descriptors.List) (*Direct, error) {
	testhook.Run(&testhook.DirectOpened)
	fd, err := unix.PidfdOpen(int(adv.PID), unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open(%d): %w", adv.PID, err)
	}
	d := &Direct{adv: *adv, pidfd: fd}
	if lfd, ok := adv.LifeFD(); ok {
		// Looked up by pid: the start time checked below names the
		// process it belongs to. A word that cannot be watched (another
		// user's process, an older producer whose token matched the
		// tag by chance) leaves the pidfd to answer. A descriptor that
		// holds another holder's word now (the producer's transport
		// closed, and a new one of that process took the number) says
		// Retired.
		if w, err := lifeword.Watch(int(adv.PID), lfd, adv.LifeID()); err == nil {
			d.life = w
		}
	}
	// The pid could have been recycled before pidfd_open: the start time
	// read after it names the process the pidfd holds.
	if !adv.Alive() {
		d.closeLife()
		_ = unix.Close(fd)
		return nil, fmt.Errorf("process %d is not the advertised one", adv.PID)
	}
	d.refs.Store(1)
	if adv.Notify != 0 {
		name := shmview.NotifyAddr(adv.PID, adv.Notify)
		d.notify = &unix.SockaddrUnix{Name: name}
		d.notifyRaw, d.notifyRawLen = abstractAddr(name)
		d.notifyKey = adv.NotifyKey
	}
	if adv.Kind == shmview.KindProc && adv.Size > 0 {
		// Kernel copies need ptrace access to the producer (same user,
		// and Yama's ptrace_scope allowing it): find out now, so a peer
		// this process may not read stays on the engine path instead of
		// failing its READs.
		var b [1]byte
		if err := procmem.Copy(int(adv.PID), b[:], adv.Base); err != nil {
			d.closeLife()
			_ = unix.Close(fd)
			return nil, fmt.Errorf("kernel copy from process %d: %w", adv.PID, err)
		}
	}
	if adv.Kind != shmview.KindProc {
		if d.view, err = shmview.Open(adv); err != nil {
			d.closeLife()
			_ = unix.Close(fd)
			return nil, err
		}
		d.view.Populate(descs)
	}
	d.liveness = "pidfd"
	if d.life != nil {
		d.liveness = "lifeword"
	}
	return d, nil
}

// Path names how the peer is read: "direct-file", "direct-sysv" or
// "direct-proc".
func (d *Direct) Path() string { return "direct-" + d.adv.Kind.String() }

// Contains reports whether [addr, addr+n) lies in the advertised region.
func (d *Direct) Contains(addr, n uint64) bool { return d.adv.Contains(addr, n) }

// acquire takes a reference for a copy or a liveness check; it fails once
// Close has been called.
func (d *Direct) acquire() bool {
	for {
		n := d.refs.Load()
		if n <= 0 || d.shut.Load() {
			return false
		}
		if d.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// release drops a reference; the last one unmaps the view and closes the
// pidfd.
func (d *Direct) release() {
	switch n := d.refs.Add(-1); {
	case n == 0:
		if d.view != nil {
			d.view.Close()
		}
		d.closeLife()
		_ = unix.Close(d.pidfd)
	case n < 0:
		panic("reactor: Direct released more often than acquired")
	}
}

// Close stops new copies; the mapping and the pidfd go when the running
// copies end. The reactor calls it when the peer is dropped; an owner that
// never handed d to the reactor calls it itself. Idempotent.
func (d *Direct) Close() {
	if !d.shut.Swap(true) {
		d.release()
	}
}

func (d *Direct) closeLife() {
	if d.life != nil {
		d.life.Close()
		d.life = nil
	}
}

// Liveness names how READs of the peer learn that its process is alive:
// "lifeword" (a load of the producer's lifeword) or "pidfd" (a poll).
func (d *Direct) Liveness() string {
	// Fixed when d was made: d.life goes (without a lock) when the last
	// reference does, and any goroutine may ask.
	return d.liveness
}

// gone says whether the producer is gone, after the copy of every direct
// READ and before it is published: a READ is DONE only if its producer was
// alive, with its transport open, when its copy ended, so no READ reports
// what a dead producer left behind, or memory a producer no longer
// registers, as data. It returns errPeerExited or errPeerRetired, or nil.
// The producer's lifeword answers with a load when it has one (the kernel
// marks it before the pidfd turns readable; the producer retires it when
// it closes its transport, before it lets its region go); else its pidfd
// does: one poll(2), 0.2-2 µs here. The caller holds a reference.
func (d *Direct) gone() error {
	if d.dead.Load() {
		if d.retired.Load() && !d.exitSeen.Load() {
			return errPeerRetired
		}
		return errPeerExited
	}
	if d.life != nil {
		switch d.life.State() {
		case lifeword.Alive:
			return nil
		case lifeword.Died:
			d.exitSeen.Store(true)
			d.dead.Store(true)
			return errPeerExited
		case lifeword.Retired:
			// Not exitSeen: the process may still take the notifications
			// of READs that were DONE before (its teardown drains them).
			d.retired.Store(true)
			d.dead.Store(true)
			return errPeerRetired
		}
	}
	testhook.Run(&testhook.PidfdPoll)
	fds := [1]unix.PollFd{{Fd: int32(d.pidfd), Events: unix.POLLIN}}
	if n, _ := unix.Poll(fds[:], 0); n > 0 {
		d.exitSeen.Store(true)
		d.dead.Store(true)
		return errPeerExited
	}
	return nil
}

// readers are the batches of kernel copies; pooled so a READ allocates
// nothing.
var readers = sync.Pool{New: func() any { return procmem.NewReader(0) }}

// seg is one run of a direct READ: n bytes from src (an offset into the
// peer's region) to dst (an offset into the local region); at is the run's
// offset within the READ.
type seg struct {
	dst, src, n, at uint64
}

// copySeg copies bytes [a, b) of run g.
func (d *Direct) copySeg(local []byte, g seg, a, b uint64, rd *procmem.Reader) error {
	dst := local[g.dst+a : g.dst+b]
	if d.view == nil {
		rd.Add(dst, d.adv.Base+g.src+a)
		return nil
	}
	return shmview.Copy(dst, d.view.Bytes()[g.src+a:g.src+b])
}

// DirectOptions switch the direct path on for a reactor.
type DirectOptions struct {
	// Region is the local block memory; local descriptors are addresses
	// inside it.
	Region []byte
	// Pool runs the copies of READs larger than InlineBytes. The reactor
	// does not own it, but it never submits to it after Close.
	Pool *copypool.Pool
	// InlineBytes is the largest READ copied by the caller inside Post.
	InlineBytes int
	// Notify is this process's notification socket (ListenNotify), which
	// the reactor owns from now on; nil: notifications to this process
	// come through the engine. A socket not from ListenNotify, or one
	// already handed over, is refused with an error.
	Notify *NotifySocket
	// Name is this agent's name, the sender of its notifications.
	Name string
}

// direct is the reactor's direct-path state.
type direct struct {
	local  []byte
	base   uint64
	pool   *copypool.Pool
	inline uint64

	finished *ring.MPSC[*dirJob]   // jobs whose last chunk has landed
	notifQ   *ring.MPSC[*notifRec] // notifications of inline READs, due
	ns       *notifSock            // notifications to and from direct peers

	jobMu sync.Mutex // guards free and recs: callers take, the loop returns
	free  []*dirJob
	recs  []*notifRec

	// loop-only
	active []*dirJob
	held   []*dirJob // READs into local memory the engine fences (holdJob)
	// holding is len(held), for the reactor thread deciding whether to
	// nap on (napOn): only its turns release held READs.
	holding atomic.Int32
	// releaseHeldJobs looks at held again only when the engine's fences
	// (heldSeen: their version then), the timeout (heldTimeout) or a held
	// READ's release or peer (heldCheck) changed, or heldDue (the first
	// held READ's timeout, 0: none) has passed.
	heldSeen    uint64
	heldCheck   bool
	heldTimeout int64
	heldDue     int64
	watched     []*Peer // direct peers with a live pidfd
	// pidfdWoke: a park was woken by a watched peer's pidfd (pollPeers
	// then polls every pidfd, whatever the lifewords say).
	pidfdWoke bool
	pollFDs   []unix.PollFd
	polled    []*Peer // the peers of pollFDs, in order
	lastPoll  int64
	jobBuf    []*dirJob
	notifBuf  []*notifRec
	// overflow holds the notifications of inline READs that event
	// handlers posted, on this thread, while notifQ was full; they go
	// after what notifQ holds.
	overflow []*notifRec

	reads, inlineReads atomic.Uint64
	// inlining counts the Posts copying inline right now: they write the
	// local region, so teardown waits for them before the region goes.
	inlining atomic.Int64
}

// dirJob is one READ handed to the copy pool.
type dirJob struct {
	copypool.Job
	r    *Reactor
	h    uint64
	peer *Peer
	segs []seg
	// A READ between two block grids keeps copies of its index lists
	// instead of runs: its pair k is bytes [k*blk, (k+1)*blk) of the READ,
	// so a chunk finds its pairs by division and merges them as it copies.
	li, ri     []int
	blk        uint64 // the grids' block size; 0: the READ has runs (segs)
	ldst, rsrc uint64 // offsets of block 0 of each grid in its region
	notif      []byte
	total      uint64
	err        error
	idx        int  // position in active
	live       bool // counted in InFlight: the READ has not ended yet
	// running: handed to the pool and not yet ended, or held in
	// direct.held, nothing copied yet, until the engine's fences over its
	// local blocks lift (loop only).
	running bool
	// endCode: the READ was ended while its copy ran (its peer removed,
	// replaced or closed); it is published with this code once no chunk
	// of the copy can write the local region any more (loop only). stop
	// makes the chunks not yet started return at once.
	endCode uint64
	stop    atomic.Bool
}

// SetDirect enables the direct path. It must be called before the first
// Post and before any peer with a Direct is added; it runs on the reactor
// thread.
func (r *Reactor) SetDirect(o DirectOptions) error {
	n := len(r.tab.slots)
	d := &direct{
		local:    o.Region,
		base:     nixl.Addr(o.Region),
		pool:     o.Pool,
		inline:   uint64(max(o.InlineBytes, 0)),
		finished: ring.NewMPSC[*dirJob](2 * n),
		notifQ:   ring.NewMPSC[*notifRec](n),
		jobBuf:   make([]*dirJob, 64),
		notifBuf: make([]*notifRec, 64),
	}
	rfd := -1
	var key notifKey
	if o.Notify != nil {
		if rfd = o.Notify.take(); rfd < 0 {
			return errors.New("reactor: DirectOptions.Notify is not an open socket from ListenNotify")
		}
		key = o.Notify.Key
	}
	ns, err := newNotifSock(rfd, key, o.Name)
	if err != nil {
		if rfd >= 0 {
			_ = unix.Close(rfd)
		}
		return err
	}
	d.ns = ns
	err = r.do(func() error {
		if rfd >= 0 {
			ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(rfd)}
			if err := unix.EpollCtl(r.epollFD, unix.EPOLL_CTL_ADD, rfd, &ev); err != nil {
				return fmt.Errorf("reactor: epoll add notification socket: %w", err)
			}
		}
		r.dir = d
		return nil
	})
	if err != nil {
		ns.close()
	}
	return err
}

// isDirect reports whether a published peer uses d. Loop only.
func (r *Reactor) isDirect(d *Direct) bool {
	for _, p := range *r.peers.Load() {
		if p.direct == d {
			return true
		}
	}
	return false
}

// PeerPath names the path READs of a peer take: "engine", "direct-file",
// "direct-sysv" or "direct-proc"; "" for an unknown peer.
func (r *Reactor) PeerPath(name string) string {
	p := r.peer(name)
	switch {
	case p == nil:
		return ""
	case p.direct == nil || r.dir == nil:
		return "engine"
	}
	return p.direct.Path()
}

// PeerLiveness says how direct READs of a peer check that its process is
// alive ("lifeword" or "pidfd"); "" for a peer not read directly.
func (r *Reactor) PeerLiveness(name string) string {
	p := r.peer(name)
	if p == nil || p.direct == nil || r.dir == nil {
		return ""
	}
	return p.direct.Liveness()
}

// notifRec is an inline READ's notification on its way to the reactor. It
// does not live in the READ's slot: the handle is DONE, and may be
// released and its slot reused, before the reactor sends it.
type notifRec struct {
	peer *Peer
	msg  []byte
}

// postInline copies a small READ of a direct peer on the caller's
// goroutine. The slot is published DONE (or ERR) before it returns; a
// notification is queued for the reactor to send. If the reactor falls
// that far behind, the caller waits for room in the queue: notifications
// are dropped only when the transport closes meanwhile. A Post that finds
// the transport closing copies nothing and returns ErrClosed.
func (r *Reactor) postInline(h uint64, s *slot, p *Peer, localIdx, remoteIdx []int, notif []byte) (uint64, error) {
	d := r.dir
	w := s.word.Load()
	// Counted before closing is looked at, and teardown raises closing
	// before it waits for the count to drop: either this Post sees closing
	// and copies nothing, or teardown waits for its copy.
	d.inlining.Add(1)
	if r.closing.Load() {
		d.inlining.Add(-1)
		if !r.onLoop() {
			// The slot is this Post's to free, once the loop is gone.
			// (In an event handler, on the reactor thread, teardown has
			// not begun: it runs there once the handler returns.)
			<-r.done
		}
		r.tab.free(s, w)
		return 0, ErrClosed
	}
	defer d.inlining.Add(-1)
	code := p.gone.Load()
	if code == 0 {
		if err := r.copyInline(p, localIdx, remoteIdx); errors.Is(err, errPeerClosed) {
			// Removed or replaced since the check above (which set gone
			// before closing the view): the READ ends as the removal
			// says, and the producer is not taken for dead.
			if code = p.gone.Load(); code == 0 {
				code = codeCanceled
			}
		} else if err != nil {
			code = codeRemoteDisconnect
			why := err.Error()
			p.direct.copyFailed.CompareAndSwap(nil, &why)
			p.direct.dead.Store(true)
			p.gone.CompareAndSwap(0, codeRemoteDisconnect)
			r.wake() // the loop reports it (pollPeers)
		}
	}
	r.st.posted.Add(1) // its handle is returned, DONE or ERR
	if code != 0 {
		if code == codeCanceled {
			r.st.canceled.Add(1)
		} else {
			r.countFailed(p, code) // atomics only: safe off the loop
		}
		s.word.Store(w&^stateMask | code<<errShift | stErr)
		return h, nil
	}
	// Wholes before parts (Stats loads them the other way round).
	r.countDone(p, s.bytes)
	d.reads.Add(1)
	d.inlineReads.Add(1)
	r.st.latency.Add(time.Duration(r.now() - s.start))
	s.word.Store(w&^stateMask | stDone)
	if len(notif) > 0 {
		if r.sendNow(p, notif) {
			return h, nil
		}
		// The reactor sends it (and counts it sent then: sendInlineNotifs).
		p.notifsHeld.Add(1)
		rec := d.getRec()
		rec.peer = p
		rec.msg = append(rec.msg[:0], notif...)
		for !d.notifQ.TryPush(rec) {
			if r.onLoop() {
				// An event handler's Post, on the reactor thread, which
				// alone drains the queue: after what the queue holds,
				// in order (sendInlineNotifs).
				d.overflow = append(d.overflow, rec)
				break
			}
			if r.closing.Load() {
				// Teardown waits for this Post and no longer drains the
				// queue: the notification goes with the transport, counted
				// as one that waited and was dropped unsent.
				p.notifsHeld.Add(-1)
				r.st.notifsSent.Add(1)
				d.ns.undelivered.Add(1)
				d.putRec(rec)
				return h, nil
			}
			r.writeWake()
			runtime.Gosched()
		}
		r.wake()
	}
	return h, nil
}

// sendNowMax bounds the datagram a caller builds on its stack to send an
// inline READ's notification itself; vLLM's are about 100 bytes (a
// 36-character session id, a colon and a 64-character mm_hash).
const sendNowMax = 768

// sendNow sends an inline READ's notification to p's socket from the
// caller, without the hand-off to the reactor (which, idle between
// sporadic READs, can take tens of microseconds to run): only when the
// peer is live, has a socket, and has no notification held back that this
// one would overtake, and only when the socket takes it at once. It
// reports whether it sent it; if not, the caller queues it for the
// reactor as before.
func (r *Reactor) sendNow(p *Peer, msg []byte) bool {
	ns := r.dir.ns
	if p.gone.Load() != 0 || !ns.canSend(p, msg) || p.notifsHeld.Load() != 0 ||
		len(notifKey{})+2+len(ns.name)+4+len(msg) > sendNowMax {
		return false
	}
	var buf [sendNowMax]byte
	d := p.direct
	b := appendNotifDgram(buf[:0], &d.notifyKey, ns.name, msg)
	_, _, errno := unix.Syscall6(unix.SYS_SENDTO, uintptr(ns.sfd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)),
		unix.MSG_DONTWAIT, uintptr(unsafe.Pointer(&d.notifyRaw)), uintptr(d.notifyRawLen))
	if errno != 0 {
		return false // EAGAIN, or the producer is gone: the reactor deals with it
	}
	r.st.notifsSent.Add(1)
	return true
}

// abstractAddr encodes an abstract Unix socket address, "@name", as the
// kernel takes it: a NUL, the name, no terminating NUL.
func abstractAddr(name string) (unix.RawSockaddrUnix, uint32) {
	var sa unix.RawSockaddrUnix
	sa.Family = unix.AF_UNIX
	n := min(len(name), len(sa.Path))
	for i := 1; i < n; i++ {
		sa.Path[i] = int8(name[i])
	}
	return sa, uint32(2 + n)
}

// maxFreeRecs bounds the notification records kept for reuse: as many as
// the queue holds, so a reactor that lags does not make callers allocate.
const maxFreeRecs = 4096

func (d *direct) getRec() *notifRec {
	d.jobMu.Lock()
	defer d.jobMu.Unlock()
	if n := len(d.recs); n > 0 {
		rec := d.recs[n-1]
		d.recs[n-1] = nil
		d.recs = d.recs[:n-1]
		return rec
	}
	return &notifRec{}
}

func (d *direct) putRec(rec *notifRec) {
	rec.peer = nil
	if cap(rec.msg) > 8*slotKeep {
		rec.msg = nil
	}
	d.jobMu.Lock()
	if len(d.recs) < maxFreeRecs {
		d.recs = append(d.recs, rec)
	}
	d.jobMu.Unlock()
}

func (r *Reactor) copyInline(p *Peer, localIdx, remoteIdx []int) error {
	d, pd := r.dir, p.direct
	if !pd.acquire() {
		return errPeerClosed
	}
	defer pd.release()
	var rd *procmem.Reader
	if pd.view == nil {
		rd = readers.Get().(*procmem.Reader)
		rd.Reset(int(pd.adv.PID))
		defer readers.Put(rd)
	}
	loc := r.loc.Load()
	var run seg
	for i := range localIdx {
		la, ra, n := loc.pair(p, localIdx[i], remoteIdx[i])
		dst, src := la-d.base, ra-pd.adv.Base
		if run.n > 0 && run.dst+run.n == dst && run.src+run.n == src {
			run.n += n
			continue
		}
		if run.n > 0 {
			if err := pd.copySeg(d.local, run, 0, run.n, rd); err != nil {
				return err
			}
		}
		run = seg{dst: dst, src: src, n: n}
	}
	if run.n > 0 {
		if err := pd.copySeg(d.local, run, 0, run.n, rd); err != nil {
			return err
		}
	}
	if rd != nil {
		if err := rd.Read(); err != nil {
			return err
		}
	}
	return pd.gone()
}

var (
	errPeerClosed = errors.New("reactor: peer closed")
	// errCopyStopped is what the skipped chunks of a copy whose READ was
	// ended (failDirectReads) return.
	errCopyStopped = errors.New("reactor: copy stopped")
	// errPeerExited ends a direct READ whose producer was found dead when
	// its copy ended: what was copied may be what a dying producer left
	// half written, so the READ is not reported DONE.
	errPeerExited = errors.New("process exited")
	// errPeerRetired ends a direct READ whose producer had closed its
	// transport when its copy ended: its region may hold anything now.
	errPeerRetired = errors.New("closed its transport")
)

// newJob builds the copy of a READ of a direct peer, with its runs merged.
// Caller side, before the handle is published. Jobs are reused through the
// reactor's free list (not a sync.Pool, which a GC empties: a fresh job
// grows its runs again), so a READ allocates nothing.
func (r *Reactor) newJob(h uint64, p *Peer, loc *local, localIdx, remoteIdx []int, notif []byte) *dirJob {
	d := r.dir
	var j *dirJob
	d.jobMu.Lock()
	if n := len(d.free); n > 0 {
		j = d.free[n-1]
		d.free[n-1] = nil
		d.free = d.free[:n-1]
	}
	d.jobMu.Unlock()
	if j == nil {
		j = &dirJob{r: r}
		j.Run = j.run
		j.Done = j.done
	}
	j.h, j.peer, j.err, j.endCode = h, p, nil, 0
	j.stop.Store(false)
	j.notif = append(j.notif[:0], notif...)
	j.build(loc, p, localIdx, remoteIdx, d.base, p.direct.adv.Base)
	return j
}

// dropJob recycles the job of a READ that ends before its copy started.
// Loop only.
func (r *Reactor) dropJob(s *slot) {
	if j := s.job; j != nil {
		s.job = nil
		j.recycle()
	}
}

// maxFreeJobs bounds the free list: more large READs in flight than this
// at once is rare, and each job keeps its runs.
const maxFreeJobs = 256

func (j *dirJob) recycle() {
	j.peer, j.err, j.running, j.live = nil, nil, false, false
	j.segs = j.segs[:0]
	if cap(j.segs) > 1<<14 {
		j.segs = nil
	}
	j.li, j.ri = j.li[:0], j.ri[:0]
	if cap(j.li) > 1<<14 || cap(j.ri) > 1<<14 {
		j.li, j.ri = nil, nil
	}
	if cap(j.notif) > 8*slotKeep {
		j.notif = nil
	}
	d := j.r.dir
	d.jobMu.Lock()
	if len(d.free) < maxFreeJobs {
		d.free = append(d.free, j)
	}
	d.jobMu.Unlock()
}

// submitDirect hands a READ of a direct peer to the copy pool. Loop only.
func (r *Reactor) submitDirect(h uint64, s *slot, p *Peer) {
	d := r.dir
	if !p.direct.acquire() {
		r.dropJob(s)
		s.trim()
		r.fail(h, s, codeRemoteDisconnect)
		return
	}
	j := s.job
	s.trim()
	j.idx = len(d.active)
	d.active = append(d.active, j)
	j.live, j.running = true, true
	r.inflight.Add(1)
	s.run.Store(&j.Job)
	d.pool.Submit(&j.Job, int(j.total))
}

// fencing reports whether the engine fences local memory now: late data
// of an engine READ that ended with requests outstanding may still land
// there (nixl.LocalFencer). Any goroutine.
func (r *Reactor) fencing() bool { return r.fencer != nil && r.fencer.Fencing() }

// inlineFenced reports whether a READ into localIdx may write memory the
// engine fences. Caller side: one atomic load while nothing is fenced.
func (r *Reactor) inlineFenced(loc *local, localIdx []int) bool {
	if !r.fencing() {
		return false
	}
	for _, i := range localIdx {
		if d := loc.descs[i]; r.fencer.Fenced(d.Addr, d.Len) {
			return true
		}
	}
	return false
}

// jobFenced reports whether one of j's local blocks is fenced.
func (r *Reactor) jobFenced(j *dirJob) bool {
	base := r.dir.base
	if j.blk != 0 {
		for _, l := range j.li {
			if r.fencer.Fenced(base+j.ldst+uint64(l)*j.blk, j.blk) {
				return true
			}
		}
		return false
	}
	for _, g := range j.segs {
		if r.fencer.Fenced(base+g.dst, g.n) {
			return true
		}
	}
	return false
}

// holdJob keeps a direct READ into fenced local memory in flight, copying
// nothing, until the fences over it lift: copied now, its blocks could
// still be overwritten by the late data of the engine READ that left the
// fence. It then goes to the copy workers (releaseHeldJobs). It counts as
// running, so that a release leaves its end to releaseHeldJobs. Loop only.
func (r *Reactor) holdJob(j *dirJob) {
	j.running, j.live = true, true
	r.inflight.Add(1)
	r.dir.held = append(r.dir.held, j)
	r.dir.holding.Store(int32(len(r.dir.held)))
	r.dir.heldCheck = true // its timeout is not in heldDue yet
	if r.napping.Load() {
		// Held by a caller's step: only the thread's turns release held
		// READs, and it would nap on while callers step in.
		r.writeWake()
	}
}

// releaseHeldJobs hands the held READs no fence covers any more to the
// copy workers, oldest first, and ends those released, timed out or whose
// peer has gone. It reports whether it did anything. Loop only.
func (r *Reactor) releaseHeldJobs() bool {
	d := r.dir
	t := r.timeout.Load()
	v := r.fencer.FenceVersion()
	if v == d.heldSeen && !d.heldCheck && t == d.heldTimeout && (d.heldDue == 0 || r.lastTime < d.heldDue) {
		// Nothing that could end or free a held READ has happened since
		// the last look: a turn costs this, not a look at every block.
		return false
	}
	d.heldSeen, d.heldCheck, d.heldTimeout, d.heldDue = v, false, t, 0
	testhook.Run(&testhook.HeldLook)
	keep := d.held[:0]
	timedOut, first := 0, ""
	for _, j := range d.held {
		s, w := r.tab.lookup(j.h)
		switch {
		case j.stop.Load() || s == nil || s.job != j || wordState(w) != stProc:
			r.endHeld(j, j.endCode) // released (or ended by its peer's removal)
		case j.peer.gone.Load() != 0:
			r.endHeld(j, j.peer.gone.Load())
		case t > 0 && r.lastTime-s.start >= t:
			if timedOut == 0 {
				first = j.peer.Name
			}
			timedOut++
			r.endHeld(j, codeTimeout)
		case r.fencing() && r.jobFenced(j):
			keep = append(keep, j)
			if t > 0 {
				// Its timeout, from its post; a t meant as "never" does
				// not wrap.
				due := s.start + min(t, math.MaxInt64-s.start)
				if d.heldDue == 0 || due < d.heldDue {
					d.heldDue = due
				}
			}
		default:
			j.running, j.live = false, false
			r.inflight.Add(-1) // submitDirect counts it again
			r.submitDirect(j.h, s, j.peer)
		}
	}
	did := len(keep) != len(d.held)
	clear(d.held[len(keep):])
	d.held = keep
	d.holding.Store(int32(len(keep)))
	r.logTimeouts(timedOut, first)
	return did
}

// endReleased ends a released direct READ whose copy has stopped or never
// started (s.job already nil): counted canceled; its slot is freed here
// only once onCancel has drained the release's entry, otherwise onCancel
// frees it, so a slot never has two cancel entries on the ring. Loop only.
func (r *Reactor) endReleased(s *slot, w uint64) {
	r.st.canceled.Add(1)
	s.trim()
	if s.cancelDrained {
		s.cancelDrained = false
		r.tab.free(s, w)
		r.ended = true // a Wait blocked on the handle must see it gone
	}
}

// endHeld ends a held READ, nothing of it copied: with code if its slot is
// still the READ's and in flight; a released one is counted canceled and
// its slot freed (or left to onCancel, as endJob does). The caller takes j
// out of direct.held. Loop only.
func (r *Reactor) endHeld(j *dirJob, code uint64) {
	j.running = false
	if j.live {
		j.live = false
		r.inflight.Add(-1)
	}
	if s, w := r.tab.lookup(j.h); s != nil && s.job == j {
		s.job = nil
		switch wordState(w) {
		case stCanceling:
			r.endReleased(s, w)
		case stProc:
			if code == 0 {
				code = codeCanceled
			}
			s.trim()
			r.fail(j.h, s, code)
		}
	}
	j.recycle()
}

// build turns the index lists into merged runs.
func (j *dirJob) build(loc *local, p *Peer, li, ri []int, base, rbase uint64) {
	j.segs = j.segs[:0]
	if loc.isGrid && p.isGrid {
		// Two copies of the index lists, not a run per pair: after a large
		// READ the runs' memory is out of the cache, and writing 880 runs
		// cost the caller more than the rest of PostRead.
		j.li, j.ri = append(j.li[:0], li...), append(j.ri[:0], ri...)
		j.blk = loc.grid.Len
		j.ldst, j.rsrc = loc.grid.Base-base, p.grid.Base-rbase
		j.total = uint64(len(li)) * j.blk
		return
	}
	j.li, j.ri, j.blk = j.li[:0], j.ri[:0], 0
	var at uint64
	for i := range li {
		la, ra, n := loc.pair(p, li[i], ri[i])
		dst, src := la-base, ra-rbase
		if k := len(j.segs) - 1; k >= 0 && j.segs[k].dst+j.segs[k].n == dst && j.segs[k].src+j.segs[k].n == src {
			j.segs[k].n += n
		} else {
			j.segs = append(j.segs, seg{dst: dst, src: src, n: n, at: at})
		}
		at += n
	}
	j.total = at
}

func (j *dirJob) run(lo, hi int) error {
	testhook.Run(&testhook.DirectChunk)
	if j.stop.Load() {
		return errCopyStopped
	}
	if s, w := j.r.tab.lookup(j.h); s == nil || wordState(w) == stCanceling {
		// Released: Release marks the slot before the loop hears of it
		// (and sets stop), so the chunks not started yet are skipped from
		// the moment the caller released the READ.
		return errCopyStopped
	}
	d, pd := j.r.dir, j.peer.direct
	a, b := uint64(lo), uint64(hi)
	// The first run that ends after a.
	i, k := 0, len(j.segs)
	for i < k {
		m := int(uint(i+k) >> 1)
		if g := j.segs[m]; g.at+g.n > a {
			k = m
		} else {
			i = m + 1
		}
	}
	var rd *procmem.Reader
	if pd.view == nil {
		rd = readers.Get().(*procmem.Reader)
		rd.Reset(int(pd.adv.PID))
		defer readers.Put(rd)
	}
	if j.blk != 0 {
		if err := j.copyGrid(pd, d.local, a, b, rd); err != nil {
			return err
		}
	}
	for ; i < len(j.segs) && j.segs[i].at < b; i++ {
		g := j.segs[i]
		from, to := max(a, g.at)-g.at, min(b, g.at+g.n)-g.at
		if err := pd.copySeg(d.local, g, from, to, rd); err != nil {
			return err
		}
	}
	if rd != nil {
		return rd.Read()
	}
	return nil
}

// copyGrid copies bytes [a, b) of a grid READ, one copy per run of pairs
// contiguous on both sides.
func (j *dirJob) copyGrid(pd *Direct, local []byte, a, b uint64, rd *procmem.Reader) error {
	L := j.blk
	var run seg
	for k := a / L; k < uint64(len(j.li)) && k*L < b; k++ {
		from, to := max(a, k*L)-k*L, min(b, (k+1)*L)-k*L
		dst := j.ldst + uint64(j.li[k])*L + from
		src := j.rsrc + uint64(j.ri[k])*L + from
		if run.n > 0 && run.dst+run.n == dst && run.src+run.n == src {
			run.n += to - from
			continue
		}
		if run.n > 0 {
			if err := pd.copySeg(local, run, 0, run.n, rd); err != nil {
				return err
			}
		}
		run = seg{dst: dst, src: src, n: to - from}
	}
	if run.n > 0 {
		return pd.copySeg(local, run, 0, run.n, rd)
	}
	return nil
}

// copyNapBytes is how many bytes the READs on the copy workers must add
// up to for the idle reactor thread to sleep in copyNap instead of
// spinning, yielding or parking beside them, where the goroutine that
// finishes a copy may not publish its end (endFinished: the engine does
// not allow other threads, or Options.ReactorOnly). A copy nap then ends
// by waking a goroutine, which took 54-108 µs on average on this 2-core
// VM after the last chunk of a 4.5 MB READ (880 x 5,120 B) had landed,
// against 19-43 µs for a thread still spinning or yielding there (an
// instrumented build, polling callers); at 8 MiB the copy itself takes
// about half a millisecond or more. Where the finisher publishes, the
// thread naps beside any copy: nothing waits for it to wake.
const copyNapBytes = 8 << 20

// copyNapMax bounds a copy nap: the engine's events and the direct
// path's notification socket are not watched meanwhile.
const copyNapMax = time.Millisecond

// copyNapWanted reports whether READs are on the copy workers (adding up
// to copyNapBytes unless their finishers publish their ends) and nothing
// else needs the loop: no engine READ in flight, no READ held behind a
// fence, no notification waiting to be sent again. Loop only.
func (r *Reactor) copyNapWanted() bool {
	d := r.dir
	if d == nil || len(d.active) == 0 || r.pLen != 0 || len(d.held) != 0 || len(d.ns.backlog) != 0 {
		return false
	}
	if r.helpable {
		return true
	}
	var n uint64
	for _, j := range d.active {
		if n += j.total; n >= copyNapBytes {
			return true
		}
	}
	return false
}

// copyNap is the reactor thread asleep while READs are copied: it gives
// up the token and blocks its goroutine, so its P is free for the copy
// workers and the caller at once, until the last chunk of a copy lands
// (done wakes it unless its finisher published the end itself,
// endFinished, and anything pushed to the rings wakes it unless a Post
// steps in and submits its READ itself, help.go) or for copyNapMax (or
// until something is due sooner: parkMillis). A thread
// that spins or yields keeps its P (it is locked to its thread), and one
// asleep in epoll_wait keeps it until Go's sysmon takes it back and then
// has to win one back to publish the copy's end. With as many Ps as
// cores (2), the workers and a polling caller shared one P while the
// reactor thread spun and yielded (its first millisecond), and the
// thread woken from epoll_wait published the end of a 880 x 32 KiB copy
// 156-176 µs after its last chunk had landed. The napping flag is
// raised before the last look at the rings, as nap does.
func (r *Reactor) copyNap() {
	r.napping.Store(true)
	// A wake-up sent as an earlier nap ended must not end this one.
	select {
	case <-r.napWake:
	default:
	}
	d := r.dir
	if r.sub.Len() > 0 || r.cancel.Len() > 0 || r.ctrl.Len() > 0 || d.finished.Len() > 0 || d.notifQ.Len() > 0 || len(d.overflow) > 0 {
		r.napping.Store(false)
		return
	}
	r.st.parks.Add(1)
	r.sleepNapping(min(time.Duration(r.parkMillis())*time.Millisecond, copyNapMax), 0)
}

// done is called by whoever finished the last chunk: a copy worker, or a
// caller that copied it while it checked or waited (copypool.Job.Help).
func (j *dirJob) done(err error) {
	j.err = err
	r := j.r
	for !r.dir.finished.TryPush(j) {
		// The ring has two places per slot; it fills only if the reactor
		// stopped draining, which it does not while jobs are active.
		time.Sleep(10 * time.Microsecond)
	}
	if r.endFinished() {
		return
	}
	r.wake()
}

// endFinished publishes the ends of the finished copies on the calling
// goroutine, the one that finished the last chunk of one, if the engine
// token is free: the reactor thread is asleep (copyNap, a park or a nap)
// and would otherwise have to be woken first, which took 54-108 µs on
// this 2-core VM (copyNapBytes). Under the token the finisher is the loop
// (help.go): it sends the queued inline notifications first, as
// drainDirect does, then ends every finished copy and wakes the callers
// blocked in Wait. Only where callers may step in (a notification may go
// through the engine), and never while the reactor thread waits for the
// token. It reports whether it published them.
func (r *Reactor) endFinished() bool {
	if !r.helpable || r.wantEngine.Load() || !r.engine.CompareAndSwap(false, true) {
		return false
	}
	if r.stop {
		// Unreachable while the token is free (the loop stops holding
		// it), kept as step keeps it.
		r.unlockEngine()
		return false
	}
	d := r.dir
	r.sendInlineNotifs()
	r.endJobs()
	if r.ended {
		r.ended = false
		r.broadcast()
	}
	retry := len(d.ns.backlog) > 0 || len(d.held) > 0
	r.st.finisherEnds.Add(1)
	r.unlockEngine()
	if r.wantEngine.Load() || retry {
		// The reactor thread waits for the token (lockEngine), or has
		// notifications to send again that a long park would leave.
		r.writeWake()
	}
	return true
}

// drainDirect finishes the READs whose copies ended and sends the
// notifications of inline READs. Loop only. It reports whether it did
// anything.
func (r *Reactor) drainDirect() bool {
	d := r.dir
	work := false
	// The inline READs' notifications first: those READs were DONE before
	// the loop took them, so their producers hear of them before of the
	// pool copies that end now.
	if r.sendInlineNotifs() {
		work = true
	}
	if r.endJobs() {
		work = true
	}
	if r.notifSocket() {
		work = true
	}
	if len(d.watched) > 0 && (r.lastTime-d.lastPoll >= int64(time.Millisecond)) {
		d.lastPoll = r.lastTime
		if r.pollPeers() {
			work = true
		}
	}
	return work
}

// endJobs publishes the ends of the copies on the finished ring and
// reports whether there were any. Loop only.
func (r *Reactor) endJobs() bool {
	d := r.dir
	work := false
	for {
		n := d.finished.Drain(d.jobBuf)
		if n == 0 {
			return work
		}
		work = true
		for _, j := range d.jobBuf[:n] {
			r.endJob(j)
		}
		clear(d.jobBuf[:n])
	}
}

// endJob publishes the end of a pool copy. Loop only.
func (r *Reactor) endJob(j *dirJob) {
	d := r.dir
	last := d.active[len(d.active)-1]
	last.idx = j.idx
	d.active[j.idx] = last
	d.active = d.active[:len(d.active)-1]
	if j.live {
		j.live = false
		r.inflight.Add(-1)
	}
	p := j.peer
	if j.err == nil && j.endCode == 0 {
		// Checked after the copy, not when it was posted: a READ is DONE
		// only if its producer outlived the whole copy. (The caller's
		// Post does not pay the check; the reactor does, once per job.)
		j.err = p.direct.gone()
	}
	p.direct.release()
	h := j.h
	// A slot still PROC or CANCELING under h is the READ's own (nobody
	// else may free it); otherwise the READ ended already (its peer was
	// dropped) and the slot may belong to someone else.
	s, w := r.tab.lookup(h)
	if s != nil && (wordState(w) == stProc || wordState(w) == stCanceling) && s.job == j {
		s.job = nil
		s.run.Store(nil)
		switch wordState(w) {
		case stCanceling:
			r.endReleased(s, w)
		case stProc:
			if code := j.endCode; code != 0 {
				// Ended by failDirectReads; published only now that the
				// copy no longer writes the READ's local blocks.
				if code == codeCanceled {
					r.st.canceled.Add(1)
				} else {
					r.countFailed(p, code)
				}
				s.trim()
				r.finish(h, s, code)
			} else if errors.Is(j.err, copypool.ErrClosed) {
				// The pool was closed before this reactor (an embedder's
				// order; a Transport closes the reactor first): nothing
				// is wrong with the producer.
				r.countFailed(p, codeClosed)
				s.trim()
				r.finish(h, s, codeClosed)
			} else if j.err != nil {
				p.direct.dead.Store(true)
				p.gone.CompareAndSwap(0, codeRemoteDisconnect)
				r.peerDead(p, j.err.Error())
				r.countFailed(p, codeRemoteDisconnect)
				s.trim()
				r.finish(h, s, codeRemoteDisconnect)
			} else {
				// Nothing of the slot may be touched once it is published:
				// take out what the counters need, publish, and notify only
				// if the READ was published DONE, not released meanwhile.
				// The message is the job's.
				// The notification counts as held from before DONE is
				// published until it is sent or in the backlog: a caller
				// that sees this READ DONE and posts an inline one must not
				// send that one's notification ahead of this one's.
				bytes, notify := s.bytes, s.hasNotif
				took := time.Duration(r.now() - s.start)
				s.trim()
				if notify {
					p.notifsHeld.Add(1)
				}
				if !r.finish(h, s, codeNone) {
					r.st.canceled.Add(1)
				} else {
					r.readDone(p, bytes, took, false, nil)
					d.reads.Add(1) // after the whole it is part of
					testhook.Run(&testhook.AfterDirectDone)
					if notify {
						r.sendDoneNotif(p, j.notif)
					}
				}
				if notify {
					p.notifsHeld.Add(-1)
				}
			}
		}
	}
	j.recycle()
}

// failDirectReads ends p's READs still copying with code, and returns how
// many. A copy cannot be stopped mid-chunk, and until its last chunk
// returns it writes the READ's local blocks: were the READ published ERR
// now, its caller could release it and read other data into those blocks,
// which the old copy would then overwrite. So the chunks not yet started
// are skipped, and endJob publishes the READ with code when the copy has
// stopped: after the chunks already running, each at most 256 KiB or an
// eighth of the READ, whichever is larger, with two copy workers (see
// copypool.Pool.Chunks). Loop only.
func (r *Reactor) failDirectReads(p *Peer, code uint64) int {
	if r.dir == nil {
		return 0
	}
	n := 0
	for _, j := range r.dir.active {
		if j.peer != p || j.endCode != 0 {
			continue
		}
		if s, w := r.tab.lookup(j.h); s != nil && wordState(w) == stProc && s.job == j {
			j.endCode = code
			j.stop.Store(true)
			n++
		}
	}
	// Held READs have copied nothing: they end now.
	keep := r.dir.held[:0]
	for _, j := range r.dir.held {
		if j.peer != p {
			keep = append(keep, j)
			continue
		}
		if s, w := r.tab.lookup(j.h); s != nil && wordState(w) == stProc && s.job == j {
			n++
		}
		r.endHeld(j, code)
	}
	clear(r.dir.held[len(keep):])
	r.dir.held = keep
	r.dir.holding.Store(int32(len(keep)))
	return n
}

// watchPeer adds a direct peer's pidfd to the liveness watch. Loop only.
func (r *Reactor) watchPeer(p *Peer) {
	if p.direct == nil {
		return
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p.direct.pidfd)}
	_ = unix.EpollCtl(r.epollFD, unix.EPOLL_CTL_ADD, p.direct.pidfd, &ev)
	r.dir.watched = append(r.dir.watched, p)
}

// unwatchPeer takes p off the watch and closes its Direct. Loop only.
func (r *Reactor) unwatchPeer(p *Peer) {
	if p.direct == nil {
		return
	}
	if d := r.dir; d != nil {
		for i, q := range d.watched {
			if q == p {
				d.watched = append(d.watched[:i], d.watched[i+1:]...)
				break
			}
		}
	}
	_ = unix.EpollCtl(r.epollFD, unix.EPOLL_CTL_DEL, p.direct.pidfd, nil)
	p.direct.Close()
}

// pollPeers checks the watched peers' lifewords, or where a word cannot
// tell, their pidfds; a dead one is marked
// gone: READs posted from now on fail with ErrRemoteDisconnect, copies
// already running finish from the mapping. Loop only.
func (r *Reactor) pollPeers() bool {
	d := r.dir
	for _, p := range d.watched {
		if why := p.direct.copyFailed.Load(); why != nil && !p.deadLogged {
			r.peerDead(p, *why)
		}
	}
	// A peer whose lifeword says it is alive needs no poll: with every
	// peer's word alive (a consumer of many same-host producers) a turn
	// makes no system call here.
	d.pollFDs, d.polled = d.pollFDs[:0], d.polled[:0]
	var dead, retired []*Peer
	// A pidfd that woke the thread is one whose process exited, whatever
	// its word says: a word that stays alive (a foreign or broken
	// producer's, never marked by the kernel) hid the exit, and the pidfd,
	// readable from then on in the epoll set, kept the thread from ever
	// parking again.
	force := d.pidfdWoke
	d.pidfdWoke = false
	for _, p := range d.watched {
		if w := p.direct.life; w != nil {
			switch w.State() {
			case lifeword.Alive:
				if force {
					break // poll its pidfd below
				}
				continue
			case lifeword.Died:
				dead = append(dead, p)
				continue
			case lifeword.Retired:
				retired = append(retired, p)
				continue
			}
		}
		d.pollFDs = append(d.pollFDs, unix.PollFd{Fd: int32(p.direct.pidfd), Events: unix.POLLIN})
		d.polled = append(d.polled, p)
	}
	if len(d.pollFDs) > 0 {
		testhook.Run(&testhook.PidfdPoll)
		if n, err := unix.Poll(d.pollFDs, 0); err == nil && n > 0 {
			for i, p := range d.polled {
				if d.pollFDs[i].Revents != 0 {
					dead = append(dead, p)
				}
			}
		}
	}
	clear(d.polled)
	if len(dead)+len(retired) == 0 {
		return false
	}
	kept := d.watched[:0]
	for _, p := range d.watched {
		if !slices.Contains(dead, p) && !slices.Contains(retired, p) {
			kept = append(kept, p)
		}
	}
	clear(d.watched[len(kept):])
	d.watched = kept
	for _, p := range dead {
		p.direct.exitSeen.Store(true)
		r.unwatch(p, errPeerExited)
	}
	// A producer that closed its transport is gone as one that exited
	// is, but for its notifications: the process may still take them
	// (they go on over its socket while it is open, counted undelivered
	// once it is not). Its exit is no longer watched.
	for _, p := range retired {
		p.direct.retired.Store(true)
		r.unwatch(p, errPeerRetired)
	}
	return true
}

// unwatch ends a direct peer found gone by pollPeers: its READs fail from
// now on, and its pidfd leaves the epoll set. Loop only.
func (r *Reactor) unwatch(p *Peer, why error) {
	p.direct.dead.Store(true)
	p.gone.CompareAndSwap(0, codeRemoteDisconnect)
	_ = unix.EpollCtl(r.epollFD, unix.EPOLL_CTL_DEL, p.direct.pidfd, nil)
	r.peerDead(p, why.Error())
}

// waitDirect waits until no copy is running (teardown: the local region
// is about to go). Loop only.
func (r *Reactor) waitDirect() {
	if r.dir == nil {
		return
	}
	for r.dir.inlining.Load() > 0 {
		time.Sleep(20 * time.Microsecond)
	}
	for len(r.dir.active) > 0 {
		if n := r.dir.finished.Drain(r.dir.jobBuf); n > 0 {
			for _, j := range r.dir.jobBuf[:n] {
				r.endJob(j)
			}
			clear(r.dir.jobBuf[:n])
			continue
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// notify sends p a READ's notification: over the notification socket when
// p is a direct peer that has one, through the engine otherwise. Loop only.
func (r *Reactor) notify(p *Peer, msg []byte) error {
	if d := r.dir; d != nil && d.ns.canSend(p, msg) {
		return d.ns.send(p, msg)
	}
	return r.agent.SendNotif(p.Name, msg)
}

// notifSocket retries the notifications the socket refused and, every
// notifRecvEvery (at once after a park), delivers the notifications that
// arrived. Loop only. It reports whether it did anything.
func (r *Reactor) notifSocket() bool {
	ns := r.dir.ns
	work := false
	if len(ns.backlog) > 0 {
		sent, failed := ns.flush()
		work = sent || failed > 0
		for range failed {
			r.engineError("notify", errNotifGone)
		}
	}
	r.notifSockErrors(int(ns.badByCaller.Swap(0)), int(ns.keylessByCaller.Swap(0)))
	if ns.rfd < 0 || r.lastTime-ns.lastRecv < notifRecvEvery {
		return work
	}
	ns.lastRecv = r.lastTime
	if !ns.recvMu.TryLock() {
		return work // a caller is draining it (drainNotifSocket)
	}
	got, bad, keyless := ns.recv(r.deliverNotif)
	over := ns.takeOversized()
	ns.recvMu.Unlock()
	r.logOversizedNotifs(over)
	r.notifSockErrors(bad, keyless)
	if got > 0 {
		r.ended = true // wake WaitNotifs
		return true
	}
	return work
}

var errNotifGone = errors.New("reactor: the peer's notification socket is gone")

// logOversizedNotifs logs the oversized notifications a drain of the
// socket dropped (logOversized: once per sender).
func (r *Reactor) logOversizedNotifs(over []oversizedNotif) {
	for _, o := range over {
		r.logOversized(o.sender, o.n)
	}
}

// notifSockErrors reports the datagrams the socket dropped as engine
// errors.
func (r *Reactor) notifSockErrors(bad, keyless int) {
	if bad > 0 {
		r.engineError("notification socket", fmt.Errorf("%w (%d)", errNotifDgram, bad))
	}
	if keyless > 0 {
		r.engineError("notification socket", fmt.Errorf("%w (%d)", errNotifKey, keyless))
	}
}

// drainNotifSocket delivers the notifications waiting in the socket, from
// the caller's thread: a caller of Notifs sees a notification as soon as
// it has arrived, without waiting for the reactor to wake up and read it
// (on this VM a wake-up costs tens of microseconds, most of a
// notification's latency). It costs one recvfrom when the socket is empty.
func (r *Reactor) drainNotifSocket() {
	d := r.dir
	if d == nil {
		return
	}
	ns := d.ns
	ns.recvMu.Lock()
	if ns.rfd >= 0 {
		_, bad, keyless := ns.recv(r.deliverNotif)
		if bad > 0 {
			ns.badByCaller.Add(int64(bad))
		}
		if keyless > 0 {
			ns.keylessByCaller.Add(int64(keyless))
		}
	}
	over := ns.takeOversized()
	ns.recvMu.Unlock()
	r.logOversizedNotifs(over)
}

// deliverNotif hands a notification from the socket to NewNotifs, after
// the same MaxNotif check as the engine's. The caller holds recvMu: an
// oversized notification is logged once it has let go
// (logOversizedNotifs), as a log handler may call NewNotifs, which takes
// recvMu (it used to be logged here, and such a handler hung the reactor
// thread for good).
func (r *Reactor) deliverNotif(sender string, msg []byte) {
	if len(msg) > r.opts.MaxNotif {
		r.st.notifsOversized.Add(1)
		if r.ev.log != nil {
			ns := r.dir.ns
			ns.oversized = append(ns.oversized, oversizedNotif{sender, len(msg)})
		}
		return
	}
	r.notifMu.Lock()
	// Not copied when it would be dropped.
	kept := r.notifHeld+len(msg) <= MaxHeldNotifBytes
	if kept {
		r.holdNotif(sender, append([]byte(nil), msg...))
	} else {
		r.st.notifsUntaken.Add(1)
	}
	r.notifMu.Unlock()
	if kept {
		r.st.notifsReceived.Add(1)
	}
}

// sendQueuedNotifs sends the notifications of inline READs that callers
// queued, if the direct path is on. Loop only.
func (r *Reactor) sendQueuedNotifs() {
	if r.dir != nil {
		r.sendInlineNotifs()
	}
}

// sendInlineNotifs sends the notifications of inline READs that callers
// queued. Loop only. It reports whether there were any.
func (r *Reactor) sendInlineNotifs() bool {
	d := r.dir
	work := false
	for {
		n := d.notifQ.Drain(d.notifBuf)
		if n == 0 {
			break
		}
		work = true
		for i, rec := range d.notifBuf[:n] {
			r.sendInlineRec(rec)
			d.notifBuf[i] = nil
		}
	}
	// Then those event handlers posted while the queue was full (a
	// handler called by the sends above may add more: taken in the next
	// round).
	for len(d.overflow) > 0 {
		work = true
		recs := d.overflow
		d.overflow = nil
		for _, rec := range recs {
			r.sendInlineRec(rec)
		}
	}
	return work
}

// sendInlineRec sends one queued notification of an inline READ and
// recycles its record. Loop only.
func (r *Reactor) sendInlineRec(rec *notifRec) {
	d := r.dir
	// The READ was DONE: its producer is told even if the peer was
	// removed or replaced since, as long as the message goes over the
	// socket, whose address names that very process. Through the engine
	// it would go by name, which may already stand for a new incarnation;
	// and a producer that exited has nobody to tell.
	p := rec.peer
	switch {
	case p.gone.Load() == 0:
		// It waited: counted sent, and undelivered if it cannot go (the
		// producer closed its socket but lives on, or was not yet seen to
		// have exited), as below.
		r.st.notifsSent.Add(1)
		if err := r.notify(p, rec.msg); err != nil {
			d.ns.undelivered.Add(1)
			r.engineError("notify", err)
		}
	case d.ns.canSend(p, rec.msg) && !p.direct.exitSeen.Load():
		// Removed since, or its copies fault (it truncated its file): the
		// process may still be there to tell.
		r.st.notifsSent.Add(1)
		if err := d.ns.send(p, rec.msg); err != nil {
			d.ns.undelivered.Add(1) // counted sent, never went out
			r.engineError("notify", err)
		}
	default:
		// The producer exited, or (removed since) the notification cannot
		// go over its socket and the engine would send it by a name that
		// may stand for another process now.
		r.st.notifsSent.Add(1)
		d.ns.undelivered.Add(1)
	}
	// Sent, dropped, or now counted in the backlog (send and queue count
	// it there before this).
	p.notifsHeld.Add(-1)
	d.putRec(rec)
}

// flushNotifs sends the queued notifications of inline READs and retries
// the socket's backlog until it is empty (entries of producers that
// exited are dropped) or limit has passed. Loop only (teardown).
func (r *Reactor) flushNotifs(limit time.Duration) {
	if r.dir == nil {
		return
	}
	r.sendInlineNotifs()
	ns := r.dir.ns
	deadline := time.Now().Add(limit)
	for len(ns.backlog) > 0 {
		if _, failed := ns.flush(); failed > 0 {
			for range failed {
				r.engineError("notify", errNotifGone)
			}
		}
		if len(ns.backlog) == 0 || time.Now().After(deadline) {
			return
		}
		time.Sleep(50 * time.Microsecond)
	}
}
