package ucx

/*
#include <stdlib.h>
#include <string.h>
#include "ecx.h"
*/
import "C"

import (
	"bytes"
	"errors"
	"fmt"
	"sort"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/procinfo"
	"github.com/ecxfer/ecxfer/internal/procmaps"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

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
// validated in Go (structure, limits, checksum, UCX version, the address's
// format version and each packed key's layout: checkRkey) before any of
// its bytes reach UCX; what the address and keys say inside is UCX's to
// parse, and UCX trusts it. Then, for a peer on this
// host, its pidfd is opened; then it is connected.
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
	p, err := a.newPeer(md, m)
	if err != nil {
		return "", err
	}
	a.peers[p.name] = p
	return p.name, nil
}

// featTCPAlone, in the feature bits of a peer's metadata: its UCX has no
// shared-memory transport (UCX_TLS without one), so a peer on its host
// reaches it over tcp alone. featModeRule: the peer picks error mode PEER
// for a peer on its host when either of them has featTCPAlone (ErrModeAuto).
const (
	featTCPAlone = 4
	featModeRule = 8
)

// tcpAlone reports whether this agent's UCX has no shared-memory
// transport.
func (a *Agent) tcpAlone() bool { return a.c.shm == 0 }

// tcpAlonePair reports whether a peer on this host with metadata m is
// reached over tcp alone and picks its error mode by the same rule as
// this agent: then both ends use PEER. A peer of an older build keeps
// NONE, as it does at its end.
func (a *Agent) tcpAlonePair(m *metadata) bool {
	f := m.ucxFeatures()
	return f&featModeRule != 0 && (a.tcpAlone() || f&featTCPAlone != 0)
}

// newPeer checks m against this build, opens the pidfd of a peer on this
// host and connects it. The peer is not under its name yet, but its
// endpoint's errors and its process's exit already reach it.
func (a *Agent) newPeer(md []byte, m *metadata) (*peer, error) {
	if err := a.checkCompatible(m); err != nil {
		return nil, err
	}
	sameHost := m.Host == a.host
	p := &peer{name: m.Name, blob: append([]byte(nil), md...), pid: m.Pid, pidfd: -1,
		inflight: map[nixl.XferID]*xfer{}}
	switch a.cfg.ErrMode {
	case ErrModePeer:
		p.peerMode = true
	case ErrModeAuto:
		p.peerMode = !sameHost || a.tcpAlonePair(m)
	}
	var err error
	if sameHost && !a.cfg.noPidfd {
		if p.pidfd, err = openPidfd(m); err != nil {
			return nil, err
		}
	}
	if err := a.connect(p, m); err != nil {
		a.closePidfd(p)
		return nil, err
	}
	a.peerTags[p.tag] = p
	return p, nil
}

// StageRemoteMetadata implements nixl.MetadataStager: the new peer is
// loaded in full (pidfd, endpoint, rkeys and their check against the
// peer's mappings) beside the old one.
func (a *Agent) StageRemoteMetadata(md []byte) (nixl.StagedPeer, error) {
	if a.closed {
		return nil, errClosed
	}
	m, err := decodeMetadata(md)
	if err != nil {
		return nil, err
	}
	old := a.peers[m.Name]
	switch {
	case old == nil:
		return nil, kit.PeerNotFound(m.Name)
	case bytes.Equal(old.blob, md):
		return nil, kit.Errorf(nixl.ErrInvalidParam, "peer %q: metadata already loaded", m.Name)
	}
	p, err := a.newPeer(md, m)
	if err != nil {
		return nil, err
	}
	st := &staged{a: a, old: old, p: p}
	a.staged[st] = struct{}{}
	return st, nil
}

// staged is a peer loaded beside the one it is to replace.
type staged struct {
	a      *Agent
	old, p *peer
	ended  bool
}

func (s *staged) Name() string { return s.p.name }

func (s *staged) SharedQueueGets() bool { return s.p.sharedGets }

func (s *staged) PrepDlist(descs descriptors.List, mem nixl.MemType) (nixl.DlistID, error) {
	switch {
	case s.ended || s.a.closed:
		return 0, kit.Errorf(nixl.ErrNotAllowed, "peer %q: staged peer already ended", s.p.name)
	case s.p.Dead != nil:
		return 0, s.p.Dead
	}
	if err := kit.CheckMem(mem); err != nil {
		return 0, err
	}
	if err := s.p.spans.CheckList(descs); err != nil {
		return 0, err
	}
	d := &dlist{}
	d.Descs, d.Valid, d.Peer = append(descriptors.List(nil), descs...), true, s.p
	return s.a.dlists.Add(d, &s.a.ids), nil
}

func (s *staged) Commit() {
	if s.ended || s.a.closed {
		return
	}
	s.ended = true
	a := s.a
	delete(a.staged, s)
	// The peer it replaces, or whatever was loaded under the name since.
	if cur := a.peers[s.p.name]; cur != nil {
		a.failPeer(cur, kit.Invalidated(cur.name), false)
		a.dlists.Invalidate(cur)
	}
	a.peers[s.p.name] = s.p
}

func (s *staged) Abort() {
	if s.ended || s.a.closed {
		return
	}
	s.ended = true
	delete(s.a.staged, s)
	s.a.failPeer(s.p, kit.Invalidated(s.p.name), false)
	s.a.dlists.Invalidate(s.p)
}

// SharedQueueGets implements nixl.SharedQueueGetter: true for a same-host
// peer in error mode NONE whose regions include caller memory, when the
// endpoint runs over shared memory (sysv or posix). Over tcp alone each
// peer has its own stream, which a dead peer cannot block for the others.
func (a *Agent) SharedQueueGets(peerName string) bool {
	p := a.peers[peerName]
	return p != nil && p.sharedGets
}

// checkCompatible refuses a peer whose UCX this build cannot talk to.
func (a *Agent) checkCompatible(m *metadata) error {
	own := metadata{UCX: a.ucxVer}
	if m.ucxMajor() != own.ucxMajor() {
		return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q runs UCX %d.%d, this is %d.%d",
			m.Name, m.ucxMajor(), m.ucxMinor(), own.ucxMajor(), own.ucxMinor())
	}
	if mine, theirs := own.ucxFeatures()&featBigSegments != 0, m.ucxFeatures()&featBigSegments != 0; mine != theirs {
		// One of them sends tcp messages the other has no room for.
		return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q has LargeTCPSegments %v, this agent %v: both ends need the same",
			m.Name, theirs, mine)
	}
	// The low nibble of a packed UCP worker address is its format version;
	// a peer built against the same UCX writes the same one.
	if m.Worker[0]&0xf != a.worker[0]&0xf {
		return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q: worker address format %d, want %d",
			m.Name, m.Worker[0]&0xf, a.worker[0]&0xf)
	}
	return nil
}

// openPidfd opens the pidfd of a peer on this host and checks, by its
// start time, that the pid still names the process that wrote m.
func openPidfd(m *metadata) (int, error) {
	fd, err := unix.PidfdOpen(int(m.Pid), unix.PIDFD_NONBLOCK)
	if err != nil {
		if outOfResources(err) {
			return -1, fmt.Errorf("%w: ucx: peer %q (pid %d): pidfd_open: %w", nixl.ErrBackend, m.Name, m.Pid, err)
		}
		return -1, nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: peer %q (pid %d): %v", m.Name, m.Pid, err)
	}
	// The pid may have been recycled; the start time tells.
	st, err := procinfo.StartTime(int(m.Pid))
	if err != nil && outOfResources(err) {
		unix.Close(fd)
		return -1, fmt.Errorf("%w: ucx: peer %q (pid %d): %w", nixl.ErrBackend, m.Name, m.Pid, err)
	}
	if err != nil || st != m.Start {
		unix.Close(fd)
		return -1, nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: peer %q (pid %d) is gone", m.Name, m.Pid)
	}
	return fd, nil
}

// outOfResources reports whether err is this process out of descriptors
// or memory: not a sign that a peer is gone. The errno stays in the chain
// of the error built from it, for callers to tell.
func outOfResources(err error) bool {
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) || errors.Is(err, unix.ENOMEM)
}

// connect indexes p's regions, creates its endpoint, unpacks its rkeys
// and watches its pidfd. On failure nothing of it is left but the pidfd,
// which the caller closes.
func (a *Agent) connect(p *peer, m *metadata) error {
	spans := make([]nixl.Span, len(m.Region))
	p.regions = make([]peerRegion, len(m.Region))
	for i, r := range m.Region {
		spans[i] = nixl.Span{Addr: r.Addr, Len: r.Len}
		p.regions[i] = peerRegion{addr: r.Addr, len: r.Len, rkey: uint32(i)}
	}
	sort.Slice(p.regions, func(i, j int) bool { return p.regions[i].addr < p.regions[j].addr })
	var err error
	if p.spans, err = nixl.NewSpanIndex(spans); err != nil {
		return err
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
		return ucsErr(st, "ucx: ep_create")
	}
	// Over tcp a get is emulated with messages, one send per get at the
	// peer, and the peer's answer path aborts it when this endpoint has
	// failed meanwhile (UCX 1.13): READs of a peer in error mode PEER that
	// answers gathers go as gathers (ecx.h, ECX_OP_GATHER).
	p.gather = p.peerMode && !a.cfg.NoGather && m.ucxFeatures()&featGather != 0
	p.gatherBig = p.gather && a.cfg.LargeTCPSegments && m.ucxFeatures()&featBigSegments != 0
	if !p.peerMode && !a.cfg.rndvNotifs {
		// An endpoint in error mode NONE cannot be force-closed, and one
		// that ever sent an active message off UCX's short path stays
		// until the worker goes: notifications to it keep to the short
		// path, in fragments when too long and the peer reassembles them
		// (see ECX_AM_NOTIF_FRAG in ecx.h).
		p.notifTo.short_max = C.ecx_ep_short_max(p.ep)
		if m.ucxFeatures()&featFragNotifs != 0 {
			p.notifTo.frag = 1
		}
		// Endpoints of one worker share its receive queue: notifications
		// to it wait in one line whichever endpoint they take (the old
		// one of a reloaded peer, the new one).
		p.notifTo.dest = C.uint64_t(xxhash.Sum64(m.Worker))
	}
	// The peer's regions and keys are checked against its mappings when
	// it is on this host, and also when its metadata says otherwise but
	// UCX reaches it over shared memory (error mode NONE): a false claim
	// of another host must not skip the checks.
	verify := m.Host == a.host
	if !verify && C.ecx_ep_shm_lanes(p.ep) == 1 {
		if m.Host.Boot != a.host.Boot || m.Host.PidNS != a.host.PidNS {
			// Another machine cannot be reached over shared memory, and
			// in another pid namespace its pid names no process of ours
			// to check against.
			a.closeEp(p, 0)
			return kit.Errorf(nixl.ErrInvalidParam,
				"peer %q: metadata names another host or pid namespace, but UCX reaches it over shared memory, "+
					"where its keys cannot be checked (use error mode auto or peer, or UCX_TLS without shared memory)", m.Name)
		}
		verify = true
	}
	if n := len(m.Region); n > 0 {
		p.rkeys = (*C.ucp_rkey_h)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(C.ucp_rkey_h(nil)))))
		var caller []bool
		var spans []procmaps.Span
		if verify {
			// Caller memory is checked against the peer's mappings now
			// and its rkeys unpacked at the first transfer (see
			// unpackDeferred).
			if caller, spans, err = callerRegions(m); err != nil {
				a.closeEp(p, n)
				return err
			}
		}
		for i, r := range m.Region {
			if caller != nil && caller[i] {
				if p.deferred == nil {
					p.deferred = make([][]byte, n)
				}
				p.deferred[i] = r.Rkey
				continue
			}
			if err := a.unpack(p, i, r.Rkey); err != nil {
				a.closeEp(p, n)
				return err
			}
		}
		if verify {
			if err := checkTruth(m, unsafe.Slice(p.rkeys, n), caller, spans); err != nil {
				a.closeEp(p, n)
				return err
			}
		}
		if p.deferred != nil && !p.peerMode {
			// Caller memory in error mode NONE: its gets are emulated, over
			// shared memory unless UCX_TLS left it out (-1, cannot tell,
			// counts as shared).
			p.sharedGets = C.ecx_ep_shm_lanes(p.ep) != 0
		}
	}
	if p.pidfd >= 0 {
		if err := unix.EpollCtl(a.epfd, unix.EPOLL_CTL_ADD, p.pidfd,
			&unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p.pidfd)}); err != nil {
			a.closeEp(p, len(m.Region))
			return nixl.Errorf(nixl.ErrBackend, "ucx: epoll add pidfd: %v", err)
		}
		a.pidPeers = append(a.pidPeers, p)
	}
	return nil
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

// rkeyPad is how many zero bytes follow the copy of a packed rkey handed
// to UCX: one domain's key is at most 255 bytes (its size is a byte).
const rkeyPad = 256

// unpack unpacks the rkey of p's region i.
func (a *Agent) unpack(p *peer, i int, packed []byte) error {
	rk := unsafe.Slice(p.rkeys, len(p.regions))
	// checkRkey saw that the map accounts for the key's bytes, but a
	// domain's unpacker reads its own size of key, whatever the size
	// byte said: the copy UCX reads is followed by zeros, as many as the
	// largest size a size byte can give, so it never reads past it.
	buf := C.calloc(C.size_t(len(packed)+rkeyPad), 1)
	if buf == nil {
		return fmt.Errorf("%w: ucx: peer %q region %d: no memory for its rkey", nixl.ErrBackend, p.name, i)
	}
	C.memcpy(buf, unsafe.Pointer(unsafe.SliceData(packed)), C.size_t(len(packed)))
	st := C.ecx_rkey_unpack(p.ep, buf, &rk[i])
	C.free(buf)
	if st != 0 {
		return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q region %d: rkey_unpack: %s",
			p.name, i, C.GoString(C.ecx_status_string(st)))
	}
	return nil
}

// unpackDeferred unpacks the rkeys connect deferred, before p's first
// transfer.
//
// Why they wait: UCX 1.13 reaches caller memory on this host with gets it
// emulates over active messages, and unpacking such an rkey makes UCX
// resolve the peer's endpoint id at once (a wireup exchange). An endpoint
// whose id is resolved is destroyed only with the worker (its close
// completes, the endpoint stays), and one in error mode NONE cannot be
// force-closed: the endpoint and its mappings of the peer's segments
// (about 4 MiB) stayed until Close, once per producer restart. A peer that
// is read directly never transfers through the engine, so its endpoint
// carries only notifications and closes at once.
func (a *Agent) unpackDeferred(p *peer) error {
	for i, packed := range p.deferred {
		if packed == nil {
			continue
		}
		if err := a.unpack(p, i, packed); err != nil {
			return err
		}
		p.deferred[i] = nil
		// Caller memory is reached by emulated gets; a key that maps
		// shared memory here would read a segment instead, one the
		// region check never saw (it checked the peer's mapping only).
		var ptr unsafe.Pointer
		if C.ecx_rkey_ptr(unsafe.Slice(p.rkeys, len(p.regions))[i], C.uint64_t(p.regionAddr(i)), &ptr) == C.UCS_OK {
			err := nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q region %d: memory of its own carries a shared-memory key", p.name, i)
			a.failPeer(p, err, false)
			return err
		}
	}
	p.deferred = nil
	return nil
}

// closeEp closes p's endpoint and, once nothing can use them, its first n
// rkeys: forced in error mode PEER, flushed in mode NONE (see failPeer).
// A PEER endpoint none of whose transfers has completed yet may still be
// in its wire-up, and UCX 1.13 aborts the peer's process when the
// endpoint fails while the peer's wire-up reply waits in its queue ("got
// REP message" in uct_tcp_ep_pending_purge): such an endpoint is flushed
// first, which ends once the wire-up has, and forced then, or after
// ECX_WIRE_NS at the latest.
// Notifications to p still waiting for room in its queue are sent first
// if its process is alive (within ECX_DRAIN_NS), dropped if not.
func (a *Agent) closeEp(p *peer, n int) {
	f := C.int(0)
	switch {
	case p.peerMode && p.wired:
		f = 1
	case p.peerMode:
		f = 2
	}
	drain := C.int(0)
	if p.pidfd >= 0 && !pidExited(p.pidfd) {
		drain = 1
	}
	C.ecx_ep_close_rkeys(a.c, p.ep, p.eparg, f, p.rkeys, C.uint32_t(n), drain)
}

// pidExited reports whether the process of pidfd has exited.
func pidExited(pidfd int) bool {
	fds := [1]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	n, _ := unix.Poll(fds[:], 0)
	return n > 0
}

// failPeer ends every in-flight transfer to p with err and closes p's
// endpoint, releasing its rkeys once nothing can use them.
//
// UCX force-closes only endpoints in error mode PEER: for one in mode NONE
// (a same-host peer) ucp_ep_close_nbx with the force flag returns
// INVALID_PARAM and does nothing, which left the endpoint, its lanes and
// its mapping of the peer's receive FIFO (4 MiB) in place until the worker
// went. Those are closed with a flush instead, which completes at once
// when nothing is outstanding (the direct path sends a dead peer nothing
// but notifications); one that cannot complete (an emulated get the dead
// peer never answers) stays on the closing list until Close. When the
// agent is leaving, mode-NONE endpoints are left to ucp_worker_destroy and
// mode-PEER ones get a flushed close, which Close waits for (within
// closeWait): a forced close of a tcp endpoint lost notifications already
// sent.
func (a *Agent) failPeer(p *peer, err error, leaving bool) {
	if p.Dead != nil {
		return
	}
	p.Dead = err
	for id, x := range p.inflight {
		a.failXfer(x, err)
		delete(p.inflight, id)
	}
	switch {
	case leaving && !p.peerMode:
		// Its rkeys go after Close's last progress (abandonLeft): a get
		// still in UCX's pending queue is sent from there and reads its
		// rkey.
		a.abandoned = append(a.abandoned, abandonedEp{p.eparg, p.rkeys, len(p.regions)})
	case leaving:
		C.ecx_ep_close_rkeys(a.c, p.ep, p.eparg, 0, p.rkeys, C.uint32_t(len(p.regions)), 0)
	default:
		a.closeEp(p, len(p.regions))
	}
	// A same-host peer's emulated gets may never end once its process is
	// gone (its endpoint cannot be force-closed): its fences are lifted
	// then, now or when it exits (fence.go).
	gone := false
	if !leaving && !p.peerMode && p.pidfd >= 0 && a.hasFences(p) {
		gone = exited(p.pidfd) || !a.watchGone(p)
	}
	p.ep, p.eparg, p.rkeys = nil, nil, nil
	a.closePidfd(p)
	delete(a.peerTags, p.tag)
	if gone {
		a.liftPeerFences(p)
	}
}

func (a *Agent) failXfer(x *xfer, err error) {
	a.cancelPost(x)
	x.state = enginekit.Done
	x.err = err
	a.pending.Push(x.id, x.gen, err)
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
	a.failPeer(p, kit.Invalidated(name), false)
	a.dlists.Invalidate(p)
	delete(a.peers, name)
	return nil
}

// checkPids polls every pidfd once and fails the peers that died.
func (a *Agent) checkPids() bool {
	a.lastPoll = time.Now()
	lifted := len(a.gone) > 0 && a.checkGone()
	if len(a.pidPeers) == 0 {
		return lifted
	}
	a.pollfds = a.pollfds[:0]
	for _, p := range a.pidPeers {
		a.pollfds = append(a.pollfds, unix.PollFd{Fd: int32(p.pidfd), Events: unix.POLLIN})
	}
	n, err := unix.Poll(a.pollfds, 0)
	if err != nil || n == 0 {
		return lifted
	}
	var died []*peer
	for i, fd := range a.pollfds {
		if fd.Revents != 0 {
			died = append(died, a.pidPeers[i])
		}
	}
	for _, p := range died {
		a.failPeer(p, nixl.Errorf(nixl.ErrRemoteDisconnect, "ucx: peer %q (pid %d) exited", p.name, p.pid), false)
	}
	return lifted || len(died) > 0
}

// drainPeerErrors handles endpoint errors UCX reported (PEER mode).
func (a *Agent) drainPeerErrors() bool {
	list := C.ecx_err_take(a.c)
	if list == nil {
		return false
	}
	for e := list; e != nil; e = e.next {
		if p := a.peerTags[uint64(e.peer)]; p != nil {
			a.failPeer(p, ucsErrDisconnect(C.int(e.status), "ucx: peer "+p.name), false)
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
