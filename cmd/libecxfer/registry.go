package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ecxfer/ecxfer"
)

// entry is one live transport and the peer ids handed out for it.
type entry struct {
	t         *ecxfer.Transport
	numBlocks int // the transport's; a READ has at most this many indices a side

	// peerMu is held across each add and remove, transport call included:
	// an add and a remove of one name from two threads must not leave the
	// transport holding the peer while its id is forgotten.
	peerMu   sync.Mutex
	byName   map[string]uint64
	peers    atomic.Pointer[map[uint64]string] // copy on write: PostRead reads it without a lock
	nextPeer uint64
}

// The transports, by id. Ids are never reused within a process.
var registry struct {
	mu   sync.RWMutex
	m    map[uint64]*entry
	next uint64
}

func lookup(id uint64) (*entry, error) {
	registry.mu.RLock()
	e := registry.m[id]
	registry.mu.RUnlock()
	if e == nil {
		return nil, fmt.Errorf("%w: id %d", errUnknownTransport, id)
	}
	return e, nil
}

// liveTransports is how many transports are registered.
func liveTransports() int {
	registry.mu.RLock()
	defer registry.mu.RUnlock()
	return len(registry.m)
}

// newTransport creates a transport from ecx_new's JSON options over region
// (nil: the transport allocates its own) and returns its id.
func newTransport(opts []byte, region []byte) (uint64, error) {
	cfg, err := parseOptions(opts)
	if err != nil {
		return 0, err
	}
	cfg.Region = region
	t, err := ecxfer.New(cfg)
	if err != nil {
		return 0, err
	}
	e := &entry{t: t, numBlocks: cfg.NumBlocks, byName: map[string]uint64{}}
	e.peers.Store(&map[uint64]string{})
	registry.mu.Lock()
	if registry.m == nil {
		registry.m = map[uint64]*entry{}
	}
	registry.next++
	id := registry.next
	registry.m[id] = e
	registry.mu.Unlock()
	return id, nil
}

// deregister tears the transport down and then forgets its id. An unknown
// id is not an error: deregistering twice is allowed. The id stays known
// until the teardown has ended, so a second deregister meanwhile finds it
// and waits in Transport.Deregister for the first: neither returns while
// the transport may still touch the caller's region. Other calls meanwhile
// get ErrClosed from the transport.
func deregister(id uint64) error {
	registry.mu.RLock()
	e := registry.m[id]
	registry.mu.RUnlock()
	if e == nil {
		return nil
	}
	err := e.t.Deregister()
	registry.mu.Lock()
	if registry.m[id] == e {
		delete(registry.m, id)
	}
	registry.mu.Unlock()
	return err
}

// blob kinds for ecx_blob.
const (
	blobAgentMetadata = 1
	blobMemDescriptor = 2
)

func blob(id uint64, which int) ([]byte, error) {
	e, err := lookup(id)
	if err != nil {
		return nil, err
	}
	var b []byte
	switch which {
	case blobAgentMetadata:
		b = e.t.AgentMetadata()
	case blobMemDescriptor:
		b = e.t.MemDescriptor()
	default:
		return nil, fmt.Errorf("%w: blob kind %d", errBadArg, which)
	}
	if b == nil {
		return nil, ecxfer.ErrClosed
	}
	return b, nil
}

// addPeer adds a peer and returns its name and id; the same name keeps its
// id when the peer is replaced.
func addPeer(id uint64, metadata, memDesc []byte) (string, uint64, error) {
	e, err := lookup(id)
	if err != nil {
		return "", 0, err
	}
	e.peerMu.Lock()
	defer e.peerMu.Unlock()
	name, err := e.t.AddRemotePeer(metadata, memDesc)
	if err != nil {
		return "", 0, err
	}
	if pid, ok := e.byName[name]; ok {
		return name, pid, nil
	}
	e.nextPeer++
	pid := e.nextPeer
	e.byName[name] = pid
	old := *e.peers.Load()
	m := make(map[uint64]string, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[pid] = name
	e.peers.Store(&m)
	return name, pid, nil
}

// testHookRemoved, when set (tests), runs in removePeer between the
// transport's removal and the ids' update.
var testHookRemoved func()

// removePeer removes the peer by name and forgets its id.
func removePeer(id uint64, name string) error {
	e, err := lookup(id)
	if err != nil {
		return err
	}
	e.peerMu.Lock()
	defer e.peerMu.Unlock()
	err = e.t.RemoveRemotePeer(name)
	if testHookRemoved != nil {
		testHookRemoved()
	}
	if pid, ok := e.byName[name]; ok {
		delete(e.byName, name)
		old := *e.peers.Load()
		m := make(map[uint64]string, len(old))
		for k, v := range old {
			if k != pid {
				m[k] = v
			}
		}
		e.peers.Store(&m)
	}
	return err
}

// postRead posts a READ from the peer with id pid. The index slices and
// notif are only read during the call.
func postRead(id uint64, local []int, pid uint64, remote []int, notif []byte) (int64, error) {
	e, err := lookup(id)
	if err != nil {
		return 0, err
	}
	return e.post(local, pid, remote, notif)
}

// postReadCopy is postRead for index arrays of the caller's (C's): counts
// above the transport's blocks are refused before a byte of them is read,
// and the rest are copied once before they are checked (see copyIdx).
func postReadCopy(id uint64, local []int, pid uint64, remote []int, notif []byte) (int64, error) {
	e, err := lookup(id)
	if err != nil {
		return 0, err
	}
	if len(local) > e.numBlocks || len(remote) > e.numBlocks {
		return 0, fmt.Errorf("%w: %d local and %d remote indices, the transport has %d blocks",
			ecxfer.ErrIndexRange, len(local), len(remote), e.numBlocks)
	}
	lc, rc := copyIdx(local), copyIdx(remote)
	defer func() { putIdx(lc); putIdx(rc) }()
	return e.post(*lc, pid, *rc, notif)
}

func (e *entry) post(local []int, pid uint64, remote []int, notif []byte) (int64, error) {
	name, ok := (*e.peers.Load())[pid]
	if !ok {
		return 0, fmt.Errorf("%w: peer id %d", ecxfer.ErrUnknownPeer, pid)
	}
	h, err := e.t.PostRead(local, name, remote, notif)
	if err != nil {
		return 0, err
	}
	if uint64(h) > math.MaxInt64 {
		// The ABI returns handles as positive int64s, and the handle
		// table never sets bit 63; kept as a guard.
		_ = e.t.ReleaseXferHandle(h)
		return 0, fmt.Errorf("%w: handle %#x does not fit the ABI", ecxfer.ErrEngine, uint64(h))
	}
	return int64(h), nil
}

// The states ecx_check and ecx_wait return (an error is a negative code).
const (
	stateProc = 0
	stateDone = 1
)

func checkState(id, h uint64) (int, error) {
	e, err := lookup(id)
	if err != nil {
		return 0, err
	}
	st, err := e.t.CheckXferState(ecxfer.Handle(h))
	switch st {
	case ecxfer.StateDone:
		return stateDone, nil
	case ecxfer.StateProc:
		return stateProc, nil
	}
	if err == nil {
		err = fmt.Errorf("%w: state %q without an error", ecxfer.ErrEngine, st)
	}
	return 0, err
}

// wait blocks until the READ leaves PROC or timeout passes (negative:
// no limit); it returns stateProc when the time ran out.
func wait(id, h uint64, timeout time.Duration) (int, error) {
	e, err := lookup(id)
	if err != nil {
		return 0, err
	}
	ctx := context.Background()
	if timeout >= 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	err = e.t.Wait(ctx, ecxfer.Handle(h))
	switch {
	case err == nil:
		return stateDone, nil
	case ctx.Err() != nil && err == ctx.Err():
		// Time ran out: report the state as it is now, which need not be
		// PROC (the READ may have ended, or been released, meanwhile).
		return checkState(id, h)
	}
	return 0, err
}

func release(id, h uint64) error {
	e, err := lookup(id)
	if err != nil {
		return err
	}
	return e.t.ReleaseXferHandle(ecxfer.Handle(h))
}

// notifs takes the notifications that have arrived, waiting up to timeout
// for the first (0: not at all; negative: no limit), encoded for ecx_notifs
// (nil when there are none).
func notifs(id uint64, timeout time.Duration) ([]byte, error) {
	e, err := lookup(id)
	if err != nil {
		return nil, err
	}
	var m map[string][][]byte
	if timeout == 0 {
		m = e.t.NewNotifs()
	} else {
		ctx := context.Background()
		if timeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, timeout)
			defer cancel()
		}
		m, err = e.t.WaitNotifs(ctx)
		if err != nil && ctx.Err() == nil {
			return nil, err
		}
	}
	return encodeNotifs(m), nil
}

// encodeNotifs lays the notifications out for ecx_notifs, all integers
// little-endian uint32: the number of senders, then per sender the name's
// length, the name, the number of messages, then per message its length
// and bytes. No notifications: nil.
func encodeNotifs(m map[string][][]byte) []byte {
	if len(m) == 0 {
		return nil
	}
	n := 4
	for name, msgs := range m {
		n += 8 + len(name)
		for _, b := range msgs {
			n += 4 + len(b)
		}
	}
	out := make([]byte, 0, n)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(m)))
	for name, msgs := range m {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(name)))
		out = append(out, name...)
		out = binary.LittleEndian.AppendUint32(out, uint32(len(msgs)))
		for _, b := range msgs {
			out = binary.LittleEndian.AppendUint32(out, uint32(len(b)))
			out = append(out, b...)
		}
	}
	return out
}

// stats returns the transport's counters as JSON.
func stats(id uint64) ([]byte, error) {
	e, err := lookup(id)
	if err != nil {
		return nil, err
	}
	s := e.t.Stats()
	return json.Marshal(map[string]any{
		"reads_posted":    s.ReadsPosted,
		"reads_done":      s.ReadsDone,
		"reads_failed":    s.ReadsFailed,
		"reads_canceled":  s.ReadsCanceled,
		"bytes_read":      s.BytesRead,
		"notifs_sent":     s.NotifsSent,
		"notifs_received": s.NotifsReceived,
		"engine_errors":   s.EngineErrors,
		"live_handles":    s.LiveHandles,
		"in_flight":       s.InFlight,
		"peers":           s.Peers,
		"loop_turns":      s.LoopTurns,
		"parks":           s.Parks,
		"wait_blocks":     s.WaitBlocks,
		"caller_steps":    s.CallerSteps,
		"naps":            s.Naps,
		"direct_peers":    s.DirectPeers,
		"direct_reads":    s.DirectReads,
		"inline_reads":    s.InlineReads,
		"copy_workers":    s.CopyWorkers,
	})
}

// runtimeStats reports what the library holds process-wide, for leak
// checks: live transports and goroutines.
func runtimeStats() []byte {
	b, _ := json.Marshal(map[string]int{
		"transports": liveTransports(),
		"goroutines": runtime.NumGoroutine(),
	})
	return b
}
