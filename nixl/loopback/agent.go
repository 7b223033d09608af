package loopback

import (
	"encoding/binary"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// MaxNameLen is the longest agent name accepted, in bytes.
const MaxNameLen = 256

// ErrClosed is returned by every method of an Agent after Close or Kill.
// It wraps nixl.ErrNotAllowed.
var ErrClosed error = &nixl.Error{Status: nixl.ErrNotAllowed, Msg: "loopback: agent is closed"}

// The process-wide registry of live agents. An agent leaves it on Close or
// Kill; its name may then be taken by a new incarnation.
var registry = struct {
	sync.Mutex
	agents map[string]*Agent
}{agents: map[string]*Agent{}}

// incarnations numbers every agent ever created, so that metadata of a dead
// agent never reaches a newer agent of the same name.
var incarnations atomic.Uint64

func lookup(name string) *Agent {
	registry.Lock()
	defer registry.Unlock()
	return registry.agents[name]
}

// LiveAgents returns the names of the agents currently registered, sorted.
// Tests use it to check that every agent was closed.
func LiveAgents() []string {
	registry.Lock()
	names := make([]string, 0, len(registry.agents))
	for n := range registry.agents {
		names = append(names, n)
	}
	registry.Unlock()
	sort.Strings(names)
	return names
}

// Option configures New.
type Option func(*config)

type config struct {
	delay time.Duration
}

// WithDelay sets the initial completion delay (see Agent.SetDelay).
func WithDelay(d time.Duration) Option {
	return func(c *config) { c.delay = d }
}

// Agent is a loopback nixl.Agent. Besides the interface it offers fault
// injection (FailNext, SetDelay, Disconnect, Reconnect, Kill), which any
// goroutine may call.
type Agent struct {
	name string
	inc  uint64 // incarnation, unique in the process
	efd  int    // eventfd; -1 once closed

	// Owner state: touched only by the driving goroutine. regions is also
	// read by peers copying to or from this agent, under mu; the owner
	// changes it only while holding mu.
	regions []*region // sorted by addr, non-overlapping
	mems    map[nixl.MemID]*region
	dlists  map[nixl.DlistID]*dlist
	xfers   map[nixl.XferID]*xfer
	spare   []*xfer // released requests kept for reuse
	peers   map[string]*peer
	pending []pendingEntry // posted requests, in post order
	done    []pendingEntry // finished requests not yet reported
	doneHd  int            // first unreported entry of done
	queued  int            // live entries in done[doneHd:]
	nextID  uint64

	// dead is set (under mu) by Close and Kill; the owner's methods check it
	// without locking.
	dead atomic.Bool

	// Fault injection, written by any goroutine.
	faults atomic.Uint64 // high 32 bits: status; low 32 bits: count
	delay  atomic.Int64  // nanoseconds

	mu     sync.Mutex // guards the fields below and regions' changes
	closed bool       // resources released
	killed bool
	inbox  map[string][][]byte
	inboxN atomic.Int64    // messages in inbox; written under mu
	cut    map[string]bool // peers this agent is disconnected from
}

// region is a registered piece of memory.
type region struct {
	id     nixl.MemID
	addr   uint64
	buf    []byte
	mapped bool // allocated by AllocMem: munmap on release
	refs   int  // local dlists pointing into it
}

// peer is loaded remote metadata.
type peer struct {
	name    string
	inc     uint64
	blob    []byte
	spans   nixl.SpanIndex
	invalid bool // invalidated: its lists and requests are dead
}

// dlist is a prepared descriptor list.
type dlist struct {
	id       nixl.DlistID
	peer     *peer // nil for a local list
	descs    descriptors.List
	regs     []*region // local lists: the regions referenced (refs held)
	inflight int       // posted requests using it
}

var (
	_ nixl.Agent     = (*Agent)(nil)
	_ nixl.AnyThread = (*Agent)(nil)
)

// AnyThread reports true: the owner state is plain Go data, so any
// goroutine may drive the agent as long as one does at a time.
func (a *Agent) AnyThread() bool { return true }

// New creates an agent named name and registers it in the process. A name
// already in use by a live agent fails with nixl.ErrNotAllowed.
func New(name string, opts ...Option) (*Agent, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrBackend, "loopback: eventfd: %v", err)
	}
	a := &Agent{
		name:   name,
		inc:    incarnations.Add(1),
		efd:    efd,
		mems:   map[nixl.MemID]*region{},
		dlists: map[nixl.DlistID]*dlist{},
		xfers:  map[nixl.XferID]*xfer{},
		peers:  map[string]*peer{},
		inbox:  map[string][][]byte{},
		cut:    map[string]bool{},
	}
	a.delay.Store(int64(cfg.delay))
	registry.Lock()
	if _, taken := registry.agents[name]; taken {
		registry.Unlock()
		unix.Close(efd)
		return nil, nixl.Errorf(nixl.ErrNotAllowed, "loopback: agent %q already exists", name)
	}
	registry.agents[name] = a
	registry.Unlock()
	return a, nil
}

func checkName(name string) error {
	if name == "" || len(name) > MaxNameLen {
		return nixl.Errorf(nixl.ErrInvalidParam, "loopback: agent name must have 1 to %d bytes, got %d", MaxNameLen, len(name))
	}
	if !utf8.ValidString(name) {
		return nixl.Errorf(nixl.ErrInvalidParam, "loopback: agent name %q is not valid UTF-8", name)
	}
	for _, r := range name {
		if !unicode.IsPrint(r) {
			return nixl.Errorf(nixl.ErrInvalidParam, "loopback: agent name %q has an unprintable character", name)
		}
	}
	return nil
}

// Name returns the agent's name.
func (a *Agent) Name() string { return a.name }

// Incarnation returns the number that tells this agent apart from earlier
// and later agents of the same name.
func (a *Agent) Incarnation() uint64 { return a.inc }

// live returns m[key] of a live agent: ErrClosed once the agent is
// closed, nixl.ErrNotFound (format describes it, given key) for an unknown
// key.
func live[K comparable, V any](a *Agent, m map[K]V, key K, format string) (V, error) {
	var zero V
	if a.dead.Load() {
		return zero, ErrClosed
	}
	v, ok := m[key]
	if !ok {
		return zero, nixl.Errorf(nixl.ErrNotFound, format, key)
	}
	return v, nil
}

func (a *Agent) newID() uint64 {
	a.nextID++
	return a.nextID
}

// --- memory ---------------------------------------------------------------

func checkMemType(mem nixl.MemType) error {
	switch mem {
	case nixl.DRAM:
		return nil
	case nixl.VRAM:
		return nixl.Errorf(nixl.ErrNotSupported, "loopback: %v memory is not supported", mem)
	}
	return nixl.Errorf(nixl.ErrInvalidParam, "loopback: unknown memory type %d", uint8(mem))
}

// RegisterMem registers buf (DRAM only). The agent keeps the slice, so Go
// heap memory works too, unlike with the real engines. Empty buffers and
// buffers overlapping a registered region fail with nixl.ErrInvalidParam.
func (a *Agent) RegisterMem(buf []byte, mem nixl.MemType, devID uint64) (nixl.MemID, error) {
	if a.dead.Load() {
		return 0, ErrClosed
	}
	if err := checkMemType(mem); err != nil {
		return 0, err
	}
	if len(buf) == 0 {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: cannot register an empty buffer")
	}
	return a.addRegion(buf, false)
}

// AllocMem maps length bytes of anonymous memory and registers them. The
// mapping is released by DeregisterMem or Close.
func (a *Agent) AllocMem(length int, mem nixl.MemType, devID uint64) (nixl.MemID, []byte, error) {
	if a.dead.Load() {
		return 0, nil, ErrClosed
	}
	if err := checkMemType(mem); err != nil {
		return 0, nil, err
	}
	if length <= 0 {
		return 0, nil, nixl.Errorf(nixl.ErrInvalidParam, "loopback: cannot allocate %d bytes", length)
	}
	buf, err := unix.Mmap(-1, 0, length, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, nil, nixl.Errorf(nixl.ErrBackend, "loopback: mmap %d bytes: %v", length, err)
	}
	id, err := a.addRegion(buf, true)
	if err != nil {
		unix.Munmap(buf)
		return 0, nil, err
	}
	return id, buf, nil
}

func (a *Agent) addRegion(buf []byte, mapped bool) (nixl.MemID, error) {
	addr := nixl.Addr(buf)
	n := uint64(len(buf))
	if addr+n < addr {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: buffer at %#x wraps", addr)
	}
	i := sort.Search(len(a.regions), func(i int) bool { return a.regions[i].addr >= addr })
	if i > 0 {
		if p := a.regions[i-1]; p.addr+uint64(len(p.buf)) > addr {
			return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: buffer [%#x,+%d) overlaps region %d", addr, n, p.id)
		}
	}
	if i < len(a.regions) {
		if q := a.regions[i]; addr+n > q.addr {
			return 0, nixl.Errorf(nixl.ErrInvalidParam, "loopback: buffer [%#x,+%d) overlaps region %d", addr, n, q.id)
		}
	}
	r := &region{id: nixl.MemID(a.newID()), addr: addr, buf: buf, mapped: mapped}
	rs := make([]*region, 0, len(a.regions)+1)
	rs = append(append(append(rs, a.regions[:i]...), r), a.regions[i:]...)
	a.mu.Lock()
	a.regions = rs
	a.mu.Unlock()
	a.mems[r.id] = r
	return r.id, nil
}

// DeregisterMem releases a region (unmapping it if AllocMem made it). It
// fails with nixl.ErrNotAllowed while a prepared local list points into it.
// Peers that still hold this agent's metadata fail their transfers into the
// released range with nixl.ErrBackend.
func (a *Agent) DeregisterMem(id nixl.MemID) error {
	r, err := live(a, a.mems, id, "loopback: unknown memory id %d")
	if err != nil {
		return err
	}
	if r.refs > 0 {
		return nixl.Errorf(nixl.ErrNotAllowed, "loopback: memory %d is used by %d prepared list(s)", id, r.refs)
	}
	rs := make([]*region, 0, len(a.regions))
	for _, x := range a.regions {
		if x != r {
			rs = append(rs, x)
		}
	}
	// Under mu: a peer copying from or to this region holds mu, so the
	// mapping is gone only once no one uses it.
	a.mu.Lock()
	a.regions = rs
	if r.mapped {
		unix.Munmap(r.buf)
	}
	a.mu.Unlock()
	delete(a.mems, id)
	return nil
}

// findRegion returns the region of rs containing addr, or nil.
func findRegion(rs []*region, addr uint64) *region {
	lo, hi := 0, len(rs)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if rs[m].addr <= addr {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo == 0 {
		return nil
	}
	r := rs[lo-1]
	if addr-r.addr < uint64(len(r.buf)) {
		return r
	}
	return nil
}

func (a *Agent) localSpans() nixl.SpanIndex {
	spans := make([]nixl.Span, len(a.regions))
	for i, r := range a.regions {
		spans[i] = nixl.Span{Addr: r.addr, Len: uint64(len(r.buf))}
	}
	x, _ := nixl.NewSpanIndex(spans) // registered regions are never empty
	return x
}

// --- descriptor lists -----------------------------------------------------

// PrepDlist prepares descs. A local list (peer "") is checked against this
// agent's registered regions, which then cannot be deregistered until the
// list is released; a remote list is checked against the regions the peer
// advertised in its metadata.
func (a *Agent) PrepDlist(peerName string, descs descriptors.List, mem nixl.MemType) (nixl.DlistID, error) {
	if a.dead.Load() {
		return 0, ErrClosed
	}
	if err := checkMemType(mem); err != nil {
		return 0, err
	}
	d := &dlist{descs: append(descriptors.List(nil), descs...)}
	if peerName == "" {
		if err := a.localSpans().CheckList(descs); err != nil {
			return 0, err
		}
		for _, ds := range descs {
			r := findRegion(a.regions, ds.Addr)
			if n := len(d.regs); n == 0 || d.regs[n-1] != r {
				d.regs = append(d.regs, r)
			}
		}
		for _, r := range d.regs {
			r.refs++
		}
	} else {
		p, ok := a.peers[peerName]
		if !ok {
			return 0, nixl.Errorf(nixl.ErrNotFound, "loopback: unknown peer %q", peerName)
		}
		if err := p.spans.CheckList(descs); err != nil {
			return 0, err
		}
		d.peer = p
	}
	d.id = nixl.DlistID(a.newID())
	a.dlists[d.id] = d
	return d.id, nil
}

// ReleaseDlist frees a list. Lists of an invalidated peer can still be
// released. A list used by a posted request fails with
// nixl.ErrNotAllowed; requests made from a released list can no longer be
// posted.
func (a *Agent) ReleaseDlist(id nixl.DlistID) error {
	d, err := live(a, a.dlists, id, "loopback: unknown descriptor list %d")
	if err != nil {
		return err
	}
	if d.inflight > 0 {
		return nixl.Errorf(nixl.ErrNotAllowed, "loopback: descriptor list %d is used by %d posted request(s)", id, d.inflight)
	}
	a.dropDlist(d)
	return nil
}

func (a *Agent) dropDlist(d *dlist) {
	for _, r := range d.regs {
		r.refs--
	}
	d.regs = nil
	delete(a.dlists, d.id)
}

// usable returns nil when d may still be used by a request.
func (a *Agent) usable(d *dlist) error {
	if a.dlists[d.id] != d {
		return nixl.Errorf(nixl.ErrNotFound, "loopback: descriptor list %d was released", d.id)
	}
	if d.peer != nil && d.peer.invalid {
		return nixl.Errorf(nixl.ErrNotFound, "loopback: descriptor list %d belongs to invalidated peer %q", d.id, d.peer.name)
	}
	return nil
}

// --- notifications --------------------------------------------------------

// SendNotif delivers msg to a loaded peer's inbox at once. A peer that is
// gone (closed, killed, restarted) or disconnected fails with
// nixl.ErrRemoteDisconnect.
func (a *Agent) SendNotif(peerName string, msg []byte) error {
	p, err := live(a, a.peers, peerName, "loopback: unknown peer %q")
	if err != nil {
		return err
	}
	t, err := a.reach(p)
	if err != nil {
		return err
	}
	defer t.mu.Unlock()
	t.deliverLocked(a.name, msg)
	return nil
}

// reach returns the live agent behind p, locked, or ErrRemoteDisconnect.
// The caller must not hold a.mu.
func (a *Agent) reach(p *peer) (*Agent, error) {
	if p.invalid {
		return nil, disconnected(p.name, "metadata invalidated")
	}
	a.mu.Lock()
	cut := a.cut[p.name]
	a.mu.Unlock()
	if cut {
		return nil, disconnected(p.name, "disconnected")
	}
	t := lookup(p.name)
	if t == nil || t.inc != p.inc {
		return nil, disconnected(p.name, "agent is gone")
	}
	t.mu.Lock()
	if t.closed || t.killed {
		t.mu.Unlock()
		return nil, disconnected(p.name, "agent is gone")
	}
	if t.cut[a.name] {
		t.mu.Unlock()
		return nil, disconnected(p.name, "peer disconnected from us")
	}
	return t, nil
}

func disconnected(name, why string) error {
	return nixl.Errorf(nixl.ErrRemoteDisconnect, "loopback: peer %q: %s", name, why)
}

// deliverLocked queues a copy of msg from sender and wakes the owner. The
// caller holds a.mu. The eventfd is written after the message is queued, so
// an owner that cleared the fd in Arm and then saw an empty inbox is woken.
func (a *Agent) deliverLocked(sender string, msg []byte) {
	a.inbox[sender] = append(a.inbox[sender], append(make([]byte, 0, len(msg)), msg...))
	a.inboxN.Add(1)
	a.signal()
}

// GetNotifs moves the received notifications into dst. A nil dst takes
// nothing.
func (a *Agent) GetNotifs(dst map[string][][]byte) int {
	if a.dead.Load() || dst == nil || a.inboxN.Load() == 0 {
		return 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for k, msgs := range a.inbox {
		dst[k] = append(dst[k], msgs...)
		n += len(msgs)
		delete(a.inbox, k)
	}
	a.inboxN.Store(0)
	return n
}

// --- event fd -------------------------------------------------------------

// signal makes the eventfd readable.
func (a *Agent) signal() {
	if a.efd < 0 {
		return
	}
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], 1)
	unix.Write(a.efd, b[:]) // EAGAIN only when the counter is saturated: still readable
}

// EventFD returns an eventfd that becomes readable when a notification
// arrives or a request is posted, or -1 after Close.
func (a *Agent) EventFD() int {
	if a.dead.Load() {
		return -1
	}
	return a.efd
}

func (a *Agent) hasWork() bool {
	return len(a.pending) > 0 || a.queued > 0 || a.inboxN.Load() > 0
}

// Arm returns false when work is pending (posted requests, unreported
// completions, unread notifications). Otherwise it clears the eventfd and
// returns true: the next notification makes the fd readable again.
//
// The fd is read before the final check for work. A notification queued
// after that check writes the fd after the read, so a sleeper wakes; one
// queued before the check is seen by it.
func (a *Agent) Arm() (bool, error) {
	if a.dead.Load() {
		return false, ErrClosed
	}
	if a.hasWork() {
		return false, nil // the fd stays as it is
	}
	var b [8]byte
	unix.Read(a.efd, b[:]) // EAGAIN: already clear
	if a.hasWork() {
		// The read may have consumed the write announcing this work.
		a.signal()
		return false, nil
	}
	return true, nil
}

// --- fault injection ------------------------------------------------------

// FailNext makes the next n posted transfers complete with status instead
// of moving data (no notification is sent). A status that is not an error
// (zero or positive) is taken as nixl.ErrBackend. n <= 0 cancels pending
// failures. Safe from any goroutine.
func (a *Agent) FailNext(n int, status nixl.Status) {
	if n <= 0 {
		a.faults.Store(0)
		return
	}
	if status >= 0 {
		status = nixl.ErrBackend
	}
	if n > 1<<32-1 {
		n = 1<<32 - 1
	}
	a.faults.Store(uint64(uint32(int32(status)))<<32 | uint64(n))
}

// takeFault consumes one injected failure, returning 0 when none is set.
func (a *Agent) takeFault() nixl.Status {
	for {
		v := a.faults.Load()
		if uint32(v) == 0 {
			return 0
		}
		if a.faults.CompareAndSwap(v, v-1) {
			return nixl.Status(int32(v >> 32))
		}
	}
}

// SetDelay makes transfers posted from now on complete no earlier than d
// after PostXfer (at the first Progress past that point). Zero restores
// completion at the next Progress. Safe from any goroutine.
func (a *Agent) SetDelay(d time.Duration) {
	a.delay.Store(int64(max(d, 0)))
}

// Disconnect cuts the link between this agent and peerName, in both
// directions: from now on, transfers between them (in flight ones at their
// next Progress) end with nixl.ErrRemoteDisconnect and notifications
// between them are refused. The name need not be loaded. Safe from any
// goroutine.
func (a *Agent) Disconnect(peerName string) {
	a.mu.Lock()
	a.cut[peerName] = true
	a.mu.Unlock()
}

// Reconnect undoes Disconnect. Safe from any goroutine.
func (a *Agent) Reconnect(peerName string) {
	a.mu.Lock()
	delete(a.cut, peerName)
	a.mu.Unlock()
}

// Kill simulates the agent's process dying. At once the agent leaves the
// registry (its name may be reused), peers' transfers to or from its
// memory end with nixl.ErrRemoteDisconnect, notifications to it are
// refused, and its own methods fail with ErrClosed. Its eventfd is
// signalled so that a sleeping owner wakes and notices. Unlike Close, Kill
// is safe from any goroutine while the owner is still running; the owner
// must still call Close to release the memory and the eventfd.
func (a *Agent) Kill() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.killed {
		return
	}
	a.killed = true
	a.dead.Store(true)
	a.unregister()
	a.signal()
}

func (a *Agent) unregister() {
	registry.Lock()
	if registry.agents[a.name] == a {
		delete(registry.agents, a.name)
	}
	registry.Unlock()
}

// Close cancels every request (none is reported), releases every list,
// peer and region (unmapping AllocMem memory), leaves the registry and
// closes the eventfd. Peers' transfers to or from this agent end with
// nixl.ErrRemoteDisconnect. Close is idempotent and may follow Kill.
func (a *Agent) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	a.dead.Store(true)
	a.unregister()
	unix.Close(a.efd)
	a.efd = -1
	// Peers touch this agent's memory only under mu after checking closed,
	// so from here on no one else uses the regions.
	regions := a.regions
	a.regions = nil
	a.inbox = map[string][][]byte{}
	a.inboxN.Store(0)
	a.mu.Unlock()

	for _, r := range regions {
		if r.mapped {
			unix.Munmap(r.buf)
		}
	}
	clear(a.mems)
	clear(a.dlists)
	clear(a.xfers)
	for _, p := range a.peers {
		p.invalid = true
	}
	clear(a.peers)
	a.pending = nil
	a.done, a.doneHd, a.queued = nil, 0, 0
	return nil
}
