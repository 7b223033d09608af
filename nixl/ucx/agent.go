package ucx

/*
#cgo pkg-config: ucx
#include <stdlib.h>
#include "ecx.h"
*/
import "C"

import (
	"fmt"
	"os"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/procinfo"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ErrMode chooses UCX's error-handling mode per endpoint.
type ErrMode int

const (
	// ErrModeAuto uses UCP_ERR_HANDLING_MODE_NONE for peers on this host
	// (shared memory stays available; liveness comes from a pidfd) and
	// UCP_ERR_HANDLING_MODE_PEER for peers elsewhere (UCX reports their
	// death through the endpoint error callback). A peer on this host
	// gets PEER too when shared memory is out of reach anyway: either
	// end's UCX has no shared-memory transport (UCX_TLS=tcp), and the peer
	// is of a build that applies the same rule (featModeRule), so both
	// ends of the pair pick the same mode (UCX refuses a connection whose
	// ends differ). Over tcp, PEER is what makes a peer's death or removal
	// with transfers in flight safe (see the package doc).
	ErrModeAuto ErrMode = iota
	// ErrModePeer uses PEER for every peer. On one host this forces tcp in
	// UCX 1.13 (about 8x slower than shared memory).
	ErrModePeer
	// ErrModeNone uses NONE for every peer. Peers on other hosts are then
	// never detected dead: their transfers can hang.
	ErrModeNone
)

func (m ErrMode) String() string {
	switch m {
	case ErrModeAuto:
		return "auto"
	case ErrModePeer:
		return "peer"
	case ErrModeNone:
		return "none"
	}
	return fmt.Sprintf("ErrMode(%d)", int(m))
}

// Config configures New. UCX itself is tuned through its own environment
// variables (UCX_TLS, UCX_NET_DEVICES, ...), read by UCX; the one default
// this package changes is in the package documentation.
type Config struct {
	// Name is the agent's name as peers know it (1..256 bytes of UTF-8).
	Name string
	// ErrMode picks the error-handling mode of endpoints (see ErrMode).
	ErrMode ErrMode
	// MaxNotif limits notification size; 0 means nixl.DefaultMaxNotif. At most
	// 1 MiB.
	MaxNotif int
	// LivenessPoll is how often, at most, Progress polls the pidfds of
	// same-host peers, and of removed ones whose fences wait for their
	// exit; 0 means 10ms. Progress looks at the clock every 64th call, so
	// a slower loop polls every 64 calls. Arm always polls them before the
	// caller sleeps. Loaded peers' pidfds are in the EventFD epoll set, so
	// a parked caller wakes on their death; a removed peer's exit is seen
	// at the caller's next wake-up.
	LivenessPoll time.Duration
	// NoGather turns gathered READs off. By default a READ of a peer
	// reached in error mode PEER (another host: UCX over tcp) that answers
	// gathers asks for all its ranges in a few messages, answered with
	// the bytes packed into a few sends, instead of one UCX get per range;
	// and this agent advertises that it answers such requests, which it
	// checks against its registered memory. With NoGather it does neither
	// (it still answers requests that reach it).
	NoGather bool
	// LargeTCPSegments gives UCX's tcp transport 256 KiB segments both
	// ways instead of 64 KiB sends and 64 KiB receives (ECX_TCP_SEG_BIG),
	// and gathered READs between two such agents come in 252 KiB answers
	// instead of 60 KiB ones. A peer that receives in 64 KiB segments
	// cannot take a larger message, and UCX 1.13 does not tell a sender
	// the peer's size, so every peer of such an agent must have it too:
	// LoadRemoteMetadata refuses a peer whose metadata says otherwise
	// (featBigSegments), and builds from before it refuse this agent's
	// metadata (mdVersionBig). It conflicts with UCX_TCP_TX_SEG_SIZE or
	// UCX_TCP_RX_SEG_SIZE in the environment (New fails).
	LargeTCPSegments bool

	noPidfd        bool // tests: rely on UCX alone for same-host peers
	rndvNotifs     bool // tests: send notifications by rendezvous (peers drop them)
	oversizeNotifs bool // tests: send notifications longer than MaxNotif (peers drop them)
}

// kit prefixes this engine's errors.
const kit enginekit.Prefix = "ucx"

// errClosed is returned by every method of a closed Agent.
var errClosed = kit.Closed()

type memRegion struct {
	enginekit.Region
	memh C.ucp_mem_h
	rkey []byte
}

type peerRegion struct {
	addr, len uint64
	rkey      uint32 // index into peer.rkeys
}

type peer struct {
	enginekit.PeerBase
	name  string
	tag   uint64
	blob  []byte // the metadata it was loaded from, to recognise a reload
	pid   uint64
	ep    C.ucp_ep_h
	eparg *C.ecx_ep_arg_t
	rkeys *C.ucp_rkey_h // C array, len(regions); nil entries are deferred
	// deferred holds the packed rkeys of regions not unpacked yet (caller
	// memory of a same-host peer, see connect), by region index; nil once
	// every rkey is unpacked.
	deferred [][]byte
	regions  []peerRegion // sorted by addr
	spans    nixl.SpanIndex
	peerMode bool
	// wired: a transfer to the peer has completed, so its endpoint's
	// wire-up has finished (closeEp).
	wired bool
	// notifTo says how notifications go to the peer (ecx_notif_to_t):
	// short_max, 0 or the longest active message its endpoint sends on
	// UCX's short path, to which they then keep; frag, the peer
	// reassembles fragmented ones; dest, its worker. C copies it.
	notifTo C.ecx_notif_to_t
	// sharedGets: gets from this peer's caller memory are emulated with
	// messages over a shared-memory transport (nixl.SharedQueueGetter).
	sharedGets bool
	// gather: READs of this peer are gathered (ECX_OP_GATHER): it is
	// reached in error mode PEER (another host) and answers gathers;
	// gatherBig, in chunks of ECX_GATHER_CHUNK_BIG (both ends have
	// featBigSegments).
	gather    bool
	gatherBig bool
	pidfd     int
	inflight  map[nixl.XferID]*xfer
}

// abandonedEp is what Close frees of an endpoint it leaves to the worker.
type abandonedEp struct {
	arg   *C.ecx_ep_arg_t
	rkeys *C.ucp_rkey_h
	n     int
}

type dlist struct {
	enginekit.ListBase[*peer, *memRegion]
}

type xfer struct {
	id      nixl.XferID
	op      nixl.Op
	peer    *peer
	mems    []*memRegion
	ranges  *C.ecx_range_t // C memory with room for rcap ranges
	rcap    int
	nranges int
	notif   *C.char
	nlen    int
	post    *C.ecx_post_t
	state   enginekit.XferState
	gen     uint64 // bumped on every post
	err     error
	// recheck: part or all of the post went out without the pidfd poll
	// PostXfer does first (later rounds, from Progress; a held READ, when
	// its fences lifted): drainC polls the peer's pidfd when it ends.
	recheck bool
}

const compBufLen = 256

// Agent is the UCX engine. It implements nixl.Agent; see that interface for
// the contract.
type Agent struct {
	name     string
	cfg      Config
	host     hostID
	pid      int
	start    uint64
	ucxVer   uint64
	c        *C.ecx_ctx_t
	cAt      C.uintptr_t // c's address, for the calls made in a loop (ecx_progress_at)
	worker   []byte
	epfd     int
	closed   bool
	ids      enginekit.IDs
	nextTag  uint64
	mems     enginekit.Regions[*memRegion]
	peers    map[string]*peer
	peerTags map[uint64]*peer
	pidPeers []*peer
	dlists   enginekit.Lists[*dlist, *peer, *memRegion]
	xfers    map[nixl.XferID]*xfer
	pending  enginekit.Completions
	compBuf  *C.ecx_completion_t
	postOut  **C.ecx_post_t // ecx_post's out parameter, in C memory
	spare    []*xfer        // released requests kept for reuse
	// orphans holds, by request, the local regions of cancelled posts
	// whose gets UCX has not called back yet (it cannot cancel them):
	// each holds a reference, so DeregisterMem refuses to unmap memory a
	// late reply would still write. Dropped when ecx_drain reports the
	// post's end.
	orphans map[nixl.XferID][]*memRegion
	// fences holds, by request, the local ranges of cancelled READs whose
	// gets UCX has not called back yet, and held the READs posted into
	// them, waiting (fence.go).
	fences      map[nixl.XferID]fence
	fenceSpans  []span       // every fence's spans, sorted and merged
	fenceDirty  bool         // fences changed since fenceSpans was built
	fenceLifted bool         // a fence was lifted: drainC looks at held
	fenceN      atomic.Int64 // len(fences), for Fencing from any goroutine
	// fenceGen counts changes of fences; fenceView is the merged spans as
	// of one of them, for Fenced from any goroutine (fence.go).
	fenceGen  atomic.Uint64
	fenceView atomic.Pointer[fenceView]
	held      []heldXfer
	gone      map[*peer]int // removed peers with fences: a dup of the pidfd
	// staged holds the peers staged and neither committed nor aborted;
	// Close closes them with the rest.
	staged map[*staged]struct{}
	// abandoned: same-host peers Close leaves to ucp_worker_destroy; their
	// rkeys and error-callback arguments are freed after its last progress.
	abandoned []abandonedEp
	rangeBuf  []descriptors.Range
	pollfds   []unix.PollFd
	calls     uint32
	// pidPolled: the pidfds were polled since the last Progress,
	// PollCompletions, XferStatus or GetNotifs (PostXfer).
	pidPolled bool
	dropped   uint64            // notif_dropped, kept when the C context goes at Close
	gstats    nixl.GatherCounts // the C context's gather counters, kept at Close
	// undelivered is notif_undelivered and the notifications still
	// waiting, kept when the C context goes at Close.
	undelivered uint64
	frags       reassembler
	lastPoll    time.Time
}

var (
	_ nixl.Agent     = (*Agent)(nil)
	_ nixl.AnyThread = (*Agent)(nil)
)

// AnyThread reports true: the worker is serialized, not bound to a
// thread, so the agent may be driven by any goroutine, one at a time.
func (a *Agent) AnyThread() bool { return true }

// New creates an agent: one UCP context (RMA, AM, WAKEUP), one worker in
// serialized mode and an epoll set for EventFD.
func New(cfg Config) (*Agent, error) {
	if err := kit.CheckConfig(cfg.Name, maxNameLen, &cfg.MaxNotif, nixl.DefaultMaxNotif); err != nil {
		return nil, err
	}
	if cfg.LivenessPoll <= 0 {
		cfg.LivenessPoll = 10 * time.Millisecond
	}
	if cfg.ErrMode < ErrModeAuto || cfg.ErrMode > ErrModeNone {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: unknown error mode %d", int(cfg.ErrMode))
	}
	if cfg.LargeTCPSegments {
		for _, v := range []string{"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"} {
			if _, ok := os.LookupEnv(v); ok {
				return nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: LargeTCPSegments and %s in the environment: one or the other", v)
			}
		}
	}
	host, err := localHost()
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrBackend, "ucx: host identity: %v", err)
	}
	pid := os.Getpid()
	start, err := procinfo.StartTime(pid)
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrBackend, "ucx: process start time: %v", err)
	}
	a := &Agent{
		name:     cfg.Name,
		cfg:      cfg,
		host:     host,
		pid:      pid,
		start:    start,
		epfd:     -1,
		mems:     enginekit.NewRegions[*memRegion](kit),
		peers:    map[string]*peer{},
		peerTags: map[uint64]*peer{},
		dlists:   enginekit.NewLists[*dlist](),
		xfers:    map[nixl.XferID]*xfer{},
		orphans:  map[nixl.XferID][]*memRegion{},
		fences:   map[nixl.XferID]fence{},
		gone:     map[*peer]int{},
		staged:   map[*staged]struct{}{},
	}
	var ma, mi C.uint32_t
	C.ecx_version(&ma, &mi)
	feats := uint64(featFragNotifs | featModeRule)
	if !cfg.NoGather {
		feats |= featGather
	}
	if cfg.LargeTCPSegments {
		feats |= featBigSegments
	}
	a.ucxVer = ucxFeatures(uint64(ma), uint64(mi), feats)

	cname := C.CString(cfg.Name)
	enginekit.UCXInit.Lock() // see there: libnixl may be setting UCX_MODULES
	big := C.int(0)
	if cfg.LargeTCPSegments {
		big = 1
	}
	st := C.ecx_create(cname, C.uint32_t(len(cfg.Name)), big, &a.c)
	enginekit.UCXInit.Unlock()
	C.free(unsafe.Pointer(cname))
	if st != 0 {
		return nil, ucsErr(st, "ucx: init")
	}
	a.cAt = C.uintptr_t(uintptr(unsafe.Pointer(a.c)))
	if a.tcpAlone() {
		a.ucxVer |= featTCPAlone << 8
	}
	if cfg.rndvNotifs {
		a.c.send_rndv = 1
	}
	buf := C.malloc(maxWorkerAddr)
	n := C.ecx_worker_address(a.c, buf, maxWorkerAddr)
	if n < 0 {
		C.free(buf)
		C.ecx_destroy(a.c)
		return nil, ucsErr(C.int(n), "ucx: worker address")
	}
	a.worker = C.GoBytes(buf, C.int(n))
	C.free(buf)

	a.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err == nil {
		err = unix.EpollCtl(a.epfd, unix.EPOLL_CTL_ADD, int(a.c.efd),
			&unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(a.c.efd)})
	}
	if err != nil {
		if a.epfd >= 0 {
			unix.Close(a.epfd)
		}
		C.ecx_destroy(a.c)
		return nil, nixl.Errorf(nixl.ErrBackend, "ucx: epoll: %v", err)
	}
	a.compBuf = (*C.ecx_completion_t)(C.malloc(C.size_t(compBufLen) * C.sizeof_ecx_completion_t))
	a.postOut = (**C.ecx_post_t)(C.malloc(C.size_t(unsafe.Sizeof(uintptr(0)))))
	a.lastPoll = time.Now()
	return a, nil
}

// ucsErr maps a UCX status to a nixl error.
func ucsErr(st C.int, what string) error {
	switch st {
	case C.UCS_OK:
		return nil
	case C.UCS_ERR_ENDPOINT_TIMEOUT, C.UCS_ERR_UNREACHABLE, C.UCS_ERR_CONNECTION_RESET,
		C.UCS_ERR_NOT_CONNECTED:
		return nixl.Errorf(nixl.ErrRemoteDisconnect, "%s: %s", what, C.GoString(C.ecx_status_string(st)))
	case C.UCS_ERR_CANCELED:
		return nixl.Errorf(nixl.ErrCanceled, "%s: %s", what, C.GoString(C.ecx_status_string(st)))
	}
	return nixl.Errorf(nixl.ErrBackend, "%s: %s", what, C.GoString(C.ecx_status_string(st)))
}

// Name implements nixl.Agent.
func (a *Agent) Name() string { return a.name }

// ---------------------------------------------------------------- progress

// Progress implements nixl.Agent: one cgo call drives the worker until idle
// and advances finished requests (sending their notifications); endpoint
// errors and, at most every LivenessPoll, the pidfds of same-host peers are
// checked.
func (a *Agent) Progress() (bool, error) {
	if a.closed {
		return false, errClosed
	}
	a.pidPolled = false
	did := C.ecx_progress_at(a.cAt) > 0
	if a.c.err_head != nil && a.drainPeerErrors() {
		did = true
	}
	if a.c.comp_head != nil {
		a.drainC()
		did = true
	}
	// a.gone too: a removed peer's fences wait for its process to exit,
	// and a spinning reactor never arms the agent (Arm checks too).
	if len(a.pidPeers) > 0 || len(a.gone) > 0 {
		a.calls++
		if a.calls&63 == 0 && time.Since(a.lastPoll) >= a.cfg.LivenessPoll && a.checkPids() {
			did = true
		}
	}
	a.publishFences()
	return did, nil
}

// EventFD implements nixl.Agent. It is an epoll descriptor holding UCX's
// worker event fd and the pidfds of same-host peers.
func (a *Agent) EventFD() int {
	if a.closed {
		return -1
	}
	return a.epfd
}

// Arm implements nixl.Agent. Before arming the worker it polls the pidfds of
// same-host peers and checks the queues the caller has not drained.
func (a *Agent) Arm() (bool, error) {
	if a.closed {
		return false, errClosed
	}
	if a.pending.Len() > 0 || a.c.comp_head != nil || a.c.notif_head != nil || a.c.err_head != nil {
		return false, nil
	}
	if a.checkPids() {
		return false, nil
	}
	switch r := C.ecx_arm_at(a.cAt); {
	case r == 1:
		return true, nil
	case r == 0:
		return false, nil
	default:
		return false, ucsErr(r, "ucx: worker_arm")
	}
}

// --------------------------------------------------------------- teardown

// closeWait bounds how long Close waits for the flush of its endpoints and
// for their closes to complete, together. (A variable only so that a test
// can wait longer for a flush on a loaded machine.)
var closeWait = 250 * time.Millisecond

// closingEndpoints counts the endpoint closes not completed yet, those
// waiting for notifications to go first included.
func (a *Agent) closingEndpoints() int { return int(C.ecx_closing(a.c)) }

// waitingNotifs counts the notifications to the named peer (every peer's
// for "") waiting for room in its queue.
func (a *Agent) waitingNotifs(name string) int {
	var ep C.ucp_ep_h
	if name != "" {
		p := a.peers[name]
		if p == nil || p.ep == nil {
			return 0
		}
		ep = p.ep
	}
	return int(C.ecx_waiting(a.c, ep))
}

// Close implements nixl.Agent.
func (a *Agent) Close() error {
	if a.closed {
		return nil
	}
	a.closed = true
	for id, x := range a.xfers {
		if x.post != nil {
			C.ecx_post_cancel(a.c, x.post)
			x.post = nil
		}
		a.freeXfer(x)
		C.free(unsafe.Pointer(x.ranges))
		delete(a.xfers, id)
	}
	for _, x := range a.spare {
		C.free(unsafe.Pointer(x.ranges))
	}
	a.spare = nil
	a.pending.Reset()
	// Notifications SendNotif took (the reactor sends a READ's right after
	// publishing it DONE) may still be in UCX's buffers, or not sent at
	// all while the peer's queue is full: the endpoints are flushed first,
	// within closeWait, or abandoning or force-closing them below would
	// drop them. Gets canceled above that the peer still answers are
	// flushed with them.
	deadline := time.Now().Add(closeWait)
	req := C.ecx_flush_start(a.c)
	for (req != nil && C.ecx_flush_running(req) != 0 || a.c.sending != nil) && time.Now().Before(deadline) {
		C.ecx_progress(a.c)
	}
	if req != nil {
		C.ecx_flush_end(req)
	}
	// Leaving: NONE-mode endpoints go with the worker; PEER-mode ones
	// (tcp) get a flushed close, waited for below within what is left of
	// closeWait: a forced one lost notifications the flush had already
	// handed to the socket.
	for name, p := range a.peers {
		a.failPeer(p, errClosed, true)
		delete(a.peers, name)
	}
	for st := range a.staged {
		st.ended = true
		a.failPeer(st.p, errClosed, true)
		delete(a.staged, st)
	}
	for a.closingEndpoints() > 0 && time.Now().Before(deadline) {
		C.ecx_progress(a.c)
	}
	// No progress from here on: the endpoints left to the worker drop
	// their rkeys (before the worker goes, which they need).
	for _, e := range a.abandoned {
		C.ecx_ep_abandon(e.arg, e.rkeys, C.uint32_t(e.n))
	}
	a.abandoned = nil
	for p, fd := range a.gone {
		unix.Close(fd)
		delete(a.gone, p)
	}
	var err error
	for _, m := range a.mems.Sorted() {
		if st := C.ecx_mem_unmap(a.c, m.memh); st != 0 && err == nil {
			err = ucsErr(st, "ucx: mem_unmap")
		}
	}
	a.mems.Clear()
	a.dlists.Clear()
	a.dropped = uint64(a.c.notif_dropped)
	a.gstats = gatherCountsOf(&a.c.gstats)
	a.undelivered = uint64(a.c.notif_undelivered) + uint64(C.ecx_waiting(a.c, nil))
	C.ecx_destroy(a.c)
	a.c = nil
	a.cAt = 0
	C.free(unsafe.Pointer(a.compBuf))
	a.compBuf = nil
	C.free(unsafe.Pointer(a.postOut))
	a.postOut = nil
	unix.Close(a.epfd)
	a.epfd = -1
	return err
}
