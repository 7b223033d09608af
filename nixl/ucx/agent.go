package ucx

/*
#cgo pkg-config: ucx
#include <stdlib.h>
#include "ecx.h"
*/
import "C"

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sort"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ErrMode chooses UCX's error-handling mode per endpoint.
type ErrMode int

const (
	// ErrModeAuto uses UCP_ERR_HANDLING_MODE_NONE for peers on this host
	// (shared memory stays available; liveness comes from a pidfd) and
	// UCP_ERR_HANDLING_MODE_PEER for peers elsewhere (UCX reports their
	// death through the endpoint error callback).
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

// DefaultMaxNotif is the default limit on notification size. Notifications
// are sent eagerly and copied by the receiver inside its handler; the limit
// keeps that copy small.
const DefaultMaxNotif = 64 << 10

// Config configures New. UCX itself is tuned only through its own
// environment variables (UCX_TLS, UCX_NET_DEVICES, ...), read by UCX.
type Config struct {
	// Name is the agent's name as peers know it (1..256 bytes of UTF-8).
	Name string
	// ErrMode picks the error-handling mode of endpoints (see ErrMode).
	ErrMode ErrMode
	// MaxNotif limits notification size; 0 means DefaultMaxNotif. At most
	// 1 MiB.
	MaxNotif int
	// LivenessPoll is how often Progress polls the pidfds of same-host
	// peers; 0 means 10ms. Arm always polls them before the caller sleeps,
	// and the pidfds are in the EventFD epoll set, so a parked caller wakes
	// on a peer's death.
	LivenessPoll time.Duration

	noPidfd bool // tests: rely on UCX alone for same-host peers
}

// kit prefixes this engine's errors.
const kit enginekit.Prefix = "ucx"

// errClosed is returned by every method of a closed Agent.
var errClosed = kit.Closed()

type memRegion struct {
	enginekit.Region
	memh  C.ucp_mem_h
	rkey  []byte
	alloc bool
}

type peerRegion struct {
	addr, len uint64
	rkey      uint32 // index into peer.rkeys
}

type peer struct {
	name     string
	tag      uint64
	blob     []byte
	md       *metadata
	ep       C.ucp_ep_h
	eparg    *C.ecx_ep_arg_t
	rkeys    *C.ucp_rkey_h // C array, len(regions)
	regions  []peerRegion  // sorted by addr
	spans    nixl.SpanIndex
	peerMode bool
	pidfd    int
	dead     error // why the peer is unusable, nil while alive
	inflight map[nixl.XferID]*xfer
	dlists   map[nixl.DlistID]*dlist
}

type dlist struct {
	id     nixl.DlistID
	peer   *peer // nil: local memory
	descs  descriptors.List
	region []uint32     // remote: region index of each descriptor
	mems   []*memRegion // local: regions referenced (each once)
	valid  bool
}

// Remote implements enginekit.Dlist.
func (d *dlist) Remote() bool { return d.peer != nil }

// Usable implements enginekit.Dlist.
func (d *dlist) Usable() bool { return d.valid && d.peer.dead == nil }

// Gone implements enginekit.Peer.
func (p *peer) Gone() error { return p.dead }

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
	worker   []byte
	epfd     int
	closed   bool
	nextID   uint64
	nextTag  uint64
	mems     enginekit.Regions[*memRegion]
	peers    map[string]*peer
	peerTags map[uint64]*peer
	pidPeers []*peer
	dlists   map[nixl.DlistID]*dlist
	xfers    map[nixl.XferID]*xfer
	pending  enginekit.Completions
	compBuf  *C.ecx_completion_t
	postOut  **C.ecx_post_t // ecx_post's out parameter, in C memory
	spare    []*xfer        // released requests kept for reuse
	rangeBuf []descriptors.Range
	pollfds  []unix.PollFd
	calls    uint32
	lastPoll time.Time
}

var _ nixl.Agent = (*Agent)(nil)

// New creates an agent: one UCP context (RMA, AM, WAKEUP), one worker in
// single-thread mode and an epoll set for EventFD.
func New(cfg Config) (*Agent, error) {
	if err := kit.CheckConfig(cfg.Name, maxNameLen, &cfg.MaxNotif, DefaultMaxNotif); err != nil {
		return nil, err
	}
	if cfg.LivenessPoll <= 0 {
		cfg.LivenessPoll = 10 * time.Millisecond
	}
	if cfg.ErrMode < ErrModeAuto || cfg.ErrMode > ErrModeNone {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: unknown error mode %d", int(cfg.ErrMode))
	}
	host, err := localHost()
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrBackend, "ucx: host identity: %v", err)
	}
	pid := os.Getpid()
	start, err := procStart(pid)
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
		dlists:   map[nixl.DlistID]*dlist{},
		xfers:    map[nixl.XferID]*xfer{},
	}
	var ma, mi C.uint32_t
	C.ecx_version(&ma, &mi)
	a.ucxVer = uint64(ma)<<16 | uint64(mi)

	cname := C.CString(cfg.Name)
	st := C.ecx_create(cname, C.uint32_t(len(cfg.Name)), &a.c)
	C.free(unsafe.Pointer(cname))
	if st != 0 {
		return nil, ucsErr(st, "ucx: init")
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

func (a *Agent) newID() uint64 {
	a.nextID++
	return a.nextID
}

// Name implements nixl.Agent.
func (a *Agent) Name() string { return a.name }

// ---------------------------------------------------------------- memory

// RegisterMem registers caller memory (outside the Go heap) with
// ucp_mem_map. Regions may not overlap one another.
func (a *Agent) RegisterMem(buf []byte, mem nixl.MemType, devID uint64) (nixl.MemID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckRegister(buf, mem); err != nil {
		return 0, err
	}
	addr := uint64(uintptr(unsafe.Pointer(&buf[0])))
	if err := a.mems.CheckOverlap(addr, uint64(len(buf))); err != nil {
		return 0, err
	}
	var memh C.ucp_mem_h
	var out unsafe.Pointer
	st := C.ecx_mem_map(a.c, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), 0, &memh, &out)
	if st != 0 {
		return 0, ucsErr(st, "ucx: mem_map")
	}
	return a.addMem(memh, addr, uint64(len(buf)), false)
}

// AllocMem allocates memory through UCX (UCP_MEM_MAP_ALLOCATE), which on
// shared-memory transports lets peers read it without this agent
// progressing. The pages are touched before it returns.
func (a *Agent) AllocMem(length int, mem nixl.MemType, devID uint64) (nixl.MemID, []byte, error) {
	if a.closed {
		return 0, nil, errClosed
	}
	if err := kit.CheckAlloc(length, mem); err != nil {
		return 0, nil, err
	}
	var memh C.ucp_mem_h
	var out unsafe.Pointer
	st := C.ecx_mem_map(a.c, nil, C.size_t(length), 1, &memh, &out)
	if st != 0 {
		return 0, nil, ucsErr(st, "ucx: mem_map(allocate)")
	}
	addr := uint64(uintptr(out))
	if err := a.mems.CheckOverlap(addr, uint64(length)); err != nil {
		C.ecx_mem_unmap(a.c, memh)
		return 0, nil, err
	}
	id, err := a.addMem(memh, addr, uint64(length), true)
	if err != nil {
		return 0, nil, err
	}
	return id, unsafe.Slice((*byte)(out), length), nil
}

func (a *Agent) addMem(memh C.ucp_mem_h, addr, n uint64, alloc bool) (nixl.MemID, error) {
	buf := C.malloc(maxRkeyLen)
	rl := C.ecx_rkey_pack(a.c, memh, buf, maxRkeyLen)
	if rl <= 0 {
		C.free(buf)
		C.ecx_mem_unmap(a.c, memh)
		return 0, ucsErr(C.int(rl), "ucx: rkey_pack")
	}
	m := &memRegion{Region: enginekit.Region{ID: nixl.MemID(a.newID()), Addr: addr, Len: n}, memh: memh,
		rkey: C.GoBytes(buf, C.int(rl)), alloc: alloc}
	C.free(buf)
	a.mems.Add(m)
	return m.ID, nil
}

// DeregisterMem implements nixl.Agent.
func (a *Agent) DeregisterMem(id nixl.MemID) error {
	if a.closed {
		return errClosed
	}
	m, err := a.mems.Removable(id)
	if err != nil {
		return err
	}
	a.mems.Remove(id)
	if st := C.ecx_mem_unmap(a.c, m.memh); st != 0 {
		return ucsErr(st, "ucx: mem_unmap")
	}
	return nil
}

// -------------------------------------------------------------- metadata

// LocalMetadata implements nixl.Agent.
func (a *Agent) LocalMetadata() ([]byte, error) {
	if a.closed {
		return nil, errClosed
	}
	m := &metadata{
		Name: a.name, Host: a.host, Pid: uint64(a.pid), Start: a.start, UCX: a.ucxVer,
		Worker: a.worker,
	}
	for _, r := range a.mems.Sorted() {
		m.Region = append(m.Region, region{Addr: r.Addr, Len: r.Len, Rkey: r.rkey})
	}
	return encodeMetadata(m)
}

// LoadRemoteMetadata implements nixl.Agent; ErrNotAllowed (other metadata
// under a loaded name) comes with that name. The blob is decoded and
// validated in Go (structure, limits, checksum, UCX version and address
// format) before any of its bytes reach UCX.
func (a *Agent) LoadRemoteMetadata(md []byte) (string, error) {
	if a.closed {
		return "", errClosed
	}
	m, err := decodeMetadata(md)
	if err != nil {
		return "", err
	}
	if old := a.peers[m.Name]; old != nil {
		if bytes.Equal(old.blob, md) {
			return m.Name, nil
		}
		return m.Name, kit.OtherMetadata(m.Name)
	}
	if m.UCX>>16 != a.ucxVer>>16 {
		return "", nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q runs UCX %d.%d, this is %d.%d",
			m.Name, m.UCX>>16, m.UCX&0xffff, a.ucxVer>>16, a.ucxVer&0xffff)
	}
	// The low nibble of a packed UCP worker address is its format version;
	// a peer built against the same UCX writes the same one.
	if m.Worker[0]&0xf != a.worker[0]&0xf {
		return "", nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q: worker address format %d, want %d",
			m.Name, m.Worker[0]&0xf, a.worker[0]&0xf)
	}
	sameHost := m.Host == a.host
	p := &peer{name: m.Name, blob: append([]byte(nil), md...), md: m, pidfd: -1,
		inflight: map[nixl.XferID]*xfer{}, dlists: map[nixl.DlistID]*dlist{}}
	switch a.cfg.ErrMode {
	case ErrModePeer:
		p.peerMode = true
	case ErrModeAuto:
		p.peerMode = !sameHost
	}
	if sameHost && !a.cfg.noPidfd {
		fd, err := unix.PidfdOpen(int(m.Pid), unix.PIDFD_NONBLOCK)
		if err != nil {
			return "", nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: peer %q (pid %d): %v", m.Name, m.Pid, err)
		}
		// The pid may have been recycled; the start time tells.
		if st, err := procStart(int(m.Pid)); err != nil || st != m.Start {
			unix.Close(fd)
			return "", nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: peer %q (pid %d) is gone", m.Name, m.Pid)
		}
		p.pidfd = fd
	}
	spans := make([]nixl.Span, len(m.Region))
	p.regions = make([]peerRegion, len(m.Region))
	for i, r := range m.Region {
		spans[i] = nixl.Span{Addr: r.Addr, Len: r.Len}
		p.regions[i] = peerRegion{addr: r.Addr, len: r.Len, rkey: uint32(i)}
	}
	sort.Slice(p.regions, func(i, j int) bool { return p.regions[i].addr < p.regions[j].addr })
	if p.spans, err = nixl.NewSpanIndex(spans); err != nil {
		a.closePidfd(p)
		return "", err
	}

	a.nextTag++
	p.tag = a.nextTag
	waddr := C.CBytes(m.Worker)
	mode := C.int(0)
	if p.peerMode {
		mode = 1
	}
	st := C.ecx_ep_create(a.c, waddr, mode, C.uint64_t(p.tag), &p.ep, &p.eparg)
	C.free(waddr)
	if st != 0 {
		a.closePidfd(p)
		return "", ucsErr(st, "ucx: ep_create")
	}
	if n := len(m.Region); n > 0 {
		p.rkeys = (*C.ucp_rkey_h)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(C.ucp_rkey_h(nil)))))
		rk := unsafe.Slice(p.rkeys, n)
		for i, r := range m.Region {
			buf := C.CBytes(r.Rkey)
			st := C.ecx_rkey_unpack(p.ep, buf, &rk[i])
			C.free(buf)
			if st != 0 {
				C.ecx_ep_close_rkeys(a.c, p.ep, p.eparg, 1, p.rkeys, C.uint32_t(n))
				a.closePidfd(p)
				return "", nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q region %d: rkey_unpack: %s",
					m.Name, i, C.GoString(C.ecx_status_string(st)))
			}
		}
	}
	if p.pidfd >= 0 {
		if err := unix.EpollCtl(a.epfd, unix.EPOLL_CTL_ADD, p.pidfd,
			&unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p.pidfd)}); err != nil {
			C.ecx_ep_close_rkeys(a.c, p.ep, p.eparg, 1, p.rkeys, C.uint32_t(len(m.Region)))
			a.closePidfd(p)
			return "", nixl.Errorf(nixl.ErrBackend, "ucx: epoll add pidfd: %v", err)
		}
		a.pidPeers = append(a.pidPeers, p)
	}
	a.peers[p.name] = p
	a.peerTags[p.tag] = p
	return p.name, nil
}

func (a *Agent) closePidfd(p *peer) {
	if p.pidfd < 0 {
		return
	}
	for i, q := range a.pidPeers {
		if q == p {
			a.pidPeers = append(a.pidPeers[:i], a.pidPeers[i+1:]...)
			unix.EpollCtl(a.epfd, unix.EPOLL_CTL_DEL, p.pidfd, nil)
			break
		}
	}
	unix.Close(p.pidfd)
	p.pidfd = -1
}

// failPeer ends every in-flight transfer to p with err and closes p's
// endpoint (forced when the peer is dead or in PEER mode, flushed
// otherwise), releasing its rkeys once nothing can use them.
func (a *Agent) failPeer(p *peer, err error, force bool) {
	if p.dead != nil {
		return
	}
	p.dead = err
	for id, x := range p.inflight {
		a.failXfer(x, err)
		delete(p.inflight, id)
	}
	f := C.int(0)
	if force || p.peerMode {
		f = 1
	}
	C.ecx_ep_close_rkeys(a.c, p.ep, p.eparg, f, p.rkeys, C.uint32_t(len(p.regions)))
	p.ep, p.eparg, p.rkeys = nil, nil, nil
	a.closePidfd(p)
	delete(a.peerTags, p.tag)
}

func (a *Agent) failXfer(x *xfer, err error) {
	if x.post != nil {
		C.ecx_post_cancel(a.c, x.post)
		x.post = nil
	}
	x.state = enginekit.Done
	x.err = err
	a.pending.Push(x.id, x.gen, err)
}

// pidAlive polls p's pidfd once.
func pidAlive(p *peer) bool {
	if p.pidfd < 0 {
		return true
	}
	fds := [1]unix.PollFd{{Fd: int32(p.pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds[:], 0)
	return err != nil || n == 0
}

// InvalidateRemoteMetadata implements nixl.Agent.
func (a *Agent) InvalidateRemoteMetadata(name string) error {
	if a.closed {
		return errClosed
	}
	p := a.peers[name]
	if p == nil {
		return kit.PeerNotFound(name)
	}
	alive := pidAlive(p)
	a.failPeer(p, kit.Invalidated(name), !alive)
	for _, d := range p.dlists {
		d.valid = false
	}
	delete(a.peers, name)
	return nil
}

// checkPids polls every pidfd once and fails the peers that died.
func (a *Agent) checkPids() bool {
	a.lastPoll = time.Now()
	if len(a.pidPeers) == 0 {
		return false
	}
	a.pollfds = a.pollfds[:0]
	for _, p := range a.pidPeers {
		a.pollfds = append(a.pollfds, unix.PollFd{Fd: int32(p.pidfd), Events: unix.POLLIN})
	}
	n, err := unix.Poll(a.pollfds, 0)
	if err != nil || n == 0 {
		return false
	}
	var died []*peer
	for i, fd := range a.pollfds {
		if fd.Revents != 0 {
			died = append(died, a.pidPeers[i])
		}
	}
	for _, p := range died {
		a.failPeer(p, nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: peer %q (pid %d) exited", p.name, p.md.Pid), true)
	}
	return len(died) > 0
}

// drainPeerErrors handles endpoint errors UCX reported (PEER mode).
func (a *Agent) drainPeerErrors() bool {
	list := C.ecx_err_take(a.c)
	if list == nil {
		return false
	}
	for e := list; e != nil; e = e.next {
		if p := a.peerTags[uint64(e.peer)]; p != nil {
			a.failPeer(p, ucsErrDisconnect(C.int(e.status), "ucx: peer "+p.name), true)
		}
	}
	C.ecx_err_free(list)
	return true
}

// ucsErrDisconnect is ucsErr, but any failure of a whole endpoint is a
// disconnect.
func ucsErrDisconnect(st C.int, what string) error {
	err := ucsErr(st, what)
	if errors.Is(err, nixl.ErrRemoteDisconnect) {
		return err
	}
	return nixl.Errorf(nixl.ErrRemoteDisconnect, "%s: %s", what, C.GoString(C.ecx_status_string(st)))
}

// ----------------------------------------------------------------- dlists

// PrepDlist implements nixl.Agent. Remote lists are checked against the
// regions the peer advertised: the target does not bounds-check emulated
// gets, so this check is what protects it.
func (a *Agent) PrepDlist(peerName string, descs descriptors.List, mem nixl.MemType) (nixl.DlistID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckMem(mem); err != nil {
		return 0, err
	}
	d := &dlist{descs: append(descriptors.List(nil), descs...), valid: true}
	if peerName == "" {
		if err := a.mems.Spans().CheckList(descs); err != nil {
			return 0, err
		}
		d.mems, _ = a.mems.Covering(descs) // every descriptor was just checked
		enginekit.AddRefs(d.mems, 1)
	} else {
		p, err := enginekit.LivePeer(kit, a.peers, peerName)
		if err != nil {
			return 0, err
		}
		if err := p.spans.CheckList(descs); err != nil {
			return 0, err
		}
		d.peer = p
		d.region = make([]uint32, len(descs))
		for i, ds := range descs {
			d.region[i] = uint32(p.regionAt(ds.Addr))
		}
	}
	d.id = nixl.DlistID(a.newID())
	a.dlists[d.id] = d
	if d.peer != nil {
		d.peer.dlists[d.id] = d
	}
	return d.id, nil
}

// regionAt returns the index in p.regions of the region containing addr.
func (p *peer) regionAt(addr uint64) int {
	return sort.Search(len(p.regions), func(i int) bool { return p.regions[i].addr > addr }) - 1
}

// ReleaseDlist implements nixl.Agent.
func (a *Agent) ReleaseDlist(id nixl.DlistID) error {
	if a.closed {
		return errClosed
	}
	d := a.dlists[id]
	if d == nil {
		return kit.DlistNotFound(id)
	}
	enginekit.AddRefs(d.mems, -1)
	if d.peer != nil {
		delete(d.peer.dlists, id)
	}
	delete(a.dlists, id)
	return nil
}

// -------------------------------------------------------------- transfers

// MakeXfer implements nixl.Agent. Runs are merged (descriptors.MergeRuns)
// and split again wherever they would cross from one remote region (one
// rkey) into the next; the result is kept in C memory for PostXfer.
func (a *Agent) MakeXfer(op nixl.Op, local nixl.DlistID, localIdx []int, remote nixl.DlistID, remoteIdx []int, notif []byte) (nixl.XferID, error) {
	if a.closed {
		return 0, errClosed
	}
	ld, rd, err := enginekit.XferLists(kit, a.dlists, op, local, remote, len(notif), a.cfg.MaxNotif)
	if err != nil {
		return 0, err
	}
	rs, err := kit.MergeRuns(&a.rangeBuf, ld.descs, rd.descs, localIdx, remoteIdx)
	if err != nil {
		return 0, err
	}
	p := rd.peer
	// Count the pieces after splitting at remote region ends.
	n := 0
	for _, r := range rs {
		n += p.pieces(r)
	}
	// Released requests are recycled with their C range arrays, so a
	// steady stream of reads allocates nothing on the Go heap.
	var x *xfer
	if k := len(a.spare); k > 0 {
		x = a.spare[k-1]
		a.spare[k-1] = nil
		a.spare = a.spare[:k-1]
	} else {
		x = &xfer{}
	}
	*x = xfer{id: nixl.XferID(a.newID()), op: op, peer: p, nranges: n, nlen: len(notif),
		ranges: x.ranges, rcap: x.rcap}
	if n > x.rcap {
		C.free(unsafe.Pointer(x.ranges))
		x.rcap = max(n, 16)
		x.ranges = (*C.ecx_range_t)(C.malloc(C.size_t(x.rcap) * C.sizeof_ecx_range_t))
	}
	if n > 0 {
		out := unsafe.Slice(x.ranges, n)
		k := 0
		for _, r := range rs {
			for r.Len > 0 {
				i := p.regionAt(r.Remote)
				reg := p.regions[i]
				l := min(r.Len, reg.addr+reg.len-r.Remote)
				out[k] = C.ecx_range_t{local: C.uint64_t(r.Local), remote: C.uint64_t(r.Remote),
					len: C.uint64_t(l), rkey: C.uint32_t(reg.rkey)}
				k++
				r.Local += l
				r.Remote += l
				r.Len -= l
			}
		}
	}
	if len(notif) > 0 {
		x.notif = (*C.char)(C.CBytes(notif))
	}
	x.mems = ld.mems
	enginekit.AddRefs(x.mems, 1)
	a.xfers[x.id] = x
	return x.id, nil
}

// pieces returns into how many gets r splits at remote region boundaries.
func (p *peer) pieces(r descriptors.Range) int {
	n := 0
	for r.Len > 0 {
		reg := p.regions[p.regionAt(r.Remote)]
		l := min(r.Len, reg.addr+reg.len-r.Remote)
		r.Remote += l
		r.Len -= l
		n++
	}
	return n
}

// PostXfer implements nixl.Agent: every get (or put) of the request is
// posted by one cgo call.
func (a *Agent) PostXfer(id nixl.XferID) error {
	if a.closed {
		return errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return kit.XferNotFound(id)
	}
	if err := kit.CheckPost(id, x.state); err != nil {
		return err
	}
	p := x.peer
	if p.dead != nil {
		return p.dead
	}
	op := C.int(C.ECX_OP_READ)
	if x.op == nixl.Write {
		op = C.ECX_OP_WRITE
	}
	// The out parameter lives in C memory: a Go variable whose address
	// goes to C would escape to the heap on every post.
	st := C.ecx_post(a.c, C.uint64_t(x.id), p.ep, op, x.ranges, C.uint32_t(x.nranges), p.rkeys,
		unsafe.Pointer(x.notif), C.uint32_t(x.nlen), a.postOut)
	if st != 0 {
		return ucsErr(st, "ucx: post")
	}
	x.post = *a.postOut
	x.state = enginekit.Inflight
	x.err = nil
	x.gen++
	p.inflight[x.id] = x
	return nil
}

// drainC moves completions from the C queue to the pending queue.
func (a *Agent) drainC() {
	buf := unsafe.Slice(a.compBuf, compBufLen)
	for a.c.comp_head != nil {
		n := int(C.ecx_drain(a.c, a.compBuf, compBufLen))
		for _, e := range buf[:n] {
			x := a.xfers[nixl.XferID(e.id)]
			if x == nil || x.state != enginekit.Inflight {
				continue
			}
			x.post = nil
			x.state = enginekit.Done
			if e.status != 0 {
				x.err = ucsErr(C.int(e.status), fmt.Sprintf("ucx: xfer %d", x.id))
			}
			delete(x.peer.inflight, x.id)
			a.pending.Push(x.id, x.gen, x.err)
		}
	}
	if n := a.pending.Len(); n > 1024 && n > 2*len(a.xfers) {
		a.pending.Compact(a.live)
	}
}

// live reports whether a queued completion of post gen of request id may
// still be reported.
func (a *Agent) live(id nixl.XferID, gen uint64) bool {
	x := a.xfers[id]
	return x != nil && x.gen == gen && x.state == enginekit.Done
}

// XferStatus implements nixl.Agent. A request that was never posted reports
// (false, ErrNotPosted).
func (a *Agent) XferStatus(id nixl.XferID) (bool, error) {
	if a.closed {
		return true, errClosed
	}
	if a.c.comp_head != nil {
		a.drainC()
	}
	x := a.xfers[id]
	if x == nil {
		return true, kit.XferNotFound(id)
	}
	switch x.state {
	case enginekit.Idle:
		return false, nixl.ErrNotPosted
	case enginekit.Inflight:
		return false, nil
	}
	return true, x.err
}

// ReleaseXfer implements nixl.Agent. An in-flight request is cancelled: its
// outstanding UCX operations are asked to cancel and the C side frees the
// request once every one of them has called back; no notification is sent.
// Gets already on the wire may still land in local memory.
func (a *Agent) ReleaseXfer(id nixl.XferID) error {
	if a.closed {
		return errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return kit.XferNotFound(id)
	}
	if x.post != nil {
		C.ecx_post_cancel(a.c, x.post)
		x.post = nil
	}
	delete(x.peer.inflight, id)
	a.freeXfer(x)
	delete(a.xfers, id)
	x.peer, x.err = nil, nil
	if len(a.spare) < maxSpare {
		a.spare = append(a.spare, x)
	} else {
		C.free(unsafe.Pointer(x.ranges))
	}
	return nil
}

// maxSpare bounds the released requests kept for reuse.
const maxSpare = 1024

func (a *Agent) freeXfer(x *xfer) {
	if x.notif != nil {
		C.free(unsafe.Pointer(x.notif))
		x.notif = nil
	}
	enginekit.AddRefs(x.mems, -1)
	x.mems = nil
}

// PollCompletions implements nixl.Agent.
func (a *Agent) PollCompletions(dst []nixl.Completion) int {
	if a.closed {
		return 0
	}
	if a.c.comp_head != nil {
		a.drainC()
	}
	return a.pending.Poll(dst, a.live)
}

// ----------------------------------------------------------- notifications

// SendNotif implements nixl.Agent.
func (a *Agent) SendNotif(peerName string, msg []byte) error {
	if a.closed {
		return errClosed
	}
	p, err := enginekit.LivePeer(kit, a.peers, peerName)
	if err != nil {
		return err
	}
	if err := kit.CheckNotif(len(msg), a.cfg.MaxNotif); err != nil {
		return err
	}
	var buf unsafe.Pointer
	if len(msg) > 0 {
		buf = C.CBytes(msg)
	}
	st := C.ecx_send_notif(a.c, p.ep, buf, C.uint32_t(len(msg)))
	C.free(buf)
	return ucsErr(st, "ucx: send notification")
}

// GetNotifs implements nixl.Agent.
func (a *Agent) GetNotifs(dst map[string][][]byte) int {
	if a.closed || a.c.notif_head == nil {
		return 0
	}
	list := C.ecx_notif_take(a.c)
	n := 0
	for e := list; e != nil; e = e.next {
		data := unsafe.Add(unsafe.Pointer(e), C.ECX_NOTIF_DATA_OFF)
		name := C.GoStringN((*C.char)(data), C.int(e.hlen))
		msg := C.GoBytes(unsafe.Add(data, e.hlen), C.int(e.plen))
		dst[name] = append(dst[name], msg)
		n++
	}
	C.ecx_notif_free(list)
	return n
}

// ---------------------------------------------------------------- progress

// Progress implements nixl.Agent: one cgo call drives the worker until idle
// and advances finished requests (sending their notifications); endpoint
// errors and, every LivenessPoll, the pidfds of same-host peers are checked.
func (a *Agent) Progress() (bool, error) {
	if a.closed {
		return false, errClosed
	}
	did := C.ecx_progress(a.c) > 0
	if a.c.err_head != nil && a.drainPeerErrors() {
		did = true
	}
	if a.c.comp_head != nil {
		a.drainC()
		did = true
	}
	if len(a.pidPeers) > 0 {
		a.calls++
		if a.calls&63 == 0 && time.Since(a.lastPoll) >= a.cfg.LivenessPoll && a.checkPids() {
			did = true
		}
	}
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
	switch r := C.ecx_arm(a.c); {
	case r == 1:
		return true, nil
	case r == 0:
		return false, nil
	default:
		return false, ucsErr(r, "ucx: worker_arm")
	}
}

// --------------------------------------------------------------- teardown

// closeWait bounds how long Close waits for endpoint closes to complete.
const closeWait = 250 * time.Millisecond

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
	// Forced closes: a flushed close waits for the peer to answer, and we
	// are leaving.
	for name, p := range a.peers {
		a.failPeer(p, errClosed, true)
		delete(a.peers, name)
	}
	deadline := time.Now().Add(closeWait)
	for C.ecx_closing(a.c) > 0 && time.Now().Before(deadline) {
		C.ecx_progress(a.c)
	}
	var err error
	for _, m := range a.mems.Sorted() {
		if st := C.ecx_mem_unmap(a.c, m.memh); st != 0 && err == nil {
			err = ucsErr(st, "ucx: mem_unmap")
		}
	}
	a.mems.Clear()
	a.dlists = map[nixl.DlistID]*dlist{}
	C.ecx_destroy(a.c)
	a.c = nil
	C.free(unsafe.Pointer(a.compBuf))
	a.compBuf = nil
	C.free(unsafe.Pointer(a.postOut))
	a.postOut = nil
	unix.Close(a.epfd)
	a.epfd = -1
	return err
}
