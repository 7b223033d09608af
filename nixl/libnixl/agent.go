package libnixl

/*
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// DefaultMaxNotif is the default limit on notification size.
const DefaultMaxNotif = 64 << 10

// maxNameLen bounds agent names.
const maxNameLen = 256

// Config configures New.
type Config struct {
	// Name is the agent's name as peers know it (1..256 bytes).
	Name string
	// LibPath is the shim library to load. Empty: $ECXFER_NIXL_LIB, else
	// the library next to NIXL's under $NIXL_PREFIX, else the dynamic
	// loader's search path.
	LibPath string
	// BackendParams override NIXL's defaults for its UCX backend (keys as
	// NIXL names them, e.g. "ucx_error_handling_mode": "none"). Keys and
	// values may not contain '=' or newlines. Nil: taken from
	// $ECXFER_NIXL_PARAMS ("key=value,key=value"), if set.
	BackendParams map[string]string
	// MaxNotif limits notification size; 0 means DefaultMaxNotif.
	MaxNotif int
}

// kit prefixes this engine's errors.
const kit enginekit.Prefix = "libnixl"

// errClosed is returned by every method of a closed Agent.
var errClosed = kit.Closed()

type region struct {
	enginekit.Region
	dev    uint64
	mapped []byte // AllocMem's mapping, unmapped at DeregisterMem
}

type peer struct {
	name     string
	blob     []byte
	spans    nixl.SpanIndex
	checked  bool  // spans hold the regions the peer advertised
	dead     error // set when NIXL reported the peer gone
	zombies  int   // released requests to this peer still running in NIXL
	draining bool  // invalidated; NIXL forgets it once zombies is 0
	dlists   map[nixl.DlistID]*dlist
	inflight map[nixl.XferID]*xfer
}

type dlist struct {
	id    nixl.DlistID
	peer  *peer // nil: local memory
	c     *C.ecxnixl_dlist
	descs descriptors.List
	mems  []*region // local: regions referenced, each once
	valid bool
}

// Remote implements enginekit.Dlist.
func (d *dlist) Remote() bool { return d.peer != nil }

// Usable implements enginekit.Dlist.
func (d *dlist) Usable() bool { return d.valid && d.peer.dead == nil }

// Gone implements enginekit.Peer.
func (p *peer) Gone() error { return p.dead }

type xfer struct {
	id     nixl.XferID
	op     nixl.Op
	local  *dlist
	remote *dlist
	lidx   []int32
	ridx   []int32
	notif  []byte
	mems   []*region
	req    *C.ecxnixl_req
	state  enginekit.XferState
	slot   int // index in Agent.inflight while in flight
	gen    uint64
	err    error
}

// A zombie is a NIXL request released (or failed) while in flight. NIXL
// would cancel it on release, but UCX 1.13 keeps a cancelled get on its
// endpoint until the get completes, and closing that endpoint or
// destroying the worker first aborts the process (a UCX assertion). So the
// request is kept and polled until it finishes, and only then released;
// its peer is not invalidated in NIXL before its zombies are gone.
type zombie struct {
	req  *C.ecxnixl_req
	peer *peer
}

// Agent is the NIXL engine: a nixl.Agent over one NIXL agent (UCX
// backend, DRAM) reached through the shim library.
type Agent struct {
	name     string
	cfg      Config
	lib      *lib
	c        *C.ecxnixl_agent
	closed   bool
	nextID   uint64
	mems     enginekit.Regions[*region]
	peers    map[string]*peer
	dlists   map[nixl.DlistID]*dlist
	xfers    map[nixl.XferID]*xfer
	inflight []*xfer
	reqs     []*C.ecxnixl_req // parallel to inflight
	sts      []int32
	pending  enginekit.Completions
	zombies  []zombie
	zreqs    []*C.ecxnixl_req
	zsts     []int32
	draining map[string]*peer
	nbuf     unsafe.Pointer // C buffer for notification records
	ncap     int
	one      [1]*C.ecxnixl_req
	oneSt    [1]int32
	rangeBuf []descriptors.Range
}

var _ nixl.Agent = (*Agent)(nil)

// New loads the shim library (see Config.LibPath) and creates a NIXL agent
// with no progress thread and one UCX backend. When the library cannot be
// found the error wraps ErrNotInstalled; when it cannot be used,
// ErrBadLibrary.
func New(cfg Config) (*Agent, error) {
	if err := kit.CheckConfig(cfg.Name, maxNameLen, &cfg.MaxNotif, DefaultMaxNotif); err != nil {
		return nil, err
	}
	if cfg.BackendParams == nil {
		if env := os.Getenv(EnvParams); env != "" {
			cfg.BackendParams = map[string]string{}
			for _, kv := range strings.Split(env, ",") {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return nil, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: %s: %q is not key=value", EnvParams, kv)
				}
				cfg.BackendParams[strings.TrimSpace(k)] = strings.TrimSpace(v)
			}
		}
	}
	var params strings.Builder
	keys := make([]string, 0, len(cfg.BackendParams))
	for k := range cfg.BackendParams {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := cfg.BackendParams[k]
		if k == "" || strings.ContainsAny(k, "=\n") || strings.ContainsRune(v, '\n') {
			return nil, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: backend parameter %q", k)
		}
		params.WriteString(k + "=" + v + "\n")
	}
	l, err := load(cfg.LibPath)
	if err != nil {
		return nil, err
	}
	a := &Agent{
		name:   cfg.Name,
		cfg:    cfg,
		lib:    l,
		mems:   enginekit.NewRegions[*region](kit),
		peers:  map[string]*peer{},
		dlists: map[nixl.DlistID]*dlist{},
		xfers:  map[nixl.XferID]*xfer{},

		draining: map[string]*peer{},
	}
	cname := C.CString(cfg.Name)
	cparams := C.CString(params.String())
	const errCap = 1024
	ebuf := (*C.char)(C.malloc(errCap))
	*ebuf = 0
	st := C.ecx_dl_agent_create(l.c, cname, C.size_t(len(cfg.Name)), cparams, C.size_t(params.Len()),
		&a.c, ebuf, errCap)
	msg := C.GoString(ebuf)
	C.free(unsafe.Pointer(cname))
	C.free(unsafe.Pointer(cparams))
	C.free(unsafe.Pointer(ebuf))
	if st != 0 || a.c == nil {
		if msg == "" {
			msg = "agent creation failed"
		}
		return nil, codeErr(int32(st), "%s (library %s)", msg, l.path)
	}
	a.ncap = 64 << 10
	a.nbuf = C.malloc(C.size_t(a.ncap))
	return a, nil
}

// codeErr turns a raw NIXL status into an error wrapping its nixl.Status,
// with context; nil for success and in-progress.
func codeErr(code int32, format string, args ...any) error {
	err := nixl.FromCode(code)
	if err == nil {
		return nil
	}
	what := fmt.Sprintf(format, args...)
	var st nixl.Status
	if errors.As(err, &st) && st != nixl.ErrUnknown {
		return nixl.Errorf(st, "libnixl: %s", what)
	}
	return nixl.Errorf(nixl.ErrUnknown, "libnixl: %s: status %d", what, code)
}

// xferErr maps the final status of a transfer. NIXL reports a transfer
// whose peer was invalidated or lost as NOT_FOUND.
func xferErr(code int32, id nixl.XferID) error {
	switch nixl.Status(code) {
	case nixl.Success:
		return nil
	case nixl.ErrNotFound, nixl.ErrRemoteDisconnect:
		return nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: xfer %d: peer gone (%v)", id, nixl.Status(code))
	}
	return codeErr(code, "xfer %d", id)
}

func (a *Agent) newID() uint64 {
	a.nextID++
	return a.nextID
}

// Name implements nixl.Agent.
func (a *Agent) Name() string { return a.name }

// ---------------------------------------------------------------- memory

// RegisterMem implements nixl.Agent: the region is registered with NIXL's
// UCX backend. Regions may not overlap one another.
func (a *Agent) RegisterMem(buf []byte, mem nixl.MemType, devID uint64) (nixl.MemID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckRegister(buf, mem); err != nil {
		return 0, err
	}
	return a.register(buf, devID, nil)
}

func (a *Agent) register(buf []byte, devID uint64, mapped []byte) (nixl.MemID, error) {
	addr := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf))))
	n := uint64(len(buf))
	if err := a.mems.CheckOverlap(addr, n); err != nil {
		return 0, err
	}
	st := C.ecx_dl_mem_register(a.lib.c, a.c, C.uint64_t(addr), C.uint64_t(n), C.uint64_t(devID))
	if err := codeErr(int32(st), "registering %d bytes", n); err != nil {
		return 0, err
	}
	m := &region{Region: enginekit.Region{ID: nixl.MemID(a.newID()), Addr: addr, Len: n}, dev: devID, mapped: mapped}
	a.mems.Add(m)
	return m.ID, nil
}

// AllocMem implements nixl.Agent. NIXL does not allocate memory, so the
// region is an anonymous mapping, populated up front (a first touch of a
// page during a transfer costs a fault), then registered.
func (a *Agent) AllocMem(length int, mem nixl.MemType, devID uint64) (nixl.MemID, []byte, error) {
	if a.closed {
		return 0, nil, errClosed
	}
	if err := kit.CheckAlloc(length, mem); err != nil {
		return 0, nil, err
	}
	buf, err := unix.Mmap(-1, 0, length, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return 0, nil, nixl.Errorf(nixl.ErrBackend, "libnixl: mmap %d bytes: %v", length, err)
	}
	id, err := a.register(buf, devID, buf)
	if err != nil {
		_ = unix.Munmap(buf)
		return 0, nil, err
	}
	return id, buf, nil
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
	return a.unregister(m)
}

func (a *Agent) unregister(m *region) error {
	st := C.ecx_dl_mem_deregister(a.lib.c, a.c, C.uint64_t(m.Addr), C.uint64_t(m.Len), C.uint64_t(m.dev))
	err := codeErr(int32(st), "deregistering memory %d", m.ID)
	if m.mapped != nil {
		_ = unix.Munmap(m.mapped)
		m.mapped = nil
	}
	return err
}

// -------------------------------------------------------------- metadata

// LocalMetadata implements nixl.Agent: NIXL's own blob, which NIXL agents
// in other languages (vLLM's Python ones) load as they are.
func (a *Agent) LocalMetadata() ([]byte, error) {
	if a.closed {
		return nil, errClosed
	}
	size := 64 << 10
	for {
		buf := C.malloc(C.size_t(size))
		var n C.size_t
		st := C.ecx_dl_local_md(a.lib.c, a.c, buf, C.size_t(size), &n)
		if st == 0 {
			md := C.GoBytes(buf, C.int(n))
			C.free(buf)
			return md, nil
		}
		C.free(buf)
		if nixl.Status(st) == nixl.ErrInvalidParam && int(n) > size {
			size = int(n)
			continue
		}
		return nil, codeErr(int32(st), "local metadata")
	}
}

// LoadRemoteMetadata implements nixl.Agent. The peer's name is read from
// the blob first, so a changed blob under a loaded name is refused with
// ErrNotAllowed and that name, as the contract asks (NIXL itself refuses it
// without naming the peer). A peer NIXL reported gone is refused the same
// way, whatever the blob, so the caller invalidates it and loads it anew.
func (a *Agent) LoadRemoteMetadata(md []byte) (string, error) {
	if a.closed {
		return "", errClosed
	}
	pm, err := parseMD(md)
	if err != nil {
		return "", err
	}
	if pm.name == a.name {
		return "", nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata names this agent (%q)", a.name)
	}
	if d := a.draining[pm.name]; d != nil {
		if err := a.drain(d, drainWait); err != nil {
			return "", err
		}
	}
	if p := a.peers[pm.name]; p != nil {
		if p.dead == nil && bytes.Equal(p.blob, md) {
			return p.name, nil
		}
		if p.dead != nil {
			return p.name, nixl.Errorf(nixl.ErrNotAllowed, "libnixl: peer %q is gone (%v); invalidate it first", p.name, p.dead)
		}
		return p.name, kit.OtherMetadata(p.name)
	}
	p := &peer{name: pm.name, blob: append([]byte(nil), md...),
		dlists: map[nixl.DlistID]*dlist{}, inflight: map[nixl.XferID]*xfer{}}
	if pm.known {
		if p.spans, err = nixl.NewSpanIndex(pm.regions); err != nil {
			return "", err
		}
		p.checked = true
	}
	const nameCap = 4096
	nbuf := C.malloc(nameCap)
	defer C.free(nbuf)
	var nlen C.size_t
	st := C.ecx_dl_load_md(a.lib.c, a.c, unsafe.Pointer(unsafe.SliceData(md)), C.size_t(len(md)),
		(*C.char)(nbuf), nameCap, &nlen)
	if st != 0 {
		if nixl.Status(st) == nixl.ErrNotAllowed {
			// NIXL holds other metadata under this name (loaded outside
			// this Agent's bookkeeping): name it so the caller invalidates.
			return pm.name, codeErr(int32(st), "peer %q is loaded with other metadata", pm.name)
		}
		return "", codeErr(int32(st), "loading metadata of %q", pm.name)
	}
	if got := C.GoStringN((*C.char)(nbuf), C.int(min(int(nlen), nameCap))); got != pm.name {
		_ = C.ecx_dl_invalidate(a.lib.c, a.c, (*C.char)(nbuf), C.size_t(min(int(nlen), nameCap)))
		return "", nixl.Errorf(nixl.ErrMismatch, "libnixl: metadata names %q but NIXL loaded %q", pm.name, got)
	}
	a.peers[p.name] = p
	return p.name, nil
}

// InvalidateRemoteMetadata implements nixl.Agent. In-flight transfers to
// the peer are cancelled in NIXL and end with ErrRemoteDisconnect; its
// prepared lists stay allocated, and unusable, until released.
func (a *Agent) InvalidateRemoteMetadata(name string) error {
	if a.closed {
		return errClosed
	}
	p := a.peers[name]
	if p != nil {
		a.failPeer(p, kit.Invalidated(name))
		for _, d := range p.dlists {
			d.valid = false
		}
		delete(a.peers, name)
		if p.zombies > 0 {
			p.draining = true
			a.draining[name] = p
			return nil
		}
	}
	if name == "" || a.draining[name] != nil {
		return kit.PeerNotFound(name)
	}
	return a.forget(name, p != nil)
}

// forget invalidates name in NIXL. known says whether this Agent had it
// loaded (then NIXL having dropped it already is no error).
func (a *Agent) forget(name string, known bool) error {
	cname := C.CString(name)
	st := C.ecx_dl_invalidate(a.lib.c, a.c, cname, C.size_t(len(name)))
	C.free(unsafe.Pointer(cname))
	if known && nixl.Status(st) == nixl.ErrNotFound {
		return nil // NIXL already dropped it after a disconnect
	}
	if nixl.Status(st) == nixl.ErrNotFound {
		return kit.PeerNotFound(name)
	}
	return codeErr(int32(st), "invalidating %q", name)
}

// failPeer ends every in-flight transfer to p with err; their NIXL
// requests become zombies.
func (a *Agent) failPeer(p *peer, err error) {
	for id, x := range p.inflight {
		a.unlink(x)
		a.bury(x)
		x.state = enginekit.Done
		x.err = err
		a.pending.Push(x.id, x.gen, err)
		delete(p.inflight, id)
	}
}

// ----------------------------------------------------------------- dlists

// PrepDlist implements nixl.Agent. Local lists are checked against the
// registered regions; remote lists against the regions the peer advertised
// in its metadata (when its layout was known), then by NIXL.
func (a *Agent) PrepDlist(peerName string, descs descriptors.List, mem nixl.MemType) (nixl.DlistID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckMem(mem); err != nil {
		return 0, err
	}
	if len(descs) == 0 {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: empty descriptor list")
	}
	d := &dlist{descs: append(descriptors.List(nil), descs...), valid: true}
	if peerName == "" {
		var i int
		if d.mems, i = a.mems.Covering(descs); i >= 0 {
			ds := descs[i]
			return 0, kit.Errorf(nixl.ErrInvalidParam, "descriptor %d [%#x,+%d) is outside registered memory", i, ds.Addr, ds.Len)
		}
	} else {
		p, err := enginekit.LivePeer(kit, a.peers, peerName)
		if err != nil {
			return 0, err
		}
		if p.checked {
			if err := p.spans.CheckList(descs); err != nil {
				return 0, err
			}
		}
		d.peer = p
	}
	n := len(descs)
	addr := make([]uint64, n)
	ln := make([]uint64, n)
	dev := make([]uint64, n)
	for i, ds := range descs {
		addr[i], ln[i], dev[i] = ds.Addr, ds.Len, ds.DevID
	}
	var cpeer *C.char
	if peerName != "" {
		cpeer = C.CString(peerName)
		defer C.free(unsafe.Pointer(cpeer))
	}
	st := C.ecx_dl_prep_dlist(a.lib.c, a.c, cpeer, C.size_t(len(peerName)),
		(*C.uint64_t)(unsafe.Pointer(&addr[0])), (*C.uint64_t)(unsafe.Pointer(&ln[0])),
		(*C.uint64_t)(unsafe.Pointer(&dev[0])), C.size_t(n), &d.c)
	if err := codeErr(int32(st), "preparing a list of %d descriptors", n); err != nil {
		return 0, err
	}
	enginekit.AddRefs(d.mems, 1)
	d.id = nixl.DlistID(a.newID())
	a.dlists[d.id] = d
	if d.peer != nil {
		d.peer.dlists[d.id] = d
	}
	return d.id, nil
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
	st := C.ecx_dl_release_dlist(a.lib.c, a.c, d.c)
	d.c = nil
	return codeErr(int32(st), "releasing dlist %d", id)
}

// -------------------------------------------------------------- transfers

// MakeXfer implements nixl.Agent. Indices and lengths are checked here;
// the NIXL request itself is made by PostXfer, together with posting it,
// in one call.
func (a *Agent) MakeXfer(op nixl.Op, local nixl.DlistID, localIdx []int, remote nixl.DlistID, remoteIdx []int, notif []byte) (nixl.XferID, error) {
	if a.closed {
		return 0, errClosed
	}
	ld, rd, err := enginekit.XferLists(kit, a.dlists, op, local, remote, len(notif), a.cfg.MaxNotif)
	if err != nil {
		return 0, err
	}
	if len(ld.descs) > 1<<31-1 || len(rd.descs) > 1<<31-1 {
		return 0, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: list too long for NIXL's int indices")
	}
	// MergeRuns checks counts, ranges and paired lengths; the runs
	// themselves are NIXL's business.
	if _, err := kit.MergeRuns(&a.rangeBuf, ld.descs, rd.descs, localIdx, remoteIdx); err != nil {
		return 0, err
	}
	x := &xfer{id: nixl.XferID(a.newID()), op: op, local: ld, remote: rd, slot: -1,
		lidx: make([]int32, len(localIdx)), ridx: make([]int32, len(remoteIdx))}
	for i, v := range localIdx {
		x.lidx[i] = int32(v)
	}
	for i, v := range remoteIdx {
		x.ridx[i] = int32(v)
	}
	if len(notif) > 0 {
		x.notif = append([]byte(nil), notif...)
	}
	x.mems = ld.mems
	enginekit.AddRefs(x.mems, 1)
	a.xfers[x.id] = x
	return x.id, nil
}

// PostXfer implements nixl.Agent: one call makes and posts the NIXL
// request. Reposting a finished request makes a fresh NIXL request.
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
	p := x.remote.peer
	if p.dead != nil {
		return p.dead
	}
	if !x.remote.valid || a.peers[p.name] != p {
		return nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: xfer %d: peer %q is gone", id, p.name)
	}
	a.dropReq(x)
	op := C.int32_t(C.ECXNIXL_OP_READ)
	if x.op == nixl.Write {
		op = C.ECXNIXL_OP_WRITE
	}
	var notif unsafe.Pointer
	if len(x.notif) > 0 {
		notif = unsafe.Pointer(&x.notif[0])
	}
	var li, ri *C.int32_t
	if len(x.lidx) > 0 {
		li = (*C.int32_t)(unsafe.Pointer(&x.lidx[0]))
		ri = (*C.int32_t)(unsafe.Pointer(&x.ridx[0]))
	}
	var req *C.ecxnixl_req
	st := C.ecx_dl_post(a.lib.c, a.c, op, x.local.c, li, x.remote.c, ri, C.size_t(len(x.lidx)),
		notif, C.size_t(len(x.notif)), &req)
	if st < 0 {
		if nixl.Status(st) == nixl.ErrRemoteDisconnect {
			p.dead = nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: peer %q disconnected", p.name)
		}
		return xferPostErr(int32(st), id)
	}
	x.req = req
	x.state = enginekit.Inflight
	x.err = nil
	x.gen++
	x.slot = len(a.inflight)
	a.inflight = append(a.inflight, x)
	a.reqs = append(a.reqs, req)
	p.inflight[x.id] = x
	return nil
}

func xferPostErr(code int32, id nixl.XferID) error {
	if nixl.Status(code) == nixl.ErrNotFound {
		return nixl.Errorf(nixl.ErrRemoteDisconnect, "libnixl: posting xfer %d: peer gone", id)
	}
	return codeErr(code, "posting xfer %d", id)
}

// unlink removes an in-flight x from the in-flight arrays.
func (a *Agent) unlink(x *xfer) {
	i := x.slot
	if i < 0 {
		return
	}
	last := len(a.inflight) - 1
	if i != last {
		a.inflight[i] = a.inflight[last]
		a.reqs[i] = a.reqs[last]
		a.inflight[i].slot = i
	}
	a.inflight[last] = nil
	a.reqs[last] = nil
	a.inflight = a.inflight[:last]
	a.reqs = a.reqs[:last]
	x.slot = -1
}

// dropReq releases x's NIXL request, cancelling it if in flight.
func (a *Agent) dropReq(x *xfer) {
	if x.req != nil {
		_ = C.ecx_dl_release_req(a.lib.c, a.c, x.req)
		x.req = nil
	}
}

// bury turns x's in-flight NIXL request into a zombie.
func (a *Agent) bury(x *xfer) {
	if x.req == nil {
		return
	}
	a.zombies = append(a.zombies, zombie{req: x.req, peer: x.remote.peer})
	x.remote.peer.zombies++
	x.req = nil
}

// reap polls the zombies with one call and releases those that finished;
// a draining peer whose last zombie finished is invalidated in NIXL.
func (a *Agent) reap() {
	n := len(a.zombies)
	if n == 0 {
		return
	}
	a.zreqs = a.zreqs[:0]
	for _, z := range a.zombies {
		a.zreqs = append(a.zreqs, z.req)
	}
	if cap(a.zsts) < n {
		a.zsts = make([]int32, n, 2*n)
	}
	a.zsts = a.zsts[:n]
	if C.ecx_dl_status(a.lib.c, a.c, &a.zreqs[0], (*C.int32_t)(unsafe.Pointer(&a.zsts[0])), C.size_t(n)) <= 0 {
		clear(a.zreqs)
		return
	}
	k := 0
	for i, z := range a.zombies {
		if a.zsts[i] == int32(nixl.InProgress) {
			a.zombies[k] = z
			k++
			continue
		}
		_ = C.ecx_dl_release_req(a.lib.c, a.c, z.req)
		z.peer.zombies--
		if z.peer.zombies == 0 && z.peer.draining {
			z.peer.draining = false
			delete(a.draining, z.peer.name)
			_ = a.forget(z.peer.name, true)
		}
	}
	clear(a.zombies[k:])
	a.zombies = a.zombies[:k]
	clear(a.zreqs)
}

// drainWait bounds how long loading a peer waits for the zombies of its
// previous incarnation.
const drainWait = 2 * time.Second

// drain reaps until p has no zombies left, at most for wait.
func (a *Agent) drain(p *peer, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for p.zombies > 0 {
		a.reap()
		if p.zombies == 0 {
			break
		}
		if time.Now().After(deadline) {
			return nixl.Errorf(nixl.ErrBackend, "libnixl: %d transfers to the previous %q are still running", p.zombies, p.name)
		}
		time.Sleep(50 * time.Microsecond)
	}
	return nil
}

// finish records the final status of in-flight x.
func (a *Agent) finish(x *xfer, code int32) {
	a.unlink(x)
	delete(x.remote.peer.inflight, x.id)
	x.state = enginekit.Done
	x.err = xferErr(code, x.id)
	if nixl.Status(code) == nixl.ErrRemoteDisconnect {
		p := x.remote.peer
		if p.dead == nil {
			p.dead = x.err
		}
	}
	a.pending.Push(x.id, x.gen, x.err)
}

// checkInflight asks NIXL for the status of every in-flight request, in one
// call, and moves the finished ones to the pending queue.
func (a *Agent) checkInflight() int {
	n := len(a.inflight)
	if n == 0 {
		return 0
	}
	if cap(a.sts) < n {
		a.sts = make([]int32, n, 2*n)
	}
	a.sts = a.sts[:n]
	done := C.ecx_dl_status(a.lib.c, a.c, &a.reqs[0], (*C.int32_t)(unsafe.Pointer(&a.sts[0])), C.size_t(n))
	if done <= 0 {
		return 0
	}
	// Backwards, so that unlinking (which moves the last entry into the
	// freed slot) never skips an entry not yet looked at.
	for i := n - 1; i >= 0; i-- {
		if a.sts[i] != int32(nixl.InProgress) {
			a.finish(a.inflight[i], a.sts[i])
		}
	}
	return int(done)
}

// XferStatus implements nixl.Agent. A request that was never posted reports
// (false, ErrNotPosted).
func (a *Agent) XferStatus(id nixl.XferID) (bool, error) {
	if a.closed {
		return true, errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return true, kit.XferNotFound(id)
	}
	switch x.state {
	case enginekit.Idle:
		return false, nixl.ErrNotPosted
	case enginekit.Inflight:
		a.one[0] = x.req
		C.ecx_dl_status(a.lib.c, a.c, &a.one[0], (*C.int32_t)(unsafe.Pointer(&a.oneSt[0])), 1)
		a.one[0] = nil
		if a.oneSt[0] == int32(nixl.InProgress) {
			return false, nil
		}
		a.finish(x, a.oneSt[0])
	}
	return true, x.err
}

// ReleaseXfer implements nixl.Agent. An in-flight request is not reported
// any more, but it is not cancelled in NIXL: it runs to its end as a zombie
// (see zombie), so its data may still land in local memory and its
// notification may still be sent.
func (a *Agent) ReleaseXfer(id nixl.XferID) error {
	if a.closed {
		return errClosed
	}
	x := a.xfers[id]
	if x == nil {
		return kit.XferNotFound(id)
	}
	if x.state == enginekit.Inflight {
		a.unlink(x)
		delete(x.remote.peer.inflight, id)
		a.bury(x)
	} else {
		a.dropReq(x)
	}
	enginekit.AddRefs(x.mems, -1)
	x.mems = nil
	delete(a.xfers, id)
	return nil
}

// PollCompletions implements nixl.Agent.
func (a *Agent) PollCompletions(dst []nixl.Completion) int {
	if a.closed {
		return 0
	}
	return a.pending.Poll(dst, a.live)
}

// live reports whether a queued completion of post gen of request id may
// still be reported.
func (a *Agent) live(id nixl.XferID, gen uint64) bool {
	x := a.xfers[id]
	return x != nil && x.gen == gen && x.state == enginekit.Done
}

// ----------------------------------------------------------- notifications

// SendNotif implements nixl.Agent.
func (a *Agent) SendNotif(peerName string, msg []byte) error {
	if a.closed {
		return errClosed
	}
	if _, err := enginekit.LivePeer(kit, a.peers, peerName); err != nil {
		return err
	}
	if err := kit.CheckNotif(len(msg), a.cfg.MaxNotif); err != nil {
		return err
	}
	cname := C.CString(peerName)
	defer C.free(unsafe.Pointer(cname))
	var m unsafe.Pointer
	if len(msg) > 0 {
		m = unsafe.Pointer(&msg[0])
	}
	st := C.ecx_dl_send_notif(a.lib.c, a.c, cname, C.size_t(len(peerName)), m, C.size_t(len(msg)))
	return codeErr(int32(st), "sending a notification to %q", peerName)
}

// GetNotifs implements nixl.Agent. Each call progresses NIXL (its UCX
// worker), which is also what serves peers' reads of this agent's memory.
func (a *Agent) GetNotifs(dst map[string][][]byte) int {
	if a.closed {
		return 0
	}
	total := 0
	for {
		var used, count C.size_t
		st := C.ecx_dl_notifs(a.lib.c, a.c, a.nbuf, C.size_t(a.ncap), &used, &count)
		if nixl.Status(st) == nixl.ErrInvalidParam && count == 0 && int(used) > a.ncap {
			C.free(a.nbuf)
			a.ncap = int(used)
			a.nbuf = C.malloc(C.size_t(a.ncap))
			continue
		}
		if count == 0 {
			return total
		}
		buf := unsafe.Slice((*byte)(a.nbuf), int(used))
		off := 0
		for i := 0; i < int(count); i++ {
			hl := int(*(*uint32)(unsafe.Pointer(&buf[off])))
			ml := int(*(*uint32)(unsafe.Pointer(&buf[off+4])))
			name := string(buf[off+8 : off+8+hl])
			msg := append([]byte(nil), buf[off+8+hl:off+8+hl+ml]...)
			dst[name] = append(dst[name], msg)
			off += (8 + hl + ml + 7) &^ 7
		}
		total += int(count)
	}
}

// ---------------------------------------------------------------- progress

// Progress implements nixl.Agent: one call checks every in-flight request
// (which drives NIXL's UCX worker and sends notifications of finished
// reads). GetNotifs drives the worker even when nothing is in flight.
func (a *Agent) Progress() (bool, error) {
	if a.closed {
		return false, errClosed
	}
	if len(a.zombies) > 0 {
		a.reap()
	}
	return a.checkInflight() > 0, nil
}

// EventFD implements nixl.Agent: NIXL exposes no descriptor to sleep on.
func (a *Agent) EventFD() int { return -1 }

// Arm implements nixl.Agent. There is nothing to arm; it reports false
// while completions wait to be polled.
func (a *Agent) Arm() (bool, error) {
	if a.closed {
		return false, errClosed
	}
	return a.pending.Len() == 0, nil
}

// --------------------------------------------------------------- teardown

// closeWait bounds how long Close waits for in-flight requests to finish.
const closeWait = 2 * time.Second

// Close implements nixl.Agent: in-flight requests are given closeWait to
// finish, then requests, lists, peers and regions are released and the
// NIXL agent is destroyed.
func (a *Agent) Close() error {
	if a.closed {
		return nil
	}
	a.closed = true
	for id, x := range a.xfers {
		if x.state == enginekit.Inflight {
			a.bury(x)
		} else {
			a.dropReq(x)
		}
		delete(a.xfers, id)
	}
	a.inflight, a.reqs = nil, nil
	a.pending.Reset()
	deadline := time.Now().Add(closeWait)
	for len(a.zombies) > 0 && time.Now().Before(deadline) {
		a.reap()
		if len(a.zombies) > 0 {
			time.Sleep(50 * time.Microsecond)
		}
	}
	if n := len(a.zombies); n > 0 {
		// Destroying the agent now would abort the process inside UCX.
		// Leave it (and the registered memory, which those transfers may
		// still touch) alive instead.
		a.zombies = nil
		return nixl.Errorf(nixl.ErrBackend, "libnixl: %d transfers did not finish within %v; the NIXL agent and its memory were left in place", n, closeWait)
	}
	for id, d := range a.dlists {
		_ = C.ecx_dl_release_dlist(a.lib.c, a.c, d.c)
		delete(a.dlists, id)
	}
	for name := range a.draining {
		delete(a.draining, name)
	}
	for name := range a.peers {
		cname := C.CString(name)
		_ = C.ecx_dl_invalidate(a.lib.c, a.c, cname, C.size_t(len(name)))
		C.free(unsafe.Pointer(cname))
		delete(a.peers, name)
	}
	var err error
	for _, m := range a.mems.Sorted() {
		if e := a.unregister(m); e != nil && err == nil {
			err = e
		}
	}
	a.mems.Clear()
	C.ecx_dl_agent_destroy(a.lib.c, a.c)
	a.c = nil
	C.free(a.nbuf)
	a.nbuf = nil
	return err
}
