package ecxfer

import (
	"fmt"
	"slices"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/affinity"
	"github.com/ecxfer/ecxfer/internal/copypool"
	"github.com/ecxfer/ecxfer/internal/lifeword"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/reactor"
)

// The direct path, transport side: which transports advertise, which peers
// are read directly, and the copy workers. The reactor package documents
// where each copy happens.

// directOn resolves Config.Direct for the configured backend: DirectAuto
// is on for the ucx engine only (the loopback engine exists to isolate the
// reactor, and NIXL's metadata cannot carry the advertisement).
func directOn(cfg *Config) bool {
	switch cfg.Direct {
	case DirectOn:
		return cfg.Backend != "nixl"
	case DirectAuto:
		return cfg.Backend == "ucx"
	}
	return false
}

// startDirect starts the copy workers when the direct path is on.
func (t *Transport) startDirect() error {
	cfg := &t.cfg
	if cfg.InlineBytes == 0 {
		cfg.InlineBytes = DefaultInlineBytes
	}
	if cfg.CopyWorkers == 0 {
		cfg.CopyWorkers = DefaultCopyWorkers
	}
	if !directOn(cfg) {
		return nil
	}
	h, err := shmview.LocalHost()
	if err != nil {
		if cfg.Direct == DirectAuto {
			return nil // this host cannot name itself: the engine path
		}
		return fmt.Errorf("ecxfer: direct path: %w", err)
	}
	cpus, err := copyCPUs(cfg.Reactor)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	p, err := copypool.New(copypool.Options{Workers: cfg.CopyWorkers, CPUs: cpus})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	t.direct, t.host, t.pool = true, h, p
	// A lifeword tells same-host consumers this process is alive with a
	// load instead of a poll of its pidfd after every READ (package
	// lifeword); its descriptor travels in the notification socket's
	// token. Without one (no memfd, a seccomp filter) they poll.
	life, lifeID := -1, uint32(0)
	if !cfg.noLifewordForTest {
		if h, err := lifeword.Hold(); err == nil {
			t.life, life, lifeID = h, h.FD(), h.ID()
		}
	}
	// Same-host notifications travel over a socket of ours (see the
	// reactor package); without one they go through the engine.
	if ns, err := reactor.ListenNotify(life, lifeID); err == nil {
		t.notify = ns
	} else {
		t.stopLife()
	}
	return nil
}

// retireLife retires the lifeword: same-host consumers' direct READs of
// this transport's region fail from then on (it is called first thing in
// Deregister), though the process lives on. Its descriptor stays open
// until stopLife.
func (t *Transport) retireLife() {
	if t.life != nil {
		_ = t.life.Retire()
	}
}

// stopLife retires the lifeword and closes its descriptor.
func (t *Transport) stopLife() {
	if t.life != nil {
		_ = t.life.Stop()
		t.life = nil
	}
}

// copyCPUs pins the copy workers like the reactor: to the NUMA node's
// CPUs, or away from the reactor's own CPU when there are others.
func copyCPUs(o reactor.Options) ([]int, error) {
	switch {
	case o.BindNUMA:
		return affinity.NodeCPUs(o.NUMANode)
	case o.PinCPU:
		all, err := affinity.Allowed()
		if err != nil {
			return nil, err
		}
		others := slices.DeleteFunc(all, func(c int) bool { return c == o.CPU })
		if len(others) == 0 {
			return nil, nil
		}
		return others, nil
	}
	return nil, nil
}

func (t *Transport) closePool() {
	if t.pool != nil {
		t.pool.Close()
	}
	t.notify.Close()
	t.notify = nil
	t.stopLife()
}

// advertise appends the region's advertisement to the metadata. Reactor
// thread (inside setup).
func (t *Transport) advertise(region []byte) {
	if !t.direct {
		return
	}
	adv, err := shmview.Describe(region)
	if err != nil {
		return // nothing a peer could map: peers read through the engine
	}
	if t.notify != nil {
		adv.Notify, adv.NotifyKey = t.notify.Token, t.notify.Key
	}
	t.md = shmview.Wrap(t.md, &adv)
}

// enableDirect turns the reactor's direct path on, before any READ.
func (t *Transport) enableDirect() error {
	if !t.direct {
		return nil
	}
	ns := t.notify
	t.notify = nil // the reactor owns it now, even if SetDirect fails
	return t.r.SetDirect(reactor.DirectOptions{Region: t.mem, Pool: t.pool, InlineBytes: t.cfg.InlineBytes,
		Notify: ns, Name: t.cfg.AgentName})
}

// directPeer takes the advertisement off a peer's metadata and, when the
// peer is on this host and the direct path is on, opens its region. A
// descriptor outside the advertised region is refused. A region that cannot
// be opened (permissions, the producer already gone) leaves the peer on
// the engine path; the reason comes back as a *directErr, which
// AddRemotePeer reports only if the engine path refuses the peer.
func (t *Transport) directPeer(metadata []byte, descs descriptors.List) ([]byte, *reactor.Direct, error) {
	md, adv, err := shmview.Split(metadata)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrBadMetadata, err)
	}
	if adv == nil {
		return md, nil, nil
	}
	for i, d := range descs {
		if !adv.Contains(d.Addr, d.Len) {
			return nil, nil, fmt.Errorf("%w: block %d [%#x, +%d) is outside the advertised region [%#x, +%d)",
				ErrBadDescriptor, i, d.Addr, d.Len, adv.Base, adv.Size)
		}
	}
	if pn, ok := t.agent.(nixl.ProcessNamer); ok {
		// The advertisement says which process's memory the direct path
		// would read; the engine's metadata, which the engine checks, says
		// which process the peer is. They must agree, or a peer could point
		// direct READs (and our notifications) at another process.
		pid, start, ok := pn.MetadataProcess(md)
		switch {
		case !ok:
			// The engine would refuse it too, but only after the region
			// had been opened, mapped and its pages loaded.
			return nil, nil, fmt.Errorf("%w: the engine cannot read the metadata's process", ErrBadMetadata)
		case pid != uint64(adv.PID) || start != adv.Start:
			return nil, nil, fmt.Errorf("%w: its region is advertised as process %d (start %d), its engine metadata is process %d (start %d)",
				ErrBadMetadata, adv.PID, adv.Start, pid, start)
		}
	}
	if !t.direct || !adv.Host.SameHost(t.host) {
		return md, nil, nil
	}
	d, err := reactor.OpenDirect(adv, descs)
	if err != nil {
		// The engine path instead; the reason goes with a refusal.
		return md, nil, &directErr{err}
	}
	return md, d, nil
}

// directErr is why a same-host peer got no direct view: not an error of
// AddRemotePeer unless the engine path refuses the peer too.
type directErr struct{ err error }

func (e *directErr) Error() string { return "no direct view: " + e.err.Error() }

// PeerPath names how READs of a peer travel: "engine", "direct-file" (a
// mapped /dev/shm or memfd file), "direct-sysv" (a mapped System V
// segment) or "direct-proc" (kernel copies); "" for an unknown peer.
func (t *Transport) PeerPath(agentName string) string { return t.r.PeerPath(agentName) }
