package libnixl

/*
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"
	"unsafe"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// firstBuf is the size of the first buffer LocalMetadata and GetNotifs
// give the shim; the shim says when it needs more and the buffer grows.
const firstBuf = 64 << 10

// maxNameLen bounds agent names.
const maxNameLen = 256

// Config configures New.
type Config struct {
	// Name is the agent's name as peers know it (1..256 bytes).
	Name string
	// LibPath is the shim library to load. Empty: $ECXFER_NIXL_LIB, else
	// the library next to NIXL's under $NIXL_PREFIX, then $VIRTUAL_ENV,
	// then the nearest .venv from the working directory up, else the
	// dynamic loader's search path.
	LibPath string
	// BackendParams override NIXL's defaults for its UCX backend (keys as
	// NIXL names them, e.g. "ucx_error_handling_mode": "none"). Keys may
	// not contain '=' or newlines, values not newlines. Nil: taken from
	// $ECXFER_NIXL_PARAMS ("key=value,key=value"), if set.
	BackendParams map[string]string
	// MaxNotif limits notification size; 0 means nixl.DefaultMaxNotif.
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

// A peer's PeerBase.Dead is set when NIXL reported the peer gone.
type peer struct {
	enginekit.PeerBase
	name     string
	blob     []byte
	spans    nixl.SpanIndex
	checked  bool // spans hold the regions the peer advertised
	zombies  int  // released requests to this peer still running in NIXL
	draining bool // invalidated; NIXL forgets it once zombies is 0
	inflight map[nixl.XferID]*xfer
}

type dlist struct {
	enginekit.ListBase[*peer, *region]
	c *C.ecxnixl_dlist
}

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
// would cancel it on release, but UCX (1.13 when this was written against a
// source build; the wheel now brings 1.23) keeps a cancelled get on its
// endpoint until the get completes, and closing that endpoint or
// destroying the worker first aborts the process (a UCX assertion). So the
// request is kept and polled until it finishes, and only then released;
// its peer is not invalidated in NIXL before its zombies are gone.
type zombie struct {
	req  *C.ecxnixl_req
	peer *peer
	// mems are the local regions the request writes into: it holds a
	// reference on each until it finishes, so they cannot be deregistered
	// (and an allocated one unmapped) under it.
	mems []*region
	// spans are the local ranges a zombie READ may still write: no READ
	// into them is posted until it has finished (PostXfer).
	spans []enginekit.Interval
}

// Agent is the NIXL engine: a nixl.Agent over one NIXL agent (UCX
// backend, DRAM) reached through the shim library.
type Agent struct {
	name     string
	cfg      Config
	lib      *lib
	c        *C.ecxnixl_agent
	closed   bool
	ids      enginekit.IDs
	mems     enginekit.Regions[*region]
	peers    map[string]*peer
	dlists   enginekit.Lists[*dlist, *peer, *region]
	xfers    map[nixl.XferID]*xfer
	inflight []*xfer
	reqs     []*C.ecxnixl_req // parallel to inflight
	sts      []int32
	pending  enginekit.Completions
	zombies  []zombie
	zspans   []enginekit.Interval // every zombie's spans, merged (valid unless zdirty)
	zdirty   bool
	held     []heldXfer // READs into local blocks a zombie may still write
	zreqs    []*C.ecxnixl_req
	zsts     []int32
	draining map[string]*peer
	nbuf     unsafe.Pointer // C buffer for notification records
	ncap     int
	dropped  uint64 // notification records that failed parseNotifs
	// notifications the shim dropped (too long, or no memory), as it
	// last said
	shimDropped uint64
	// lastNotif is when SendNotif last handed NIXL a notification: NIXL
	// reports a send still in progress as done, so Close drives the
	// worker a while after a recent one (notifFlush).
	lastNotif time.Time
	// addrFormat is ownAddrFormat's answer, once addrFormatRead
	addrFormat     int
	addrFormatRead bool
	one            [1]*C.ecxnixl_req
	oneSt          [1]int32
	rangeBuf       []descriptors.Range
}

var _ nixl.Agent = (*Agent)(nil)

// parseParams reads $ECXFER_NIXL_PARAMS: "key=value,key=value", blanks
// around keys and values dropped.
func parseParams(env string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(env, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: %s: %q is not key=value", EnvParams, kv)
		}
		out[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return out, nil
}

// encodeParams writes the backend parameters as the shim reads them: one
// "key=value" line each, sorted by key; the shim splits a line at its
// first '='. A key that is empty or holds '=' or a newline, or a value
// that holds a newline, is refused.
func encodeParams(p map[string]string) (string, error) {
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		v := p[k]
		if k == "" || strings.ContainsAny(k, "=\n") || strings.ContainsRune(v, '\n') {
			return "", nixl.Errorf(nixl.ErrInvalidParam, "libnixl: backend parameter %q", k)
		}
		b.WriteString(k + "=" + v + "\n")
	}
	return b.String(), nil
}

// New loads the shim library (see Config.LibPath) and creates a NIXL agent
// with no progress thread and one UCX backend. When the library cannot be
// found the error wraps ErrNotInstalled; when it cannot be used,
// ErrBadLibrary.
func New(cfg Config) (*Agent, error) {
	if err := kit.CheckConfig(cfg.Name, maxNameLen, &cfg.MaxNotif, nixl.DefaultMaxNotif); err != nil {
		return nil, err
	}
	if cfg.BackendParams == nil {
		if env := os.Getenv(EnvParams); env != "" {
			var err error
			if cfg.BackendParams, err = parseParams(env); err != nil {
				return nil, err
			}
		}
	}
	params, err := encodeParams(cfg.BackendParams)
	if err != nil {
		return nil, err
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
		dlists: enginekit.NewLists[*dlist](),
		xfers:  map[nixl.XferID]*xfer{},

		draining: map[string]*peer{},
	}
	cname := C.CString(cfg.Name)
	cparams := C.CString(params)
	const errCap = 1024
	ebuf := (*C.char)(C.malloc(errCap))
	*ebuf = 0
	enginekit.UCXInit.Lock()
	st := C.ecx_dl_agent_create(l.c, cname, C.size_t(len(cfg.Name)), cparams, C.size_t(len(params)),
		&a.c, ebuf, errCap)
	enginekit.UCXInit.Unlock()
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
	a.ncap = firstBuf
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

// Name implements nixl.Agent.
func (a *Agent) Name() string { return a.name }

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
	released := len(a.held) > 0 && a.releaseHeld()
	return a.checkInflight() > 0 || released, nil
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

// notifFlush is how long Close drives NIXL's worker, before it closes the
// connections, when a notification was sent within notifRecent: NIXL
// answers a send UCX still has in progress as done, and keeps no handle
// of it to wait for, and the connections' close cancels what is still
// queued (every notification of a burst sent right before Close was lost,
// "Request canceled"). A guess at an upper bound, not a wait for their
// end, which NIXL does not report.
const (
	notifFlush  = 50 * time.Millisecond
	notifRecent = time.Second
)

// Close implements nixl.Agent: in-flight requests are given closeWait to
// finish, the worker is driven for notifFlush after a notification sent
// within notifRecent, then requests, lists, peers and regions are released
// and the NIXL agent is destroyed.
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
	a.held = nil
	a.pending.Reset()
	deadline := time.Now().Add(closeWait)
	for len(a.zombies) > 0 && time.Now().Before(deadline) {
		a.reap()
		if len(a.zombies) > 0 {
			time.Sleep(50 * time.Microsecond)
		}
	}
	if !a.lastNotif.IsZero() && time.Since(a.lastNotif) < notifRecent {
		// Notifications sent recently may still wait in UCX: drive the
		// worker (GetNotifs does; what it brings in goes with the agent).
		scratch := map[string][][]byte{}
		for end := time.Now().Add(notifFlush); time.Now().Before(end); {
			a.getNotifs(scratch)
			clear(scratch)
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
	for _, d := range a.dlists.ByID() {
		_ = C.ecx_dl_release_dlist(a.lib.c, a.c, d.c)
	}
	a.dlists.Clear()
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
