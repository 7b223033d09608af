package reactor

import (
	"math/bits"
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/cpu"

	"github.com/ecxfer/ecxfer/internal/copypool"
	"github.com/ecxfer/ecxfer/nixl"
)

// A handle is (generation, slot): the low slotBits bits name the slot, the
// rest is a generation drawn from a counter that only grows. A slot's state
// word holds the generation of the transfer that owns it, in the same bit
// positions, and the transfer's state and error code in the low bits. One
// atomic load of the word therefore answers "is this handle still the
// slot's owner, and what state is it in", with nothing to lock and nothing
// that can be torn: a released or reused slot carries another generation,
// so a stale handle never reads another transfer's state.
//
// Where a new transfer lands: the slot freed last, if it is still free
// (one caller that releases a READ and posts the next keeps reusing one
// slot whose lines are in its cache), else by open addressing: the home
// slot is the xxhash of the generation, and a claim probes forward from
// there for a free word. Hashing spreads concurrent submitters over the
// table, so they do not all fight over the same cache lines, and the
// full-width word comparison on every lookup is the guard against a
// colliding handle.

// Slot states, in the low stateBits of a word.
const (
	stFree      = 0 // no owner (the whole word is zero)
	stProc      = 1 // queued or in flight: its handle has left Post
	stDone      = 2 // every byte landed
	stErr       = 3 // failed; error code in the errcode bits
	stCanceling = 4 // released while in flight; the reactor frees it
	// stClaimed: a Post has claimed the slot and is still filling in its
	// request; its handle has not been handed out. Only that Post changes
	// the word: State and Release answer ErrBadHandle for it, so a caller
	// who passes a handle it was never given (the next generation, say)
	// cannot cancel a READ whose request is half written.
	stClaimed = 5

	stateBits   = 3
	stateMask   = 1<<stateBits - 1
	errShift    = stateBits
	minSlotBits = 8 // room for state and error code below the generation
)

// Error codes stored next to the state. They map one to one onto the
// sentinel errors of this package.
const (
	codeNone uint64 = iota
	codeRemoteDisconnect
	codeTimeout
	codeCanceled
	codeEngine
	codeUnknownPeer
	codeClosed
	numCodes
)

// slot is one table entry. word is read by any goroutine; the request
// fields are written by the submitter that claimed the slot before it
// publishes the handle on the submission ring, and read by the reactor
// after it drains the handle: the ring's atomic publication orders them.
type slot struct {
	word atomic.Uint64

	// request, owned by the submitter until the handle is on the ring,
	// then by the reactor
	peer      *Peer
	localIdx  []int
	remoteIdx []int
	// homeLocal and homeRemote are the slot's own index buffers, which
	// localIdx and remoteIdx use when the list fits (see setIdx).
	homeLocal, homeRemote []int
	notif                 []byte
	hasNotif              bool
	// start is when Post was called (ns on the reactor's clock): the
	// read-duration histogram's post → DONE is measured from it.
	start int64

	// run is the copy of a direct READ while the pool runs it, for callers
	// that check the READ to help with (State). Written by the loop.
	run atomic.Pointer[copypool.Job]
	// pooled: the READ is a direct one for the copy workers (set by Post
	// before the handle is published). Release waits for such a READ's
	// copy to stop.
	pooled atomic.Bool
	// polled: when a caller last checked the READ in a crowd; parkEnd:
	// when such a check last ended a sleep (crowd.go). Reset by Post.
	polled, parkEnd atomic.Int64

	// reactor-only
	job  *dirJob // the copy of a direct READ, while it runs
	xfer nixl.XferID
	// cancelDrained: onCancel drained this transfer's cancel entry while
	// its direct copy ran, and left freeing the slot to endJob.
	cancelDrained bool
	// queued: the READ's submission entry is on the ring, not yet taken
	// by submit (set by Post before it pushes the entry). A READ released
	// then was never posted, and onCancel or submit counts it canceled.
	queued bool
	idx    uint32 // the slot's index in its table, for the table's hint
	bytes  uint64
	_      cpu.CacheLinePad
}

// slotKeep bounds the index and notification buffers a slot keeps between
// transfers (in elements). Reads of up to slotKeep blocks reuse them and
// allocate nothing; larger ones allocate their own, dropped once the engine
// has copied them. Without the bound every slot would keep the buffers of
// the largest request it ever carried, and new transfers can land on
// slots spread over the whole table: Handles slots times 2 x 880 indices
// is hundreds of MiB.
const slotKeep = 64

// trim drops buffers larger than slotKeep.
func (s *slot) trim() {
	s.trimIdx()
	if cap(s.notif) > 8*slotKeep {
		s.notif = nil
	}
}

// trimIdx gives index buffers larger than slotKeep back to bigIdx; the
// notification stays until the READ has ended.
func (s *slot) trimIdx() {
	if cap(s.localIdx) > slotKeep {
		bigIdx.put(s.localIdx)
		s.localIdx = nil
	}
	if cap(s.remoteIdx) > slotKeep {
		bigIdx.put(s.remoteIdx)
		s.remoteIdx = nil
	}
}

// slotIdxPrealloc is the capacity of the index buffers every slot starts
// with (per side), cut from one slab when the table is made: READs of up
// to that many blocks (one block, vLLM's fan-in of a few) allocate nothing
// from the first, wherever they land. 256 bytes a slot.
const slotIdxPrealloc = 16

// setIdx makes *cur a copy of src: in the slot's own buffer *home when src
// fits (a list of up to slotKeep that does not grows *home to slotKeep,
// once), else in a buffer from bigIdx, so an image READ (880 indices a
// side) allocates nothing once a few such buffers exist, and the slot's
// own buffer survives it.
func setIdx(cur, home *[]int, src []int) {
	switch {
	case len(src) <= cap(*home):
	case len(src) <= slotKeep:
		*home = make([]int, 0, slotKeep)
	default:
		*cur = append(bigIdx.get(len(src))[:0], src...)
		return
	}
	*home = append((*home)[:0], src...)
	*cur = *home
}

// fillMsg copies a notification into dst's storage when it fits, else
// into a buffer from msgPool.
func fillMsg(dst, src []byte) []byte {
	if cap(dst) < len(src) && len(src) <= maxPooledMsg {
		dst = msgPool.get()
	}
	return append(dst[:0], src...)
}

// msgPool keeps notification buffers (up to maxPooledMsg bytes) for any
// slot: the reactor takes a READ's buffer out of its slot when the READ
// ends (the slot may be reused at once) and gives it back here once the
// notification is sent. Without it every slot would allocate its first
// buffer, and READs can land on slots all over the table.
var msgPool = bufPool{}

const (
	maxPooledMsg = 8 * slotKeep
	maxPooled    = 4096
)

type bufPool struct {
	mu   sync.Mutex
	free [][]byte
}

func (p *bufPool) get() []byte {
	p.mu.Lock()
	if n := len(p.free); n > 0 {
		b := p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
		p.mu.Unlock()
		return b[:0]
	}
	p.mu.Unlock()
	return make([]byte, 0, maxPooledMsg)
}

func (p *bufPool) put(b []byte) {
	if cap(b) == 0 || cap(b) > maxPooledMsg {
		return
	}
	p.mu.Lock()
	if len(p.free) < maxPooled {
		p.free = append(p.free, b[:0])
	}
	p.mu.Unlock()
}

// idxPool keeps index buffers longer than slotKeep for any slot to reuse:
// slots keep only small ones, and large READs can land on slots all over
// the table. Callers take buffers in Post, the loop returns them.
type idxPool struct {
	mu   sync.Mutex
	free [][]int
}

var bigIdx idxPool

// maxBigIdx bounds the buffers kept: two per large READ in flight at once.
// maxBigIdxLen bounds each one's length: the pool is the process's and
// outlives every transport, so a few READs of millions of indices must not
// leave gigabytes behind (128 of 16,384 indices is 16 MiB at most).
const (
	maxBigIdx    = 128
	maxBigIdxLen = 1 << 14
)

func (p *idxPool) get(n int) []int {
	p.mu.Lock()
	for i := len(p.free) - 1; i >= 0; i-- {
		if b := p.free[i]; cap(b) >= n {
			last := len(p.free) - 1
			p.free[i] = p.free[last]
			p.free[last] = nil
			p.free = p.free[:last]
			p.mu.Unlock()
			return b[:0]
		}
	}
	p.mu.Unlock()
	return make([]int, 0, max(n, 1024))
}

func (p *idxPool) put(b []int) {
	if cap(b) > maxBigIdxLen {
		return
	}
	p.mu.Lock()
	if len(p.free) < maxBigIdx {
		p.free = append(p.free, b[:0])
	}
	p.mu.Unlock()
}

// table is the fixed-capacity handle table.
type table struct {
	slots    []slot
	slotBits uint
	mask     uint64
	gen      atomic.Uint64 // last generation handed out
	live     atomic.Int64  // slots not free
	// hint is 1 + the index of the slot freed last (0: none), which claim
	// tries first: a caller that releases a READ and posts the next one
	// gets back a slot still in its cache instead of a cold one.
	hint atomic.Uint64
}

func newTable(capacity int) *table {
	if capacity < 1<<minSlotBits {
		capacity = 1 << minSlotBits
	}
	b := uint(bits.Len(uint(capacity - 1)))
	n := 1 << b
	t := &table{slots: make([]slot, n), slotBits: b, mask: uint64(n - 1)}
	// Each table starts its generations at a random point, so two
	// transports in one process (the C ABI serves several) do not hand out
	// the same handles: one's handle given to the other is unknown there,
	// not another READ. The counter still runs through every generation
	// before one repeats.
	t.gen.Store(rand.Uint64())
	const k = slotIdxPrealloc
	slab := make([]int, 2*k*n)
	for i := range t.slots {
		s := &t.slots[i]
		s.homeLocal = slab[2*k*i : 2*k*i : 2*k*i+k]
		s.homeRemote = slab[2*k*i+k : 2*k*i+k : 2*k*(i+1)]
		s.idx = uint32(i)
	}
	return t
}

// genMask covers a handle's generation: the bits above the slot index,
// but not bit 63. Handles are positive int64s (the C ABI returns them so),
// whatever generation the counter is at.
func (t *table) genMask() uint64 { return ^t.mask &^ (1 << 63) }

// claim finds a free slot and takes it in state CLAIMED: the slot freed
// last if it is still free (hint), else the first free one probing forward
// from the generation's hash. It returns the handle and the slot, or 0 and
// nil when it found every slot taken. A table with free slots is usually
// claimed from within a few probes; only a nearly full one is scanned far.
// The handle is new either way: its generation is.
func (t *table) claim() (uint64, *slot) {
	g := t.gen.Add(1)
	// The generation must be non-zero once shifted, so 0 is never a
	// handle; the shifted generation repeats every 2^(63-slotBits) claims.
	gbits := (g << t.slotBits) & t.genMask()
	if gbits == 0 {
		g = t.gen.Add(1)
		gbits = (g << t.slotBits) & t.genMask()
	}
	if i := t.hint.Swap(0); i != 0 {
		s := &t.slots[i-1]
		if s.word.Load() == 0 && s.word.CompareAndSwap(0, gbits|stClaimed) {
			t.live.Add(1)
			return gbits | (i - 1), s
		}
	}
	var kb [8]byte
	for i := range kb {
		kb[i] = byte(g >> (8 * i))
	}
	home := xxhash.Sum64(kb[:]) & t.mask
	for i := uint64(0); i <= t.mask; i++ {
		idx := (home + i) & t.mask
		s := &t.slots[idx]
		if s.word.Load() != 0 {
			continue
		}
		if s.word.CompareAndSwap(0, gbits|stClaimed) {
			t.live.Add(1)
			return gbits | idx, s
		}
	}
	return 0, nil
}

// claimedWord is the word claim stores for handle h: h's generation, state
// CLAIMED.
func (t *table) claimedWord(h uint64) uint64 { return h&t.genMask() | stClaimed }

// lookup returns the slot a handle names and the slot's current word, or
// nil when the handle is malformed or no longer owns the slot.
func (t *table) lookup(h uint64) (*slot, uint64) {
	if h == 0 || h>>63 != 0 {
		return nil, 0
	}
	s := &t.slots[h&t.mask]
	w := s.word.Load()
	if w == 0 || w&t.genMask() != h&t.genMask() {
		return nil, 0
	}
	return s, w
}

// free returns a slot whose word is exactly w to the free state.
func (t *table) free(s *slot, w uint64) bool {
	if s.word.CompareAndSwap(w, 0) {
		t.live.Add(-1)
		t.hint.Store(1 + uint64(s.idx))
		return true
	}
	return false
}

func wordState(w uint64) uint64 { return w & stateMask }
func wordCode(w uint64, mask uint64) uint64 {
	return (w & mask) >> errShift
}
