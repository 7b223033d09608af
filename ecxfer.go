package ecxfer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/affinity"
	"github.com/ecxfer/ecxfer/internal/copypool"
	"github.com/ecxfer/ecxfer/internal/lifeword"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/reactor"
)

// Handle names one posted READ. It is opaque; 0 is never valid.
type Handle uint64

// State is a READ's state as vLLM spells it.
type State string

// The three states.
const (
	StateDone State = "DONE"
	StateProc State = "PROC"
	StateErr  State = "ERR"
)

// The errors of the transport. They work with errors.Is.
var (
	ErrUnknownPeer      = reactor.ErrUnknownPeer
	ErrIndexMismatch    = reactor.ErrIndexMismatch
	ErrIndexRange       = reactor.ErrIndexRange
	ErrBadHandle        = reactor.ErrBadHandle
	ErrBadMetadata      = reactor.ErrBadMetadata
	ErrBadDescriptor    = reactor.ErrBadDescriptor
	ErrBadNotif         = reactor.ErrBadNotif
	ErrClosed           = reactor.ErrClosed
	ErrBusy             = reactor.ErrBusy
	ErrRemoteDisconnect = reactor.ErrRemoteDisconnect
	ErrTimeout          = reactor.ErrTimeout
	ErrCanceled         = reactor.ErrCanceled
	ErrEngine           = reactor.ErrEngine
	// ErrReactorThread: a call that waits for the reactor (AddRemotePeer,
	// RemoveRemotePeer, Wait and WaitNotifs when they would block, a
	// PostRead waiting for room, Deregister) made from a Logger handler,
	// which runs on the reactor's thread.
	ErrReactorThread = reactor.ErrReactorThread
	// ErrConfig reports a Config that New cannot use, and a peer that
	// AddRemotePeer will not read under this Config (see Config.Direct).
	ErrConfig = reactor.ErrConfig
)

// isOurs reports whether err is one of the package's errors.
func isOurs(err error) bool {
	for _, s := range [...]error{ErrUnknownPeer, ErrIndexMismatch, ErrIndexRange, ErrBadHandle, ErrBadMetadata,
		ErrBadDescriptor, ErrBadNotif, ErrClosed, ErrBusy, ErrRemoteDisconnect, ErrTimeout, ErrCanceled,
		ErrEngine, ErrConfig, ErrNoBackend, ErrReactorThread} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// DataTransport is vLLM's EC data-plane transport.
type DataTransport interface {
	AgentMetadata() []byte
	MemDescriptor() []byte
	AddRemotePeer(metadata, memDescriptor []byte) (agentName string, err error)
	RemoveRemotePeer(agentName string) error
	PostRead(localIndices []int, agentName string, remoteIndices []int, notifMsg []byte) (Handle, error)
	NewNotifs() map[string][][]byte
	CheckXferState(h Handle) (State, error)
	ReleaseXferHandle(h Handle) error
	Deregister() error
}

// Config describes a transport.
type Config struct {
	// AgentName is this agent's name, unique among its peers: 1 to 256
	// bytes of printable ASCII without spaces.
	AgentName string
	// Backend is "ucx" (the default, engine nixl/ucx), "loopback"
	// (in-process, for tests; nixl/loopback) or "nixl" (the NIXL library,
	// engine nixl/libnixl). Package nixl itself is the interface every
	// engine implements, not an engine; see its documentation.
	Backend string
	// BlockSize is the size of one block in bytes; NumBlocks how many
	// blocks the region holds, at most descriptors.DefaultMaxDescs (the
	// longest block list a peer decodes). Both required.
	BlockSize int
	NumBlocks int
	// Region is optional caller memory of at least BlockSize*NumBlocks
	// bytes. It must live outside the Go heap (mmap): the engine keeps its
	// address, and it and remote peers access it while Go code runs; New
	// refuses Go heap memory with ErrConfig, and memory not mapped
	// writable from end to end (READs land in it; a fault there would be
	// taken for the producer's). Nil: the transport allocates the
	// region through the engine, and New first checks that it fits (with a
	// margin) in the memory available, under the memory cgroup's limit and,
	// for the ucx and nixl engines when it is beyond System V shared
	// memory's limits (UCX's fallback is a /dev/shm file), in /dev/shm's
	// free space; a region that does not fit is refused with ErrConfig
	// before anything is allocated.
	Region []byte
	// XferTimeout ends a READ still in flight after this long in ERR
	// (ErrTimeout). Zero means 20 s; negative disables the timeout. It
	// applies to READs through the engine; READs on the direct path are
	// memory copies and are not timed out once their copy runs (a dead
	// producer ends them in ErrRemoteDisconnect instead), but one held
	// before its copy, behind the fence of an engine READ into the same
	// local blocks, ends in ErrTimeout if the fence has not lifted by then.
	XferTimeout time.Duration
	// Reactor tunes the event loop: CPU and NUMA pinning, idle strategy,
	// batch size, ring and table sizes.
	Reactor reactor.Options
	// Logger receives structured events (the Event* constants: peers
	// added, replaced, removed or dead, READs timed out, engine errors,
	// oversized notifications dropped, the reactor's start and stop),
	// never one per READ. Records carry an
	// "agent" attribute with AgentName. Nil means silent. It is handed to
	// the reactor unless Reactor.Logger is already set, which is then used
	// as given (without the "agent" attribute unless it has one). Records
	// are written on the reactor's thread (see reactor.Options.Logger); a
	// handler may call the Transport's methods, but those that wait for
	// that thread return ErrReactorThread there (see it).
	Logger *slog.Logger

	// Direct chooses whether READs of peers on this host bypass the
	// engine: the producer advertises its region (its /dev/shm file, its
	// UCX System V segment, or, for anonymous memory, its process for
	// kernel copies) and the consumer maps it read-only and copies. See
	// DirectMode.
	Direct DirectMode
	// InlineBytes is the largest direct READ the caller copies inside
	// PostRead (the handle is DONE when PostRead returns); larger ones go
	// to the copy workers. Zero means DefaultInlineBytes; negative: none.
	InlineBytes int
	// CopyWorkers is the number of copy threads for direct READs larger
	// than InlineBytes, 0 to 256 (zero: DefaultCopyWorkers). They are
	// pinned like the reactor: with BindNUMA to the node's CPUs, with
	// PinCPU to the other allowed CPUs.
	CopyWorkers int
	// NoGather turns off gathered READs (ucx backend). By default a READ
	// of a peer on another host asks for all its blocks in a few messages
	// and the producer answers with the bytes packed into a few sends,
	// where UCX over tcp would emulate one get per block: one request and
	// one send for each of them, and a producer whose consumer died with
	// gets queued at it could abort inside UCX 1.13. A producer with
	// NoGather does not offer gathers to its consumers, a consumer with it
	// does not use them; either way READs across hosts go as UCX gets.
	// The other backends have no gathered READs and ignore it.
	NoGather bool
	// LargeTCPSegments gives UCX's tcp transport 256 KiB segments both
	// ways instead of 64 KiB (ucx backend), and gathered READs between two
	// transports with it come in 252 KiB answers instead of 60 KiB ones:
	// fewer messages, each a system call at both ends (READs across two
	// network namespaces 5-35% faster, README "Tuning"). A peer that
	// receives in 64 KiB segments cannot take a larger message, and UCX
	// 1.13 does not tell a sender the peer's size, so every peer of such a
	// transport must set it too: AddRemotePeer refuses one whose metadata
	// says otherwise, both ways, and builds from before the option refuse
	// this transport's metadata whole (it is sent as version 2, they read
	// version 1 alone). It conflicts with UCX_TCP_TX_SEG_SIZE or
	// UCX_TCP_RX_SEG_SIZE in the environment.
	LargeTCPSegments bool

	// sharedQueueForTest lifts AddRemotePeer's refusal of shared-queue
	// peers (see DirectOff); for tests only.
	sharedQueueForTest bool
	// noLifewordForTest makes the transport advertise no lifeword, as a
	// producer of an older build: consumers poll its pidfd.
	noLifewordForTest bool
}

// DirectMode says whether READs of same-host peers bypass the engine.
type DirectMode uint8

const (
	// DirectAuto is the default: DirectOn for the ucx backend, DirectOff
	// for loopback and nixl. Where this host cannot identify itself for
	// the same-host check (/proc unreadable), it falls back to the
	// engine path instead of failing New.
	DirectAuto DirectMode = iota
	// DirectOn advertises this transport's region to same-host peers and
	// reads same-host peers that advertise theirs directly. The "nixl"
	// backend cannot carry the advertisement and ignores it.
	DirectOn
	// DirectOff neither advertises nor reads directly: every READ goes
	// through the engine. On the ucx engine that limits same-host peers
	// to engine-allocated regions (their Config.Region nil): UCX 1.13
	// serves gets of a region the peer registered itself with messages
	// through this process's shared-memory receive queue, which a peer
	// killed mid-answer can leave stuck for every peer, so AddRemotePeer
	// refuses such a peer with ErrConfig (unless UCX_TLS leaves shared
	// memory out). The same holds under DirectAuto and DirectOn for such a
	// peer that does not advertise its region or cannot be mapped.
	DirectOff
)

// Defaults of the direct path.
const (
	DefaultInlineBytes = 128 << 10
	DefaultCopyWorkers = 2
	maxCopyWorkers     = 256
)

// The structured events a Transport logs through Config.Logger: the
// record's message is the event name. reactor's documentation lists each
// event's attributes.
const (
	EventReactorStart = reactor.EventReactorStart
	EventReactorStop  = reactor.EventReactorStop
	EventPeerAdded    = reactor.EventPeerAdded
	EventPeerReplaced = reactor.EventPeerReplaced
	EventPeerRemoved  = reactor.EventPeerRemoved
	EventPeerDead     = reactor.EventPeerDead
	EventReadTimeout  = reactor.EventReadTimeout
	EventEngineError  = reactor.EventEngineError
	// EventNotifOversized: a notification longer than MaxNotif was
	// dropped; logged once per sender (for the first 1,024 senders).
	EventNotifOversized = reactor.EventNotifOversized
)

// DefaultXferTimeout is the XferTimeout used when Config leaves it zero.
const DefaultXferTimeout = 20 * time.Second

// maxRegion bounds BlockSize*NumBlocks (1 TiB).
const maxRegion = 1 << 40

// Transport is ecxfer's DataTransport: one engine agent owned by a reactor
// thread. All methods are safe for concurrent use.
type Transport struct {
	cfg     Config
	r       *reactor.Reactor
	agent   nixl.Agent // owned by r's thread; tests reach the loopback engine through it
	mem     []byte     // the registered region, set by setup
	region  atomic.Pointer[[]byte]
	md      []byte
	memDesc []byte
	closed  atomic.Bool
	// deregistered is closed when the first Deregister has finished.
	deregistered chan struct{}

	direct bool           // the direct path is on
	host   shmview.Host   // this process's host, for the same-host check
	pool   *copypool.Pool // copy workers of the direct path
	// notify is the notification socket until the reactor takes it.
	notify *reactor.NotifySocket
	life   *lifeword.Holder // this process's lifeword for same-host consumers, or nil
	// orphan tears the transport down if it is dropped without
	// Deregister; Deregister stops it.
	orphan runtime.Cleanup

	// added remembers what each peer was last added with, so that adding
	// the same metadata and block list again answers at once: the direct
	// path would otherwise open the peer's region anew (map it, load its
	// pages: 190 ms for 1 GiB) only for the reactor to find the peer known
	// and close it again.
	addedMu sync.Mutex
	added   map[string]addedPeer // by name
	addedBy map[uint64]string    // name by hash of metadata and block list
}

// addedPeer is what AddRemotePeer last added a peer with.
type addedPeer struct {
	hash         uint64
	md, memDescs []byte
}

func addedHash(md, memDescs []byte) uint64 {
	var d xxhash.Digest
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(md)))
	_, _ = d.Write(n[:])
	_, _ = d.Write(md)
	_, _ = d.Write(memDescs)
	return d.Sum64()
}

// knownPeer returns the name of a live peer added with exactly this
// metadata and block list.
func (t *Transport) knownPeer(md, memDescs []byte) (string, bool) {
	h := addedHash(md, memDescs)
	t.addedMu.Lock()
	name, ok := t.addedBy[h]
	a := t.added[name]
	t.addedMu.Unlock()
	if !ok || a.hash != h || !bytes.Equal(a.md, md) || !bytes.Equal(a.memDescs, memDescs) {
		return "", false
	}
	// Still the published peer of that name, and alive: else the reactor
	// decides (a dead peer's metadata is refused by some engines).
	return name, t.r.PeerLive(name)
}

// rememberPeer records what name was added with; forgetPeer forgets it.
func (t *Transport) rememberPeer(name string, md, memDescs []byte) {
	h := addedHash(md, memDescs)
	t.addedMu.Lock()
	defer t.addedMu.Unlock()
	if t.added == nil {
		t.added, t.addedBy = map[string]addedPeer{}, map[uint64]string{}
	}
	t.forgetLocked(name)
	t.added[name] = addedPeer{hash: h, md: bytes.Clone(md), memDescs: bytes.Clone(memDescs)}
	t.addedBy[h] = name
}

func (t *Transport) forgetPeer(name string) {
	t.addedMu.Lock()
	t.forgetLocked(name)
	t.addedMu.Unlock()
}

func (t *Transport) forgetLocked(name string) {
	if old, ok := t.added[name]; ok {
		if t.addedBy[old.hash] == name {
			delete(t.addedBy, old.hash)
		}
		delete(t.added, name)
	}
}

var _ DataTransport = (*Transport)(nil)

// New creates a transport: it checks cfg, starts the engine and the
// reactor, registers the region and prepares the local block list. A Config
// it cannot use is ErrConfig, found before anything starts; a backend this
// machine lacks is ErrNoBackend; what the engine or the system refuses
// after that (memory it cannot register, descriptors it cannot open) is
// ErrEngine.
func New(cfg Config) (_ *Transport, err error) {
	defer func() {
		if err != nil && !isOurs(err) {
			err = fmt.Errorf("%w: %w", ErrEngine, err)
		}
	}()
	if cfg.Backend == "" {
		cfg.Backend = "ucx"
	}
	if err := checkConfig(&cfg); err != nil {
		return nil, err
	}
	if cfg.Logger != nil && cfg.Reactor.Logger == nil {
		cfg.Reactor.Logger = cfg.Logger.With(slog.String("agent", cfg.AgentName))
	}
	agent, err := newAgent(cfg)
	if err != nil {
		return nil, err
	}
	t := &Transport{cfg: cfg, agent: agent, deregistered: make(chan struct{})}
	if err := t.startDirect(); err != nil {
		_ = agent.Close()
		return nil, err
	}
	cfg.InlineBytes, cfg.CopyWorkers = t.cfg.InlineBytes, t.cfg.CopyWorkers
	r, err := reactor.Start(agent, cfg.Reactor, t.setup)
	if err != nil {
		_ = agent.Close()
		t.closePool()
		if errors.Is(err, affinity.ErrNoCPU) || errors.Is(err, affinity.ErrNoNode) {
			return nil, fmt.Errorf("%w: %v", ErrConfig, err)
		}
		return nil, err
	}
	t.r = r
	if err := t.enableDirect(); err != nil {
		_ = r.Close()
		t.closePool()
		return nil, err
	}
	t.region.Store(&t.mem)
	if cfg.XferTimeout == 0 {
		cfg.XferTimeout = DefaultXferTimeout
	}
	if cfg.XferTimeout > 0 {
		r.SetTimeout(cfg.XferTimeout)
	}
	t.cfg = cfg
	// A Transport dropped without Deregister would leave its reactor
	// thread, copy workers, engine, descriptors and lifeword (which tells
	// same-host consumers it is alive) behind for good: the cleanup tears
	// them down once it is unreachable. It holds what it closes, not t.
	t.orphan = runtime.AddCleanup(t, func(o *orphaned) { go o.close() },
		&orphaned{r: r, pool: t.pool, notify: t.notify, life: t.life})
	return t, nil
}

// orphaned is what a Transport's cleanup closes (see New), in
// Deregister's order.
type orphaned struct {
	r      *reactor.Reactor
	pool   *copypool.Pool
	notify *reactor.NotifySocket
	life   *lifeword.Holder
}

func (o *orphaned) close() {
	if o.life != nil {
		_ = o.life.Retire()
	}
	_ = o.r.Close()
	if o.pool != nil {
		o.pool.Close()
	}
	o.notify.Close()
	if o.life != nil {
		_ = o.life.Stop()
	}
}

func checkConfig(cfg *Config) error {
	if err := ValidAgentName(cfg.AgentName); err != nil {
		return err
	}
	switch {
	case cfg.BlockSize <= 0:
		return fmt.Errorf("%w: BlockSize %d must be positive", ErrConfig, cfg.BlockSize)
	case cfg.NumBlocks <= 0:
		return fmt.Errorf("%w: NumBlocks %d must be positive", ErrConfig, cfg.NumBlocks)
	case cfg.NumBlocks > descriptors.DefaultMaxDescs:
		// Peers refuse a longer block list: such a transport could be made
		// but never read from.
		return fmt.Errorf("%w: NumBlocks %d exceeds %d, the longest block list a peer accepts",
			ErrConfig, cfg.NumBlocks, descriptors.DefaultMaxDescs)
	case uint64(cfg.BlockSize) > maxRegion/uint64(cfg.NumBlocks):
		return fmt.Errorf("%w: BlockSize*NumBlocks exceeds %d bytes", ErrConfig, uint64(maxRegion))
	case cfg.Region != nil && len(cfg.Region) < cfg.BlockSize*cfg.NumBlocks:
		return fmt.Errorf("%w: Region has %d bytes, need %d", ErrConfig, len(cfg.Region), cfg.BlockSize*cfg.NumBlocks)
	case onGoHeap(cfg.Region):
		return fmt.Errorf("%w: Region is on the Go heap; the engine keeps its address, so it must live outside (mmap it)", ErrConfig)
	case cfg.CopyWorkers < 0 || cfg.CopyWorkers > maxCopyWorkers:
		return fmt.Errorf("%w: CopyWorkers %d (0..%d, 0: DefaultCopyWorkers)", ErrConfig, cfg.CopyWorkers, maxCopyWorkers)
	case cfg.Direct > DirectOff:
		return fmt.Errorf("%w: Direct %d is not a DirectMode", ErrConfig, cfg.Direct)
	case cfg.LargeTCPSegments && cfg.Backend != "ucx":
		return fmt.Errorf("%w: LargeTCPSegments is an option of the ucx backend, not %q", ErrConfig, cfg.Backend)
	}
	if cfg.LargeTCPSegments {
		for _, v := range []string{"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"} {
			if _, ok := os.LookupEnv(v); ok {
				return fmt.Errorf("%w: LargeTCPSegments and %s in the environment: one or the other", ErrConfig, v)
			}
		}
	}
	if err := cfg.Reactor.Check(); err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	if cfg.Region == nil {
		return checkRegionFits(uint64(cfg.BlockSize)*uint64(cfg.NumBlocks), cfg.Backend != "loopback")
	}
	return checkRegionWritable(cfg.Region[:cfg.BlockSize*cfg.NumBlocks])
}

// ValidAgentName reports whether name can name an agent: 1 to 256 bytes of
// printable ASCII without spaces.
func ValidAgentName(name string) error {
	if !reactor.ValidName(name) {
		return fmt.Errorf("%w: agent name %s: want 1 to 256 bytes of printable ASCII without spaces", ErrConfig,
			reactor.QuoteName(name))
	}
	return nil
}

// setup registers the region and prepares the local block list; it runs on
// the reactor's thread before the loop starts.
func (t *Transport) setup(a nixl.Agent) (descriptors.List, nixl.DlistID, error) {
	size := t.cfg.BlockSize * t.cfg.NumBlocks
	var region []byte
	var err error
	if t.cfg.Region != nil {
		region = t.cfg.Region[:size:size]
		_, err = a.RegisterMem(region, nixl.DRAM, 0)
	} else {
		_, region, err = a.AllocMem(size, nixl.DRAM, 0)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("ecxfer: registering %d bytes: %w", size, err)
	}
	if o := t.cfg.Reactor; o.BindNUMA {
		if err := affinity.BindMemory(region, o.NUMANode); err != nil {
			return nil, 0, fmt.Errorf("%w: %v", ErrConfig, err)
		}
	}
	base := nixl.Addr(region)
	descs := descriptors.BuildBlockDescs(base, t.cfg.NumBlocks, uint64(t.cfg.BlockSize), 0)
	dl, err := a.PrepDlist("", descs, nixl.DRAM)
	if err != nil {
		return nil, 0, fmt.Errorf("ecxfer: preparing local list: %w", err)
	}
	if t.md, err = a.LocalMetadata(); err != nil {
		return nil, 0, fmt.Errorf("ecxfer: local metadata: %w", err)
	}
	t.advertise(region)
	if t.memDesc, err = descriptors.Encode(descs); err != nil {
		return nil, 0, fmt.Errorf("ecxfer: encoding descriptors: %w", err)
	}
	t.mem = region
	return descs, dl, nil
}

// Region returns the registered block memory (block i at
// [i*BlockSize, (i+1)*BlockSize)), or nil after Deregister.
func (t *Transport) Region() []byte {
	if p := t.region.Load(); p != nil {
		return *p
	}
	return nil
}

// AgentMetadata returns the serialized agent metadata a peer passes to
// AddRemotePeer, or nil after Deregister.
func (t *Transport) AgentMetadata() []byte {
	if t.closed.Load() {
		return nil
	}
	return append([]byte(nil), t.md...)
}

// MemDescriptor returns vLLM's msgpack list of [addr, len, dev] per block,
// or nil after Deregister.
func (t *Transport) MemDescriptor() []byte {
	if t.closed.Load() {
		return nil
	}
	return append([]byte(nil), t.memDesc...)
}

// AddRemotePeer loads a peer's agent metadata and block descriptors and
// returns its name. The same metadata twice returns the same name; new
// metadata under a known name replaces the peer (reads of the old one end
// in ErrRemoteDisconnect), and so does the same metadata with a different
// block list. On the ucx engine the replacement is loaded and
// its block list prepared beside the old peer first: when that fails, the
// call returns the error and the old peer is left as it was.
//
// A peer found dead (EventPeerDead: its process exited, its connection
// failed, or a direct copy from it faulted because its region file was
// truncated) stays dead when the same metadata is added again: its READs
// keep ending in ErrRemoteDisconnect. RemoveRemotePeer and then
// AddRemotePeer load it afresh, once the cause is gone.
func (t *Transport) AddRemotePeer(metadata, memDescriptor []byte) (string, error) {
	if t.closed.Load() {
		return "", ErrClosed
	}
	descs, err := descriptors.Decode(memDescriptor)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrBadDescriptor, err)
	}
	if len(descs) == 0 {
		return "", fmt.Errorf("%w: empty descriptor list", ErrBadDescriptor)
	}
	if err := t.checkPeerDescs(descs); err != nil {
		return "", err
	}
	if len(metadata) == 0 {
		return "", fmt.Errorf("%w: empty", ErrBadMetadata)
	}
	if name, ok := t.knownPeer(metadata, memDescriptor); ok {
		return name, nil
	}
	md, d, err := t.directPeer(metadata, descs)
	var why *directErr
	if err != nil && !errors.As(err, &why) {
		return "", err
	}
	name, err := t.r.AddPeerDirect(md, descs, d)
	if why != nil && errors.Is(err, ErrConfig) {
		err = fmt.Errorf("%w (%v)", err, why)
	}
	if err == nil {
		t.rememberPeer(name, metadata, memDescriptor)
	}
	return name, err
}

// maxDevID bounds a descriptor's device id: vLLM's are small device
// ordinals, and NIXL and C callers hold them in an int.
const maxDevID = 1<<31 - 1

// checkPeerDescs refuses a peer's block list that no READ could use: a
// READ pairs a local block with a remote one of the same size, so every
// remote descriptor must be one block long.
func (t *Transport) checkPeerDescs(descs descriptors.List) error {
	for i, d := range descs {
		switch {
		case d.Len != uint64(t.cfg.BlockSize):
			return fmt.Errorf("%w: descriptor %d is %d bytes long, the block size is %d", ErrBadDescriptor, i, d.Len, t.cfg.BlockSize)
		case d.DevID > maxDevID:
			return fmt.Errorf("%w: descriptor %d: device %d out of range (0..%d)", ErrBadDescriptor, i, d.DevID, maxDevID)
		}
	}
	return nil
}

// RemoveRemotePeer cancels the peer's in-flight reads (they end in
// ErrCanceled), releases its prepared list and endpoint, and forgets it.
// A direct READ whose copy is running ends when the chunks already being
// copied have landed (the rest are skipped), so that once it reads ERR
// nothing more is written into its local blocks. Notifications of READs
// already DONE still reach a direct peer's process over its socket.
func (t *Transport) RemoveRemotePeer(agentName string) error {
	if t.closed.Load() {
		return ErrClosed
	}
	t.forgetPeer(agentName)
	return t.r.RemovePeer(agentName)
}

// PostRead queues a READ of the peer's remoteIndices blocks into the
// localIndices blocks, with notifMsg delivered to the peer once the data
// has landed (none when empty). It never waits for data. The slices may be
// reused as soon as it returns. A READ has 1 to NumBlocks indices on
// each side (ErrIndexRange, for empty lists too), checked before anything
// is copied. The local blocks of READs in flight at the same time must not
// overlap: nothing checks it, and which READ's bytes a shared block ends
// up holding is unspecified (a same-host READ copied inline is DONE when
// PostRead returns, and an earlier READ still in flight into the same
// block may land over it). A READ released or timed out in flight is
// another matter: see ReleaseXferHandle.
func (t *Transport) PostRead(localIndices []int, agentName string, remoteIndices []int, notifMsg []byte) (Handle, error) {
	if n := t.cfg.NumBlocks; len(localIndices) > n || len(remoteIndices) > n {
		return 0, fmt.Errorf("%w: %d local and %d remote indices, at most %d (NumBlocks) each",
			ErrIndexRange, len(localIndices), len(remoteIndices), n)
	}
	h, err := t.r.Post(agentName, localIndices, remoteIndices, notifMsg)
	return Handle(h), err
}

// NewNotifs returns the notifications received since the last call, keyed
// by the sender's agent name. Each is handed out once. Never nil. With the
// direct path on it also drains this transport's notification socket
// itself (non-blocking reads, at most 1,024 datagrams a call, one
// recvfrom when it is empty; it waits for the socket's lock if the
// reactor or another caller is draining it), so a notification from a
// directly reading peer is seen as soon as it arrives, not when the
// reactor next wakes.
func (t *Transport) NewNotifs() map[string][][]byte {
	return t.r.Notifs()
}

// WaitNotifs blocks, without spinning, until at least one notification
// has arrived or ctx ends, and returns what has arrived like NewNotifs.
// The map is never nil; with an error (ctx's, or ErrClosed) it is empty.
// A nil ctx is taken as context.Background().
func (t *Transport) WaitNotifs(ctx context.Context) (map[string][][]byte, error) {
	return t.r.WaitNotifs(ctx)
}

// CheckXferState reports a READ's state: (StateProc, nil) in flight,
// (StateDone, nil) done, (StateErr, err) failed or for a bad handle. It is
// one atomic load: cheap enough to spin on. For a large READ of a direct
// peer that the copy workers have not finished taking, the call first
// copies one untaken chunk itself (at most 256 KiB or the READ divided by
// four times the number of copy workers, whichever is larger: an eighth
// with the default two), so a caller that polls lends
// its CPU to the copy (see the reactor package); once every chunk is
// taken, it yields the processor (sched_yield) to the threads copying
// them, and the call that copied the last chunk may publish the READ's
// end itself and return StateDone. Likewise, for a READ on
// the engine path polled alone (one caller polling one READ, with at most
// one READ per two Ps in flight), the call first takes a step of the
// engine's work when the reactor thread is not in a turn (microseconds: a progress of the engine, as a raw engine
// call would make), so a caller polling in a loop drives the engine and
// the reactor thread stands aside; Config.Reactor.ReactorOnly keeps the
// call a load. And while more engine READs are in flight or queued than
// twice GOMAXPROCS, a call for a READ that its caller polls in a loop
// (checked again within 200 µs) sleeps until some READ ends, at most
// 200 µs, so that many polling goroutines leave the cores to the engine
// and the peer, as callers of a locked design sleep on its lock; a
// caller that checks many READs in turn sleeps at most once per READ
// (see the reactor package, crowd.go).
func (t *Transport) CheckXferState(h Handle) (State, error) {
	st, err := t.r.State(uint64(h))
	switch st {
	case reactor.StateProc:
		return StateProc, nil
	case reactor.StateDone:
		return StateDone, nil
	}
	return StateErr, err
}

// ReleaseXferHandle frees a handle, canceling the READ if it is still in
// flight. A second release returns ErrBadHandle. A direct READ on the copy
// workers is released once its copy has stopped (the chunks already
// running finish, the rest are skipped: at most a few hundred
// microseconds for a READ of 880 × 32 KiB here), so its local blocks may
// take other data as soon as this returns. An engine READ in flight is
// released once the reactor has released it in the engine (any engine: a
// READ posted next reaches the engine after that); a reply already on the
// wire may still land later, in the ucx engine before any later READ into
// the same blocks completes, engine or direct, and in the nixl engine
// before a later READ into those blocks is posted: such READs are held
// until then (README, "Failure behaviour"). Called from a Logger handler,
// on the reactor's thread, it does not wait (it would wait for itself): a
// direct READ's copy may still be writing its blocks when it returns, and
// the next loop turn releases an engine READ, before any READ posted
// after it.
func (t *Transport) ReleaseXferHandle(h Handle) error {
	return t.r.Release(uint64(h))
}

// Wait blocks until the READ leaves PROC or ctx ends. It returns nil for
// DONE, the READ's error for ERR, ctx's error when ctx ends first. It
// checks the READ between yields of the processor for up to
// Config.Reactor.WaitSpin (default 50µs) before it sleeps: waking a
// sleeping goroutine can cost more than a short READ takes. Like
// CheckXferState it copies the chunks of a large same-host READ that no
// copy worker has taken, one at a time, and looks at ctx after each. A
// nil ctx is taken as context.Background(): no limit but XferTimeout.
func (t *Transport) Wait(ctx context.Context, h Handle) error {
	return t.r.Wait(ctx, uint64(h))
}

// Stats is a snapshot of the transport's counters.
type Stats = reactor.Stats

// Stats returns the counters without stopping the reactor. They may trail
// the states callers see by a moment: the reactor counts a READ it
// finishes right after publishing its state.
func (t *Transport) Stats() Stats { return t.r.Stats() }

// PeerStat is one peer's path, state and counters.
type PeerStat = reactor.PeerStat

// PeerStats appends every known peer's state and counters to dst, in no
// particular order; counted as Stats. The counters are those of the
// peer's name: a peer that replaces one of its name (restarted, or a new
// block list) takes them over, and they start from zero for a name
// removed and added again.
func (t *Transport) PeerStats(dst []PeerStat) []PeerStat { return t.r.PeerStats(dst) }

// ReactorCPU is the CPU time (user and system) the reactor thread has
// used. It reads /proc, so it costs microseconds; after Deregister it
// returns the thread's final total.
func (t *Transport) ReactorCPU() (time.Duration, error) { return t.r.ThreadCPU() }

// AgentName is the name given in Config.AgentName.
func (t *Transport) AgentName() string { return t.cfg.AgentName }

// Deregister tears everything down: handles, lists, peers, memory, the
// engine and the reactor thread. It is idempotent (a second call returns
// nil once the first has finished). Afterwards the methods that post,
// check, release or add and remove peers return ErrClosed (PostRead may
// first refuse index lists longer than NumBlocks with ErrIndexRange);
// NewNotifs and WaitNotifs still hand out notifications that arrived
// before, then WaitNotifs returns ErrClosed; AgentMetadata and
// MemDescriptor return nil; Stats, PeerStats and ReactorCPU keep
// reporting the final figures. A Transport dropped without Deregister is
// torn down the same way some time after the garbage collector finds it
// unreachable (do not count on when: a caller's Config.Region must stay
// mapped until then, so call Deregister), and the region Region returned
// is unmapped then: a slice of it does not keep the Transport alive.
func (t *Transport) Deregister() error {
	if t.r.OnThread() {
		return ErrReactorThread // the teardown runs on that thread
	}
	if t.closed.Swap(true) {
		// Returns once the first call has finished all of it (copy
		// workers joined, region let go), not just the reactor: a caller
		// may unmap its Config.Region when this returns.
		<-t.deregistered
		return nil
	}
	defer close(t.deregistered)
	t.orphan.Stop()
	// The lifeword first: a same-host consumer's direct READ that ends
	// from here on fails, before the region goes or changes hands. Its
	// descriptor stays open until the engine has closed (closePool): a
	// consumer that adds this producer meanwhile still finds the word,
	// retired, where a closed descriptor would have left it polling a
	// pidfd that never fires, its READs DONE from a region no longer
	// this transport's (TestAddDuringProducerDeregister).
	t.retireLife()
	err := t.r.Close()
	t.closePool()
	t.region.Store(nil)
	return err
}
