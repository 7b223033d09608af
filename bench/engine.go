package bench

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/libnixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
	"github.com/ecxfer/ecxfer/nixl/ucx"
)

// newAgent opens a bare engine agent for the locked and raw modes (large:
// ucx's LargeTCPSegments).
func newAgent(backend, name string, large bool) (nixl.Agent, error) {
	switch backend {
	case "ucx":
		return ucx.New(ucx.Config{Name: name, LargeTCPSegments: large})
	case "loopback":
		return loopback.New(name)
	case "nixl":
		return libnixl.New(libnixl.Config{Name: name})
	}
	return nil, fmt.Errorf("%w: unknown backend %q", ErrUsage, backend)
}

// bareSide is an agent with one engine-allocated region of blocks, used by
// both ends in the locked and raw modes. Engine-allocated memory is what the
// Transport uses by default, so gets stay one-sided in every mode.
type bareSide struct {
	agent  nixl.Agent
	region []byte
	descs  descriptors.List
}

func openBare(backend, name string, bs, nblocks int, large bool) (*bareSide, error) {
	a, err := newAgent(backend, name, large)
	if err != nil {
		return nil, err
	}
	_, region, err := a.AllocMem(bs*nblocks, nixl.DRAM, 0)
	if err != nil {
		_ = a.Close()
		return nil, fmt.Errorf("allocating %d bytes: %w", bs*nblocks, err)
	}
	base := nixl.Addr(region)
	return &bareSide{agent: a, region: region, descs: descriptors.BuildBlockDescs(base, nblocks, uint64(bs), 0)}, nil
}

// agentName returns a name unique in this process and across processes.
func agentName(role string) string {
	nameMu.Lock()
	nameSeq++
	n := nameSeq
	nameMu.Unlock()
	return fmt.Sprintf("ecxbench-%s-%d-%d", role, unix.Getpid(), n)
}

var (
	nameMu  sync.Mutex
	nameSeq int
)

// touch writes every page of b so first-touch faults stay out of the
// measurements.
func touch(b []byte) {
	for i := 0; i < len(b); i += 4096 {
		b[i] = 0
	}
}

// schedYield gives the CPU to another runnable thread, if there is one.
func schedYield() { _, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }

// driver is the consumer's view of one mode: post, check, release.
type driver interface {
	post(local, remote []int, notif []byte) (uint64, error)
	// state reports whether the READ left the in-flight state, and its
	// error if it failed.
	state(id uint64) (bool, error)
	release(id uint64) error
	region() []byte
	close() error
}

// reactorDriver is ecxfer's Transport.
type reactorDriver struct {
	tr    *ecxfer.Transport
	peer  string
	block bool // wait with Transport.Wait instead of polling
}

func (d *reactorDriver) post(local, remote []int, notif []byte) (uint64, error) {
	h, err := d.tr.PostRead(local, d.peer, remote, notif)
	return uint64(h), err
}

func (d *reactorDriver) state(id uint64) (bool, error) {
	st, err := d.tr.CheckXferState(ecxfer.Handle(id))
	return st != ecxfer.StateProc, err
}

func (d *reactorDriver) release(id uint64) error { return d.tr.ReleaseXferHandle(ecxfer.Handle(id)) }
func (d *reactorDriver) region() []byte          { return d.tr.Region() }
func (d *reactorDriver) close() error            { return d.tr.Deregister() }

// agentDriver drives a nixl.Agent directly: with a mutex around every call
// (locked, vLLM's design) or with none (raw, one goroutine only).
type agentDriver struct {
	mu     sync.Locker
	side   *bareSide
	peer   string
	local  nixl.DlistID
	remote nixl.DlistID
}

type noLock struct{}

func (noLock) Lock()   {}
func (noLock) Unlock() {}

func (d *agentDriver) post(local, remote []int, notif []byte) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	a := d.side.agent
	id, err := a.MakeXfer(nixl.Read, d.local, local, d.remote, remote, notif)
	if err != nil {
		return 0, err
	}
	if err := a.PostXfer(id); err != nil {
		_ = a.ReleaseXfer(id)
		return 0, err
	}
	return uint64(id), nil
}

// state progresses the engine and asks for the status, as NIXL's status
// check does: in these modes nothing else ever progresses the engine.
func (d *agentDriver) state(id uint64) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	a := d.side.agent
	if _, err := a.Progress(); err != nil {
		return true, err
	}
	return a.XferStatus(nixl.XferID(id))
}

func (d *agentDriver) release(id uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.side.agent.ReleaseXfer(nixl.XferID(id))
}

func (d *agentDriver) region() []byte { return d.side.region }

func (d *agentDriver) close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	a := d.side.agent
	_ = a.ReleaseDlist(d.local)
	_ = a.ReleaseDlist(d.remote)
	_ = a.InvalidateRemoteMetadata(d.peer)
	return a.Close()
}

// openDriver builds the consumer side of mode against a producer's hello.
func openDriver(mode, backend string, bs int, opts ecxfer.Config, block bool, hello helloMsg) (driver, error) {
	switch mode {
	case "reactor", "direct":
		opts.Direct = ecxfer.DirectOff
		if mode == "direct" {
			opts.Direct = ecxfer.DirectOn
		}
		opts.AgentName = agentName("cons")
		opts.Backend = backend
		opts.BlockSize = bs
		opts.NumBlocks = LocalBlocks
		tr, err := ecxfer.New(opts)
		if err != nil {
			return nil, err
		}
		touch(tr.Region())
		peer, err := tr.AddRemotePeer(hello.md, hello.memDesc)
		if err != nil {
			_ = tr.Deregister()
			return nil, fmt.Errorf("adding the producer: %w", err)
		}
		if path := tr.PeerPath(peer); (mode == "direct") != (path != "engine") {
			_ = tr.Deregister()
			return nil, fmt.Errorf("mode %s: the producer is read on the %s path", mode, path)
		}
		return &reactorDriver{tr: tr, peer: peer, block: block}, nil
	case "locked", "raw":
		side, err := openBare(backend, agentName("cons"), bs, LocalBlocks, opts.LargeTCPSegments)
		if err != nil {
			return nil, err
		}
		touch(side.region)
		a := side.agent
		fail := func(what string, err error) (driver, error) {
			_ = a.Close()
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		ldl, err := a.PrepDlist("", side.descs, nixl.DRAM)
		if err != nil {
			return fail("local list", err)
		}
		peer, err := a.LoadRemoteMetadata(hello.md)
		if err != nil {
			return fail("loading the producer's metadata", err)
		}
		rdescs, err := descriptors.Decode(hello.memDesc)
		if err != nil {
			return fail("producer descriptors", err)
		}
		rdl, err := a.PrepDlist(peer, rdescs, nixl.DRAM)
		if err != nil {
			return fail("remote list", err)
		}
		d := &agentDriver{side: side, peer: peer, local: ldl, remote: rdl, mu: noLock{}}
		if mode == "locked" {
			d.mu = &sync.Mutex{}
		}
		return d, nil
	}
	return nil, fmt.Errorf("%w: unknown mode %q", ErrUsage, mode)
}

// spinChecks is how many times waitDone checks a READ back to back before
// it starts yielding the processor between checks.
const spinChecks = 256

// waitDone polls state until the READ leaves the in-flight state: a short
// burst of back-to-back checks, then one check per yield of the processor,
// the way a polling caller shares its CPU with other goroutines. Every mode
// waits the same way, except reactor mode with Config.Wait "block", which
// uses Transport.Wait.
func waitDone(d driver, id uint64, limit time.Duration) error {
	if w, ok := d.(*reactorDriver); ok && w.block {
		// The transport's XferTimeout (20 s) ends a READ that never
		// completes, so Wait needs no deadline of its own.
		return w.tr.Wait(context.Background(), ecxfer.Handle(id))
	}
	var start time.Time
	for i := 0; ; i++ {
		done, err := d.state(id)
		if done || err != nil {
			return err
		}
		if i < spinChecks {
			continue
		}
		if i&1023 == 0 {
			if start.IsZero() {
				start = time.Now()
			} else if time.Since(start) > limit {
				return fmt.Errorf("READ still in flight after %v", limit)
			}
		}
		runtime.Gosched()
	}
}
