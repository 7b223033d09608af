package reactor

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/testhook"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/ring"
)

// State of a transfer as CheckXferState reports it.
type State uint8

const (
	// StateProc: posted, not finished.
	StateProc State = iota
	// StateDone: every byte landed.
	StateDone
	// StateErr: failed, canceled or timed out.
	StateErr
)

// Peer is a remote agent the reactor can read from. Its fields are fixed
// once published; gone is set when the peer is removed or replaced.
type Peer struct {
	Name  string
	Descs descriptors.List

	grid   descriptors.Grid // Descs as a grid, when isGrid
	isGrid bool

	dlist nixl.DlistID
	gone  atomic.Uint64 // 0 while usable; else the error code its reads end with

	direct *Direct // set when READs bypass the engine (same host)

	deadLogged bool // loop only: EventPeerDead was logged
	// backlogged: loop only, this peer's entries in the notification
	// socket's backlog; while there are any, its new ones queue behind.
	// backlogMsgs: the notifications in them (at most maxBacklogMsgs).
	backlogged  int
	backlogMsgs int64
	// notifsHeld counts this peer's notifications waiting for the reactor
	// (in the inline queue or the socket's backlog). A caller sends an
	// inline READ's notification itself only while it is 0, so none
	// overtakes one held back.
	notifsHeld atomic.Int64
	// pc are the counters of the peer's name: a peer that replaces one
	// of its name (restarted, or a new block list) takes them over, so
	// they never go down while the name stays known, and READs of the
	// replaced peer that end after the swap count there too.
	pc *peerCounters
	// dead: a READ from this peer failed because it disconnected, or its
	// process was seen to exit (PeerStat.State); not taken over.
	dead atomic.Bool
}

type local struct {
	descs  descriptors.List
	dlist  nixl.DlistID
	grid   descriptors.Grid // descs as a grid, when isGrid
	isGrid bool
}

// pair returns the local and remote addresses of a READ's pair (li, ri)
// and its length; the indices were validated. With both lists grids it is
// arithmetic: no block list is read.
func (loc *local) pair(p *Peer, li, ri int) (la, ra, n uint64) {
	if loc.isGrid && p.isGrid {
		return loc.grid.Addr(li), p.grid.Addr(ri), loc.grid.Len
	}
	return loc.descs[li].Addr, p.Descs[ri].Addr, loc.descs[li].Len
}

// bytes returns the length of a READ into the local blocks localIdx
// (validated).
func (loc *local) bytes(localIdx []int) uint64 {
	if loc.isGrid {
		return uint64(len(localIdx)) * loc.grid.Len
	}
	var n uint64
	for _, i := range localIdx {
		n += loc.descs[i].Len
	}
	return n
}

type ctrlOp struct {
	fn   func() error
	done chan error
}

// posting is one transfer handed to the engine: its handle and when it was
// posted.
type posting struct {
	h      uint64
	posted int64
}

// Reactor owns one nixl.Agent on one locked OS thread and runs the event
// loop described in the package documentation.
type Reactor struct {
	agent nixl.Agent
	opts  Options
	tab   *table
	epoch time.Time

	dropper nixl.NotifDropper  // agent, if it counts notifications it lost; else nil
	gathers nixl.GatherCounter // agent, if it gathers READs; else nil
	// armBusy: the engine refused to arm at the last park, and no turn
	// since found work (park naps only then). Loop only.
	armBusy bool
	// fencer: agent, if it may still write local memory after a READ into
	// it has ended (late data of a cancelled READ); direct READs into such
	// memory are held (heldJobs). Else nil.
	fencer nixl.LocalFencer
	// undeliverer: agent, if it counts notifications it dropped unsent;
	// else nil.
	undeliverer nixl.NotifUndeliverer

	sub    *ring.MPSC[uint64] // handles of new transfers
	cancel *ring.MPSC[uint64] // handles released while in flight
	ctrl   *ring.MPSC[*ctrlOp]

	wakeFD   int
	epollFD  int
	sleeping atomic.Bool
	// The engine token (help.go): held by the reactor thread whenever it
	// is not idle, and by a caller taking a step of its work. napping:
	// the reactor thread stands aside for helping callers; helpWant: when
	// a caller last wanted to help (r.now()); helpable: the engine allows
	// callers to drive it and ReactorOnly is off.
	engine atomic.Bool
	// wantEngine: the reactor thread waits for the token; callers do not
	// step in meanwhile.
	wantEngine atomic.Bool
	// lockSleeps counts lockEngine's sleeps (for tests).
	lockSleeps atomic.Int64
	napping    atomic.Bool
	// napWake wakes a napping reactor thread (nap); napTimer ends its nap
	// (the loop thread's).
	napWake    chan struct{}
	napTimer   *time.Timer
	helpWant   atomic.Int64
	helpHandle atomic.Uint64 // the READ of the last wish
	crowdAt    atomic.Int64  // when two READs were last seen polled or posted at once
	streak     atomic.Int32  // wishes in a row, each within helpGap of the last (up to helpStreak)
	helpable   bool
	helpMax    int64 // callers step in while at most this many READs are in flight or queued
	crowdMin   int64 // polling callers may sleep while more than this many READs are in flight or queued (crowd.go)
	// fdsClosed and fdUsers keep callers from writing wakeFD once
	// closeFDs closes it (see writeWake).
	fdsClosed atomic.Bool
	fdUsers   atomic.Int32
	closing   atomic.Bool
	done      chan struct{}

	peers atomic.Pointer[map[string]*Peer]
	// final is the peers as teardown found them, for PeerStats after Close.
	final    atomic.Pointer[map[string]*Peer]
	loc      atomic.Pointer[local]
	timeout  atomic.Int64 // ns; 0 = none
	inflight atomic.Int64

	notifMu sync.Mutex
	notifs  map[string][][]byte
	// notifHeld is the bytes of the messages in notifs (MaxHeldNotifBytes
	// at most).
	notifHeld int

	// Callers blocked in Wait and WaitNotifs: each parks on a channel of
	// its own, reused through waiterPool, and broadcast signals every
	// registered one, so waking them allocates nothing.
	waitMu   sync.Mutex
	waitList []*waiter
	waiters  atomic.Int32
	// notifWaiters counts the callers in WaitNotifs: a nap for callers
	// that step in does not go on past napTurn while there are any
	// (napOn), since only the thread's turns read the notification socket.
	notifWaiters atomic.Int32

	st  counters
	ev  events
	tid atomic.Int32 // the reactor thread's id, once it runs
	// finalCPU is the thread's CPU time in ns, stored as it exits.
	finalCPU atomic.Int64
	cpuHigh  atomic.Int64 // the highest figure ThreadCPU returned
	dir      *direct      // nil unless SetDirect enabled the direct path

	// Loop-only state.
	stop     bool
	ended    bool // a transfer left PROC or a notification arrived since the last broadcast
	xfers    map[nixl.XferID]uint64
	postings []posting // ring buffer, ordered by post time; see expire
	pHead    int
	pLen     int
	batch    []uint64
	comps    []nixl.Completion
	ctrlBuf  []*ctrlOp
	notifTmp map[string][][]byte
	lastTime int64
	// postClock is the time postings are stamped with: the current turn's
	// or caller step's start.
	postClock int64
	lastWork  bool // the last turn found work (its time counts as busy)
}

// Setup prepares the agent's local memory: it registers the block memory
// and returns the descriptor list of the local blocks and the prepared list
// that names them. Start runs it on the reactor's thread before the loop
// takes any work. Without a Setup (nil) the reactor has no local blocks and
// Post fails.
type Setup func(a nixl.Agent) (descriptors.List, nixl.DlistID, error)

// Start checks opts, launches the reactor on agent and runs setup on the
// reactor's thread. From then on the agent is driven by that thread, or,
// one at a time, by callers stepping in for it (Options.ReactorOnly), and
// Close closes it. When Start fails the reactor thread has exited and
// the agent has not been closed: the caller still owns it.
func Start(agent nixl.Agent, opts Options, setup Setup) (*Reactor, error) {
	if agent == nil {
		return nil, errors.New("reactor: no agent")
	}
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Reactor{
		napWake: make(chan struct{}, 1),
		agent:   agent,
		opts:    o,
		tab:     newTable(o.Handles),
		epoch:   time.Now(),
		dropper: dropper(agent),
		gathers: gatherCounter(agent),
		fencer: func() nixl.LocalFencer {
			f, _ := agent.(nixl.LocalFencer)
			return f
		}(),
		undeliverer: func() nixl.NotifUndeliverer {
			u, _ := agent.(nixl.NotifUndeliverer)
			return u
		}(),
		sub:      ring.NewMPSC[uint64](o.SubmitRing),
		ctrl:     ring.NewMPSC[*ctrlOp](64),
		done:     make(chan struct{}),
		notifs:   map[string][][]byte{},
		xfers:    make(map[nixl.XferID]uint64, 1024),
		batch:    make([]uint64, o.BatchSize),
		comps:    make([]nixl.Completion, 256),
		ctrlBuf:  make([]*ctrlOp, 16),
		notifTmp: map[string][][]byte{},
		wakeFD:   -1,
		epollFD:  -1,
		ev:       events{log: o.Logger},
	}
	// A canceling slot is freed only by onCancel, as it drains the slot's
	// entry, so each slot has at most one entry on the ring at a time: a
	// ring with a place per slot is never full.
	r.cancel = ring.NewMPSC[uint64](len(r.tab.slots))
	r.postings = make([]posting, len(r.tab.slots))
	empty := map[string]*Peer{}
	r.peers.Store(&empty)
	if err := r.openFDs(); err != nil {
		r.closeFDs()
		return nil, err
	}
	if a, ok := agent.(nixl.AnyThread); ok && a.AnyThread() && !o.ReactorOnly {
		r.helpable = true
		r.helpMax = int64(max(1, runtime.GOMAXPROCS(0)/2))
	}
	r.crowdMin = int64(2 * runtime.GOMAXPROCS(0))
	r.helpWant.Store(math.MinInt64 / 2)
	r.crowdAt.Store(math.MinInt64 / 2)
	ready := make(chan error, 1)
	go r.run(ready, setup)
	if err := <-ready; err != nil {
		<-r.done
		r.closeFDs()
		return nil, err
	}
	return r, nil
}

func (r *Reactor) openFDs() error {
	var err error
	if r.wakeFD, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC); err != nil {
		return fmt.Errorf("reactor: eventfd: %w", err)
	}
	if r.epollFD, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return fmt.Errorf("reactor: epoll_create1: %w", err)
	}
	add := func(fd int) error {
		ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}
		if err := unix.EpollCtl(r.epollFD, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
			return fmt.Errorf("reactor: epoll_ctl(%d): %w", fd, err)
		}
		return nil
	}
	if err := add(r.wakeFD); err != nil {
		return err
	}
	if efd := r.agent.EventFD(); efd >= 0 {
		return add(efd)
	}
	return nil
}

// closeFDs closes the epoll set and the wake-up eventfd once the loop has
// ended. Callers that got past the closing check may still be about to
// write the eventfd (see writeWake): it waits for them, and any that come
// later see fdsClosed and skip the write, so nobody writes a closed
// descriptor, whose number may already name another file.
func (r *Reactor) closeFDs() {
	r.fdsClosed.Store(true)
	for r.fdUsers.Load() != 0 {
		runtime.Gosched()
	}
	if r.epollFD >= 0 {
		_ = unix.Close(r.epollFD)
		r.epollFD = -1
	}
	if r.wakeFD >= 0 {
		_ = unix.Close(r.wakeFD)
		r.wakeFD = -1
	}
}

// now is monotonic nanoseconds since Start.
func (r *Reactor) now() int64 { return int64(time.Since(r.epoch)) }

// wake makes a parked reactor return from epoll_wait, or a napping one
// from its nap.
func (r *Reactor) wake() {
	if r.sleeping.Load() || r.napping.Load() {
		r.writeWake()
	}
}

// writeWake wakes a napping reactor thread (napWake) and writes the
// wake-up eventfd unless closeFDs has begun. The fd is written even for a
// napping thread: its nap may be ending, with a park or a wait for the
// token next (which a nap's wake-up left on the fd ends early, once).
// Users announce themselves before they look at fdsClosed, and closeFDs
// sets it before it counts users: with sequentially consistent atomics at
// least one of the two sees the other.
func (r *Reactor) writeWake() {
	if r.napping.Load() {
		select {
		case r.napWake <- struct{}{}:
		default: // one is pending already
		}
	}
	r.fdUsers.Add(1)
	if !r.fdsClosed.Load() {
		var one = [8]byte{1}
		_, _ = unix.Write(r.wakeFD, one[:])
	}
	r.fdUsers.Add(-1)
}

// ----------------------------------------------------------------------------
// Caller side.

// do runs fn on the reactor thread and returns its result, or ErrClosed
// once the reactor has stopped.
func (r *Reactor) do(fn func() error) error {
	if r.onLoop() {
		return ErrReactorThread
	}
	op := &ctrlOp{fn: fn, done: make(chan error, 1)}
	for !r.ctrl.TryPush(op) {
		select {
		case <-r.done:
			return ErrClosed
		default:
			runtime.Gosched()
		}
	}
	r.writeWake()
	select {
	case err := <-op.done:
		return err
	case <-r.done:
		select {
		case err := <-op.done:
			return err
		default:
			return ErrClosed
		}
	}
}

// SetTimeout sets the age after which an in-flight transfer ends in
// ErrTimeout; 0 or a negative d disables it. A change applies at once to every transfer in
// flight, each measured from its post.
func (r *Reactor) SetTimeout(d time.Duration) {
	r.timeout.Store(int64(d))
	r.wake() // a parked loop computed its sleep from the old timeout
}

// Post queues a READ of remoteIdx blocks of peer into localIdx blocks and
// returns its handle. It validates everything first and posts nothing on
// error. It never waits for data; it waits for room only with
// Options.WaitWhenBusy.
func (r *Reactor) Post(peer string, localIdx, remoteIdx []int, notif []byte) (uint64, error) {
	if r.closing.Load() && r.onLoop() {
		// Its teardown is under way on this very thread: a Post would
		// wait for the loop to end (see below).
		return 0, ErrClosed
	}
	p, loc, err := r.checkPost(peer, localIdx, remoteIdx, notif)
	if err != nil {
		return 0, err
	}
	testhook.Run(&testhook.PostChecked)
	h, s, err := r.claim()
	if err != nil {
		return 0, err
	}
	// The word claim stored (state CLAIMED): the slot is this Post's alone
	// while it fills in the request, since State and Release refuse a
	// CLAIMED handle. An inline READ leaves it so until it publishes the
	// end; a queued one is set PROC just before its handle goes on the
	// ring (queued, below).
	claimed := r.tab.claimedWord(h)
	s.start = r.now()
	s.polled.Store(0)
	s.parkEnd.Store(0)
	s.peer = p
	s.queued = true
	s.hasNotif = len(notif) > 0
	bytes := loc.bytes(localIdx)
	s.bytes = bytes
	if p.direct != nil && r.dir != nil {
		// Whether the producer still lives is checked when the copy ends
		// (copyInline, endJob), not here.
		if bytes <= r.dir.inline && !r.inlineFenced(loc, localIdx) {
			// Copied here and now: the index lists are not kept. (A READ
			// into local memory the engine fences goes to the reactor,
			// which holds it: holdJob.)
			return r.postInline(h, s, p, localIdx, remoteIdx, notif)
		}
		// The copy's runs and the notification go with the job (jobs are
		// few and reused; slots are many); the reactor hands it to the
		// copy workers.
		s.job = r.newJob(h, p, loc, localIdx, remoteIdx, notif)
		s.pooled.Store(true)
	} else {
		s.job = nil
		if s.pooled.Load() {
			s.pooled.Store(false)
		}
		s.notif = fillMsg(s.notif, notif)
		setIdx(&s.localIdx, &s.homeLocal, localIdx)
		setIdx(&s.remoteIdx, &s.homeRemote, remoteIdx)
	}

	// From here the request is written and the handle is a queued READ's:
	// on every error path Post frees exactly this word; a slot that
	// meanwhile holds another word (Close ended the transfer, a caller
	// released the handle, another Post claimed the freed slot) is not
	// its to free.
	queued := claimed&^stateMask | stProc
	s.word.Store(queued)
	for tries := 0; !r.sub.TryPush(h); tries++ {
		var err error
		if r.opts.WaitWhenBusy {
			err = r.waitForRoom(tries)
		} else {
			err = r.busy("submission ring full (%d)", r.sub.Cap())
		}
		if err != nil {
			testhook.Run(&testhook.PushRefused)
			if s.word.CompareAndSwap(queued, claimed) {
				s.job = nil
				r.tab.free(s, claimed)
			} else {
				// Released by a caller who had not been given the handle
				// (only a guess reaches it before Post returns): its
				// cancel entry is queued, and the reactor frees the slot
				// and counts it canceled, so it counts as posted too.
				r.st.posted.Add(1)
				if r.closing.Load() && !r.onLoop() {
					// Unless the entry came after Close's teardown had
					// taken the last ones (see endClosed). (On the
					// reactor thread, in an event handler, teardown has
					// not begun: it runs there next and frees the slot.)
					<-r.done
					r.endClosed(s, queued)
				}
			}
			return 0, err
		}
	}
	if !r.napping.Load() || !r.help(h, true) || r.sub.Len() > 0 {
		// (A reactor thread napping for callers that step in: this one
		// posts what is queued itself, unless another holds the engine.)
		r.wake()
	}
	if r.closing.Load() && r.onLoop() {
		// An event handler's Post, and Close began meanwhile: its
		// teardown, which runs on this thread once the handler returns,
		// has not begun, and will end this READ with ErrClosed (waiting
		// for the loop to end here would wait for ever).
		r.st.posted.Add(1)
		return h, nil
	}
	if r.closing.Load() {
		// Close has begun, and its teardown may have drained the ring
		// before this push. Once the loop is gone, either teardown ended
		// the transfer and freed its slot, or the handle sits on a ring
		// nobody drains and the slot still holds the queued word: ours
		// to free.
		<-r.done
		if !r.endClosed(s, queued) {
			// Teardown ended it (and counted it failed or canceled), or
			// a caller who guessed the handle released it after
			// teardown and endClosed counted it canceled: posted too,
			// so that every READ counted ended was counted posted.
			r.st.posted.Add(1)
		}
		return 0, ErrClosed
	}
	// Counted once the handle is the caller's: every READ counted here
	// ends counted once more, as done, failed or canceled (possibly a
	// moment before this line: the loop may have taken it already).
	r.st.posted.Add(1)
	return h, nil
}

// endClosed is a Post's last look at its slot once the loop is gone,
// with queued the word it stored: it frees the slot if it still holds
// that word (nobody saw the READ: it reports true, and nothing is
// counted) or that word released (a caller who guessed the handle released it
// after Close's teardown had taken the last cancel entries and freed the
// last slots: nobody else will count or free it, so endClosed counts it
// canceled). Any other word is not Post's to touch: teardown ended the
// READ and counted it, or freed it (and counted it) and another Post has
// claimed the slot since.
func (r *Reactor) endClosed(s *slot, queued uint64) (unseen bool) {
	released := queued&^stateMask | stCanceling
	for {
		switch w := s.word.Load(); w {
		case queued:
			s.job = nil
			if r.tab.free(s, queued) {
				return true
			}
			// Released meanwhile: look again.
		case released:
			s.job = nil
			if r.tab.free(s, released) {
				r.st.canceled.Add(1)
			}
			return false
		default:
			return false
		}
	}
}

// checkPost validates a Post's request and returns the peer and the local
// blocks it names.
func (r *Reactor) checkPost(peer string, localIdx, remoteIdx []int, notif []byte) (*Peer, *local, error) {
	if r.closing.Load() {
		return nil, nil, ErrClosed
	}
	p := (*r.peers.Load())[peer]
	if p == nil {
		if r.closing.Load() {
			// Close began after the look above, and its teardown has
			// dropped the peers: the transport is what is gone.
			return nil, nil, ErrClosed
		}
		return nil, nil, wrapf(ErrUnknownPeer, "%s (not added with AddRemotePeer, or removed since)", QuoteName(peer))
	}
	loc := r.loc.Load()
	if loc == nil {
		return nil, nil, wrapf(ErrClosed, "no local memory registered")
	}
	if len(localIdx) == 0 && len(remoteIdx) == 0 {
		return nil, nil, wrapf(ErrIndexRange, "empty index lists")
	}
	var err error
	if loc.isGrid && p.isGrid {
		err = descriptors.ValidateGrid(loc.grid, p.grid, localIdx, remoteIdx)
	} else {
		err = descriptors.ValidateIndices(loc.descs, p.Descs, localIdx, remoteIdx)
	}
	if err != nil {
		switch {
		case errors.Is(err, descriptors.ErrIndexMismatch):
			return nil, nil, wrapf(ErrIndexMismatch, "%d local, %d remote", len(localIdx), len(remoteIdx))
		case errors.Is(err, descriptors.ErrIndexRange):
			return nil, nil, fmt.Errorf("%w: %v", ErrIndexRange, err)
		default:
			return nil, nil, fmt.Errorf("%w: %v", ErrBadDescriptor, err)
		}
	}
	if len(notif) > r.opts.MaxNotif {
		return nil, nil, wrapf(ErrBadNotif, "%d bytes (limit %d)", len(notif), r.opts.MaxNotif)
	}
	return p, loc, nil
}

// claim takes a free slot for a new transfer. Without a free slot it
// returns ErrBusy, or with Options.WaitWhenBusy waits for one.
func (r *Reactor) claim() (uint64, *slot, error) {
	for tries := 0; ; tries++ {
		if h, s := r.tab.claim(); s != nil {
			return h, s, nil
		}
		if !r.opts.WaitWhenBusy {
			return 0, nil, r.busy("handle table full (%d slots)", len(r.tab.slots))
		}
		if err := r.waitForRoom(tries); err != nil {
			return 0, nil, err
		}
	}
}

// busy counts a refused Post and returns its ErrBusy.
func (r *Reactor) busy(format string, n int) error {
	r.st.busyRefusals.Add(1)
	return wrapf(ErrBusy, format, n)
}

// Backoff of a Post waiting for room (see waitForRoom).
const (
	roomYields   = 16
	roomMinSleep = time.Microsecond
	roomMaxSleep = time.Millisecond
)

// waitForRoom pauses a Post that found no free slot or no room on the
// submission ring, with Options.WaitWhenBusy; tries counts the pauses so
// far. Room is made by Release (a slot) and by the reactor (it drains the
// ring and frees canceling slots), and the reactor never sleeps while
// either ring holds entries (see park), so there is nobody to wake: the
// waiter yields the processor a few times, then sleeps for doubling
// intervals up to roomMaxSleep. It returns ErrClosed once Close has begun.
func (r *Reactor) waitForRoom(tries int) error {
	if r.closing.Load() {
		return ErrClosed
	}
	if tries == 0 && r.onLoop() {
		return ErrReactorThread // only the thread makes room
	}
	if tries < roomYields {
		runtime.Gosched()
		testhook.Run(&testhook.RoomWait)
		return nil
	}
	time.Sleep(min(roomMinSleep<<min(tries-roomYields, 20), roomMaxSleep))
	if r.closing.Load() {
		return ErrClosed
	}
	testhook.Run(&testhook.RoomWait)
	return nil
}

// State reports a transfer's state with one atomic load. For a direct
// READ still on the copy pool it first copies one chunk that no worker has
// taken (copypool.Job.HelpOne), so polling callers copy instead of
// starving the workers, and a call copies at most one chunk (a READ is
// cut into at most 4 per copy worker); with every chunk taken it yields
// the processor to the threads copying them (sched_yield). For an engine
// READ in flight it first takes a step of the engine's work if the
// reactor thread is not in a turn and the engine allows it
// (Options.ReactorOnly), so polling callers progress the engine instead
// of spinning beside the reactor; among many READs in flight, a caller
// that polls one in a loop may sleep until some READ ends (crowd.go).
func (r *Reactor) State(h uint64) (State, error) {
	st, _, err := r.state(h, true)
	return st, err
}

// state is State; helped reports whether it copied a chunk. A caller
// about to block passes mayStep false: it takes no step of the engine's
// work, which would make the reactor thread nap for it (help.go).
func (r *Reactor) state(h uint64, mayStep bool) (State, bool, error) {
	if r.closing.Load() {
		return StateErr, false, ErrClosed
	}
	s, w := r.tab.lookup(h)
	if s == nil {
		return StateErr, false, r.badHandle()
	}
	helped := false
	if wordState(w) == stProc {
		if j := s.run.Load(); j != nil {
			// A direct READ on the copy pool: copy what no worker has
			// started yet rather than spend this caller's turn in the
			// scheduler while the workers wait for a CPU.
			if !j.HelpOne() {
				// Every chunk is taken: give the CPU to the threads
				// copying them. A polling caller's thread that only
				// yields its goroutine keeps the core (nothing else is
				// runnable in this process), and on a machine with as
				// many busy threads as cores a worker that lost its
				// core mid-chunk waited out the caller's time slice
				// (see README, Tuning).
				schedYield()
				return StateProc, false, nil
			}
			// The chunk may have been the last, and this caller may have
			// published the READ's end itself (endFinished).
			helped = true
			if s, w = r.tab.lookup(h); s == nil {
				return StateErr, true, r.badHandle()
			}
		} else {
			if !mayStep || s.pooled.Load() {
				return StateProc, false, nil
			}
			if !r.help(h, false) {
				// Among many READs in flight, a caller polling this one
				// in a loop sleeps until some READ ends (crowd.go).
				r.crowdCheck(h, s)
				return StateProc, false, nil
			}
			// An engine READ, and this caller took a step of the engine's
			// work for the reactor (help.go): it may have ended.
			if s, w = r.tab.lookup(h); s == nil {
				return StateErr, false, r.badHandle()
			}
		}
	}
	switch wordState(w) {
	case stProc:
		return StateProc, helped, nil
	case stDone:
		return StateDone, helped, nil
	case stErr:
		return StateErr, helped, codeErrs[wordCode(w, r.tab.mask)]
	}
	return StateErr, helped, r.badHandle() // canceling: the handle was released
}

// badHandle is the error for a handle the table does not hold: ErrClosed
// once Close has begun, since its teardown frees the slots of finished
// READs (a caller that looked at closing just before may find its handle
// gone), else ErrBadHandle.
func (r *Reactor) badHandle() error {
	if r.closing.Load() {
		return ErrClosed
	}
	return ErrBadHandle
}

// Release frees a handle. A finished transfer's slot is freed at once; an
// in-flight one is canceled by the reactor, and Release returns once it
// has been (awaitStopped): for a direct READ on the copy pool once its
// copy has stopped, so nothing writes its local blocks afterwards; for an
// engine READ once the loop has released it in the engine, so the fence
// its late data needs (nixl.LocalFencer) is up by then, and a READ posted
// next reaches the engine after the release. A second release of the
// same handle returns ErrBadHandle.
func (r *Reactor) Release(h uint64) error {
	if r.closing.Load() {
		return ErrClosed
	}
	for {
		s, w := r.tab.lookup(h)
		if s == nil {
			return r.badHandle()
		}
		switch wordState(w) {
		case stDone, stErr:
			if r.tab.free(s, w) {
				return nil
			}
		case stProc:
			if s.word.CompareAndSwap(w, w&^stateMask|stCanceling) {
				// The slot stays canceling until onCancel drains this
				// entry and frees it, so it has no other entry on the ring
				// and the ring, with a place per slot, has room.
				if !r.cancel.TryPush(h) {
					panic("reactor: cancel ring full: a slot was freed before its cancel entry was drained")
				}
				r.wake()
				// A direct READ: its copy stops first. An engine READ: the
				// loop releases it in the engine first, so a READ posted
				// next into those blocks reaches the engine after that
				// release: an engine that fences the memory a cancelled
				// READ's late data may land in (nixl.LocalFencer) has the
				// fence up, which even a READ the caller copies itself
				// sees, and one that holds later READs into such memory
				// on its own (the nixl engine) knows of the released one.
				// Without the wait, a Post right after could be submitted
				// in a turn that had drained the cancels before this one.
				// On the reactor thread itself (a control operation, an
				// event handler) it would wait for itself: there the next
				// turn takes the cancel before any READ posted after it.
				if !r.onLoop() {
					r.awaitStopped(h)
				}
				return nil
			}
		default:
			return r.badHandle() // canceling: released already
		}
	}
}

// onLoop reports whether the caller runs on the reactor thread (its
// goroutine is locked to it, so no other goroutine runs there).
func (r *Reactor) onLoop() bool { return int32(unix.Gettid()) == r.tid.Load() }

// PeerLive reports whether a peer of that name is published and not
// known to be gone.
func (r *Reactor) PeerLive(name string) bool {
	p := r.peer(name)
	return p != nil && p.gone.Load() == 0
}

// OnThread reports whether the caller runs on the reactor's own thread:
// in an event handler (Options.Logger).
func (r *Reactor) OnThread() bool { return r.onLoop() }

// awaitStopped returns once the released READ h no longer holds
// the slot: a direct READ's copy writes its local blocks until it stops,
// and the slot is freed only then (endJob, onCancel). The chunks already
// running finish; onCancel has the rest skipped. For an engine READ it
// returns once onCancel has released it (and the engine fenced what its
// late data may still write).
func (r *Reactor) awaitStopped(h uint64) {
	w := r.addWaiter(false)
	defer r.dropWaiter(w)
	for {
		if s, word := r.tab.lookup(h); s == nil || wordState(word) != stCanceling {
			return
		}
		select {
		case <-w.ch:
		case <-r.done:
			return
		}
	}
}

// Wait blocks until the transfer leaves StateProc or ctx ends. For the first
// Options.WaitSpin it checks the transfer's state between yields of the
// processor; after that it sleeps until the reactor reports a transfer
// ended. Each check may copy a chunk of a direct READ (see State); Wait
// then checks again at once, and returns ctx's error if ctx ended
// meanwhile. While it spins, a check of an engine READ may take a step of
// the engine's work (see State); once it sleeps, none does. A nil ctx is
// context.Background().
func (r *Reactor) Wait(ctx context.Context, h uint64) error {
	if ctx == nil {
		ctx = context.Background()
	}
	var start time.Time
	for i := 0; ; i++ {
		st, helped, err := r.state(h, true)
		if st != StateProc {
			return err
		}
		// Read the clock on every 16th check only: a check is a few
		// nanoseconds, a clock read tens.
		if i == 0 {
			start = time.Now()
		}
		if helped {
			// A chunk copied here takes its time: ctx may have ended
			// meanwhile, and there may be more to copy.
			if err := ctx.Err(); err != nil {
				return err
			}
			continue
		}
		if i%16 == 0 && i > 0 {
			// ctx too: WaitSpin has no upper bound, and a caller's
			// deadline must not wait for it.
			if err := ctx.Err(); err != nil {
				return err
			}
			if time.Since(start) >= r.opts.WaitSpin {
				break
			}
		}
		runtime.Gosched()
	}
	if r.onLoop() {
		return ErrReactorThread // nothing would end the READ meanwhile
	}
	r.st.waitBlocks.Add(1)
	// This caller stops stepping in: a reactor thread napping for it
	// takes over now.
	r.unhelp()
	w := r.addWaiter(false)
	defer r.dropWaiter(w)
	for {
		st, helped, err := r.state(h, false)
		if st != StateProc {
			return err
		}
		if helped {
			if err := ctx.Err(); err != nil {
				return err
			}
			continue
		}
		select {
		case <-w.ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-r.done:
			return ErrClosed
		}
	}
}

// waiter is one blocked caller's wake-up channel (one place), and the
// timer of a polling caller that sleeps among many (crowdCheck).
type waiter struct {
	ch    chan struct{}
	t     *time.Timer
	crowd bool // a polling caller asleep in crowdCheck
}

var waiterPool = sync.Pool{New: func() any { return &waiter{ch: make(chan struct{}, 1)} }}

// addWaiter registers a blocked caller. It must check its condition after
// this and before it blocks: a change published before broadcast ran is
// then seen by the check, one published after it by broadcast.
func (r *Reactor) addWaiter(crowd bool) *waiter {
	w := waiterPool.Get().(*waiter)
	w.crowd = crowd
	r.waiters.Add(1)
	r.waitMu.Lock()
	r.waitList = append(r.waitList, w)
	r.waitMu.Unlock()
	return w
}

// dropWaiter unregisters w and returns it to the pool with its channel
// empty: no broadcast can signal it once it is off the list.
func (r *Reactor) dropWaiter(w *waiter) {
	r.waitMu.Lock()
	for i, x := range r.waitList {
		if x == w {
			last := len(r.waitList) - 1
			r.waitList[i] = r.waitList[last]
			r.waitList[last] = nil
			r.waitList = r.waitList[:last]
			break
		}
	}
	r.waitMu.Unlock()
	r.waiters.Add(-1)
	select {
	case <-w.ch:
	default:
	}
	waiterPool.Put(w)
}

// Notifs hands out the notifications received since the last call. The map
// is never nil.
func (r *Reactor) Notifs() map[string][][]byte {
	r.drainNotifSocket()
	r.notifMu.Lock()
	defer r.notifMu.Unlock()
	if len(r.notifs) == 0 {
		return map[string][][]byte{}
	}
	out := r.notifs
	r.notifs = map[string][][]byte{}
	r.notifHeld = 0
	return out
}

// MaxHeldNotifBytes bounds the received notifications that wait for
// Notifs or WaitNotifs, in bytes of their messages: a transport that never
// takes them (or takes them too rarely for what arrives) drops the newest
// beyond it, counted in Stats.NotifsUntaken, instead of growing without
// bound. vLLM's notifications are about 100 bytes: 64 MiB holds 600,000.
var MaxHeldNotifBytes = 64 << 20

// holdNotif adds msg from sender to what waits for Notifs, or drops it
// (counted) when MaxHeldNotifBytes would be passed. The caller holds
// notifMu. It reports whether msg was kept.
func (r *Reactor) holdNotif(sender string, msg []byte) bool {
	if r.notifHeld+len(msg) > MaxHeldNotifBytes {
		r.st.notifsUntaken.Add(1)
		return false
	}
	r.notifHeld += len(msg)
	r.notifs[sender] = append(r.notifs[sender], msg)
	return true
}

// ValidName reports whether name can name an agent: 1 to 256 bytes of
// printable ASCII without spaces.
func ValidName(name string) bool {
	if name == "" || len(name) > 256 {
		return false
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' {
			return false
		}
	}
	return true
}

// WaitNotifs blocks until at least one notification has arrived or ctx
// ends, and then hands out what has arrived, like Notifs. The map is never
// nil; it is empty when ctx ended (ctx's error) or the reactor closed
// (ErrClosed) first. A nil ctx is context.Background().
func (r *Reactor) WaitNotifs(ctx context.Context) (map[string][][]byte, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if r.onLoop() {
		// Nothing arrives while the thread is here: what has, or nothing.
		if m := r.Notifs(); len(m) > 0 {
			return m, nil
		}
		return map[string][][]byte{}, ErrReactorThread
	}
	w := r.addWaiter(false)
	defer r.dropWaiter(w)
	// A thread napping while callers step in takes a turn, and reads
	// the notification socket, every napTurn while this waits (napOn).
	r.notifWaiters.Add(1)
	defer r.notifWaiters.Add(-1)
	for {
		if m := r.Notifs(); len(m) > 0 {
			return m, nil
		}
		select {
		case <-w.ch:
		case <-ctx.Done():
			return map[string][][]byte{}, ctx.Err()
		case <-r.done:
			// The last turn may have taken some and woken w.ch too, and
			// select picks at random: hand them out first.
			if m := r.Notifs(); len(m) > 0 {
				return m, nil
			}
			return map[string][][]byte{}, ErrClosed
		}
	}
}

// peer returns the published peer of that name, or nil.
func (r *Reactor) peer(name string) *Peer { return (*r.peers.Load())[name] }

// Done is closed when the reactor thread has exited.
func (r *Reactor) Done() <-chan struct{} { return r.done }
