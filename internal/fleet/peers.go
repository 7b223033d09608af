package fleet

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/pattern"
)

// PeersConfig sizes a Peers run.
type PeersConfig struct {
	Agents    int // producer agents in all
	Procs     int // processes they are spread over
	BlockSize int
	NumBlocks int // per agent
	// BlocksPerRead is how many blocks each READ of the verification pass
	// takes (every agent is read once, all READs in flight together).
	BlocksPerRead int
}

func (c *PeersConfig) defaults() error {
	if c.Agents <= 0 || c.Procs <= 0 || c.Procs > c.Agents {
		return fmt.Errorf("fleet: %d agents over %d processes", c.Agents, c.Procs)
	}
	if c.BlockSize <= 0 {
		c.BlockSize = 4096
	}
	if c.NumBlocks <= 0 {
		c.NumBlocks = 16
	}
	if c.BlocksPerRead <= 0 || c.BlocksPerRead > c.NumBlocks {
		c.BlocksPerRead = min(4, c.NumBlocks)
	}
	return nil
}

// PeersResult is what a Peers run measured in the consumer process.
type PeersResult struct {
	Agents, Procs              int
	AddP50, AddP99, AddMax     time.Duration // AddRemotePeer, one at a time
	Base, Added, Read, Removed Mem           // before, after adding all, after reading all, after removing all
	ReadsVerified, BlocksRead  int
	ReadAll, RemoveAll, AddAll time.Duration
	PeersSeen                  int // Stats().Peers with all added
	LeakErr                    error
}

// PerPeer is a figure's growth per agent between two snapshots.
func (r *PeersResult) PerPeer(from, to int64) float64 {
	return float64(to-from) / float64(r.Agents)
}

type agentInfo struct {
	name     string
	md, desc []byte
	seed     uint64
}

// Peers starts cfg.Procs processes holding cfg.Agents producer agents,
// adds every agent to one consumer transport here, timing each
// AddRemotePeer, reads from every agent with the bytes verified, removes
// them all, and checks that nothing is left: no shared memory mapped
// beyond the baseline, no descriptor, no goroutine.
func Peers(ctx context.Context, cfg PeersConfig) (*PeersResult, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	res, err := peers(ctx, cfg)
	return res, interrupted(ctx, "peers", err)
}

func peers(ctx context.Context, cfg PeersConfig) (*PeersResult, error) {
	res := &PeersResult{Agents: cfg.Agents, Procs: cfg.Procs}
	var procs group
	defer procs.stopAll()
	defer procs.watch(ctx)()
	agents, err := startAgents(cfg, &procs)
	if err != nil {
		return nil, err
	}
	cons, err := ecxfer.New(ecxfer.Config{AgentName: fmt.Sprintf("fleet-consumer-%d", monoNow()), BlockSize: cfg.BlockSize,
		NumBlocks: cfg.Agents * cfg.BlocksPerRead, XferTimeout: 30 * time.Second})
	if err != nil {
		return nil, err
	}
	defer cons.Deregister()
	warmUp(cons)
	base := leakcheck.Take()
	res.Base = ReadMem()

	lat := make([]time.Duration, 0, len(agents))
	t0 := time.Now()
	for _, a := range agents {
		s := time.Now()
		name, err := cons.AddRemotePeer(a.md, a.desc)
		lat = append(lat, time.Since(s))
		if err != nil {
			return nil, fmt.Errorf("AddRemotePeer %s: %w", a.name, err)
		}
		if name != a.name {
			return nil, fmt.Errorf("AddRemotePeer: got %q, want %q", name, a.name)
		}
	}
	res.AddAll = time.Since(t0)
	sortDurations(lat)
	res.AddP50, res.AddP99, res.AddMax = quantile(lat, 0.5), quantile(lat, 0.99), lat[len(lat)-1]
	res.PeersSeen = cons.Stats().Peers
	res.Added = ReadMem()

	if err := readAll(ctx, cons, agents, cfg, res); err != nil {
		return res, err
	}
	res.Read = ReadMem()

	t0 = time.Now()
	for _, a := range agents {
		if err := cons.RemoveRemotePeer(a.name); err != nil {
			return res, fmt.Errorf("RemoveRemotePeer %s: %w", a.name, err)
		}
	}
	res.RemoveAll = time.Since(t0)
	res.LeakErr = base.Wait(10 * time.Second)
	res.Removed = ReadMem()
	return res, nil
}

// warmUp makes the runtime and the transport open what they keep for
// good (the poller's descriptors) before the baseline is taken.
func warmUp(cons *ecxfer.Transport) {
	_ = cons.Stats()
	_, _ = cons.ReactorCPU()
}

// readAll posts one READ to every agent, all in flight together, waits for
// them and verifies every block.
func readAll(ctx context.Context, cons *ecxfer.Transport, agents []agentInfo, cfg PeersConfig, res *PeersResult) error {
	k := cfg.BlocksPerRead
	hs := make([]ecxfer.Handle, len(agents))
	t0 := time.Now()
	for i, a := range agents {
		local, remote := make([]int, k), make([]int, k)
		for j := range k {
			local[j] = i*k + j
			remote[j] = (i + j) % cfg.NumBlocks
		}
		h, err := cons.PostRead(local, a.name, remote, []byte("fleet"))
		if err != nil {
			return fmt.Errorf("PostRead %s: %w", a.name, err)
		}
		hs[i] = h
	}
	for i, h := range hs {
		if err := cons.Wait(ctx, h); err != nil {
			return fmt.Errorf("READ from %s: %w", agents[i].name, err)
		}
	}
	res.ReadAll = time.Since(t0)
	region := cons.Region()
	bs := cfg.BlockSize
	for i, a := range agents {
		for j := range k {
			got := region[(i*k+j)*bs : (i*k+j+1)*bs]
			if ok, off := pattern.Check(got, a.seed, (i+j)%cfg.NumBlocks); !ok {
				return fmt.Errorf("agent %s block %d: wrong byte at %d", a.name, (i+j)%cfg.NumBlocks, off)
			}
			res.BlocksRead++
		}
		res.ReadsVerified++
		if err := cons.ReleaseXferHandle(hs[i]); err != nil {
			return err
		}
	}
	return nil
}

// startAgents starts the processes and collects every agent's metadata.
func startAgents(cfg PeersConfig, procs *group) ([]agentInfo, error) {
	var (
		agents []agentInfo
		mu     sync.Mutex
		wg     sync.WaitGroup
		errs   []string
	)
	for p := 0; p < cfg.Procs; p++ {
		n := cfg.Agents / cfg.Procs
		if p < cfg.Agents%cfg.Procs {
			n++
		}
		proc, err := Spawn("agents", nil, nil)
		if err != nil {
			return nil, err
		}
		procs.add(proc)
		wg.Add(1)
		go func(p int, proc *Proc) {
			defer wg.Done()
			got, err := setupAgents(proc.C, p, n, cfg)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err.Error())
			}
			agents = append(agents, got...)
		}(p, proc)
	}
	wg.Wait()
	if len(errs) > 0 {
		return nil, fmt.Errorf("fleet: starting agents: %s", strings.Join(errs, "; "))
	}
	return agents, nil
}

func setupAgents(c *ctrl.Conn, p, n int, cfg PeersConfig) ([]agentInfo, error) {
	err := c.Send(ctrl.Message{Kind: "setup", Ints: map[string]int64{
		"proc": int64(p), "n": int64(n), "bs": int64(cfg.BlockSize), "nb": int64(cfg.NumBlocks)}})
	if err != nil {
		return nil, err
	}
	var out []agentInfo
	for {
		m, err := c.Recv()
		if err != nil {
			return out, fmt.Errorf("agents process %d: %w", p, err)
		}
		switch m.Kind {
		case "agent":
			out = append(out, agentInfo{name: m.Name, md: m.Metadata, desc: m.MemDesc, seed: uint64(m.Ints["seed"])})
		case "ready":
			return out, nil
		default:
			return out, fmt.Errorf("agents process %d: %q: %s", p, m.Kind, m.Strs["error"])
		}
	}
}

// agentsChild hosts n producer agents until its stdin closes.
func agentsChild(c *ctrl.Conn) error {
	m, err := c.Expect("setup")
	if err != nil {
		return err
	}
	p, n, bs, nb := m.Ints["proc"], int(m.Ints["n"]), int(m.Ints["bs"]), int(m.Ints["nb"])
	var trs []*ecxfer.Transport
	defer func() {
		for _, t := range trs {
			_ = t.Deregister()
		}
	}()
	// The parent closes stdin to stop the child, also while it is still
	// making its agents (an interrupted run): it stops between two, and
	// deregisters those it made, rather than being killed in the middle
	// of UCX's setup, which leaves a shared-memory file behind.
	eof := make(chan error, 1)
	go func() { eof <- waitEOF(c) }()
	for i := 0; i < n; i++ {
		select {
		case err := <-eof:
			return err
		default:
		}
		name := fmt.Sprintf("fleet-agent-%d-%d-%d", monoNow()%1e9, p, i)
		t, err := ecxfer.New(ecxfer.Config{AgentName: name, BlockSize: bs, NumBlocks: nb})
		if err != nil {
			_ = c.Send(ctrl.Message{Kind: "error", Strs: map[string]string{"error": err.Error()}})
			return err
		}
		trs = append(trs, t)
		seed := uint64(p)<<32 | uint64(i) + 1
		pattern.FillRegion(t.Region(), seed, bs)
		if err := c.Send(ctrl.Message{Kind: "agent", Name: name, Metadata: t.AgentMetadata(), MemDesc: t.MemDescriptor(),
			Ints: map[string]int64{"seed": int64(seed)}}); err != nil {
			return err
		}
	}
	if err := c.Send(ctrl.Message{Kind: "ready"}); err != nil {
		return err
	}
	return <-eof
}
