package fleet

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand"
	"runtime"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/reactor"
)

// ConsumersConfig sizes a Consumers run.
type ConsumersConfig struct {
	Consumers     int
	BlockSize     int
	NumBlocks     int // the producer's region
	BlocksPerRead int // scattered blocks per READ
	Duration      time.Duration
	// ProducerWrap and ConsumerWrap are commands the processes run under
	// (ip netns exec NS), and ProducerEnv/ConsumerEnv their extra
	// environment (UCX_TLS, UCX_NET_DEVICES), for runs across namespaces.
	ProducerWrap, ConsumerWrap []string
	ProducerEnv, ConsumerEnv   []string
	// Idle is every reactor's idle strategy (producer and consumers).
	Idle reactor.IdleStrategy
}

func (c *ConsumersConfig) defaults() error {
	if c.Consumers <= 0 {
		return fmt.Errorf("fleet: %d consumers", c.Consumers)
	}
	if c.BlockSize <= 0 {
		c.BlockSize = 32768
	}
	if c.NumBlocks <= 0 {
		c.NumBlocks = 1024
	}
	if c.BlocksPerRead <= 0 {
		c.BlocksPerRead = 64
	}
	c.BlocksPerRead = min(c.BlocksPerRead, c.NumBlocks)
	if c.Duration <= 0 {
		c.Duration = 2 * time.Second
	}
	return nil
}

// ConsumersResult is what a Consumers run measured.
type ConsumersResult struct {
	Consumers        int
	Reads            uint64
	Bytes            uint64
	Duration         time.Duration // the longest consumer's measured time
	Verified         uint64        // READs whose bytes were checked
	Notifs           int           // notifications matched to a READ
	NotifP50         time.Duration // consumer saw DONE → producer's WaitNotifs returned it
	NotifP99         time.Duration
	Early            int           // notifications seen before the consumer saw DONE
	ProducerCPU      time.Duration // the producer reactor's CPU time over the run
	ProducerCPUPerGB time.Duration
}

// GBps is the aggregate throughput.
func (r *ConsumersResult) GBps() float64 {
	if r.Duration <= 0 {
		return 0
	}
	return float64(r.Bytes) / r.Duration.Seconds() / 1e9
}

// Consumers starts one producer process and cfg.Consumers consumer
// processes that read from it together for cfg.Duration, every READ with
// a notification, and reports aggregate throughput, the producer's
// notification latency and its reactor's CPU time per GB served.
func Consumers(ctx context.Context, cfg ConsumersConfig) (*ConsumersResult, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	res, err := consumers(ctx, cfg)
	return res, interrupted(ctx, "consumers", err)
}

func consumers(ctx context.Context, cfg ConsumersConfig) (*ConsumersResult, error) {
	var all group
	defer all.stopAll()
	defer all.watch(ctx)()
	prod, cons, err := startConsumers(cfg, &all)
	if err != nil {
		return nil, err
	}
	if err := prod.C.Send(ctrl.Message{Kind: "start"}); err != nil {
		return nil, err
	}
	if _, err := prod.C.Expect("started"); err != nil {
		return nil, err
	}
	for _, c := range cons {
		if err := c.C.Send(ctrl.Message{Kind: "go", Ints: map[string]int64{"ns": int64(cfg.Duration)}}); err != nil {
			return nil, err
		}
	}
	res := &ConsumersResult{Consumers: cfg.Consumers}
	done, err := collectResults(cons, res)
	if err != nil {
		return nil, err
	}
	// Let the last notifications arrive.
	time.Sleep(100 * time.Millisecond)
	if err := prod.C.Send(ctrl.Message{Kind: "stop"}); err != nil {
		return nil, err
	}
	st, err := prod.C.Expect("stats")
	if err != nil {
		return nil, fmt.Errorf("producer: %w", err)
	}
	res.ProducerCPU = time.Duration(st.Ints["cpu"])
	if res.Bytes > 0 {
		res.ProducerCPUPerGB = time.Duration(float64(res.ProducerCPU) / (float64(res.Bytes) / 1e9))
	}
	notifLatencies(st.Data, done, res)
	return res, nil
}

// startConsumers starts the producer and the consumers (appending them to
// all as they start) and waits until every consumer is connected.
func startConsumers(cfg ConsumersConfig, all *group) (*Proc, []*Proc, error) {
	prod, err := Spawn("producer", cfg.ProducerWrap, cfg.ProducerEnv)
	if err != nil {
		return nil, nil, err
	}
	all.add(prod)
	if err := prod.C.Send(ctrl.Message{Kind: "setup", Ints: map[string]int64{"bs": int64(cfg.BlockSize), "nb": int64(cfg.NumBlocks),
		"idle": int64(cfg.Idle)}}); err != nil {
		return nil, nil, err
	}
	hello, err := prod.C.Expect("hello")
	if err != nil {
		return nil, nil, fmt.Errorf("producer: %w", err)
	}
	cons := make([]*Proc, cfg.Consumers)
	for i := range cons {
		if cons[i], err = Spawn("consumer", cfg.ConsumerWrap, cfg.ConsumerEnv); err != nil {
			return nil, nil, err
		}
		all.add(cons[i])
		err = cons[i].C.Send(ctrl.Message{Kind: "setup", Metadata: hello.Metadata, MemDesc: hello.MemDesc, Ints: map[string]int64{
			"id": int64(i), "bs": int64(cfg.BlockSize), "nb": int64(cfg.NumBlocks), "k": int64(cfg.BlocksPerRead),
			"seed": hello.Ints["seed"], "idle": int64(cfg.Idle)}})
		if err != nil {
			return nil, nil, err
		}
	}
	for i, c := range cons {
		if _, err := c.C.Expect("ready"); err != nil {
			return nil, nil, fmt.Errorf("consumer %d: %w", i, err)
		}
	}
	return prod, cons, nil
}

// collectResults adds up the consumers' results into res and returns when
// each consumer saw each READ DONE, by (consumer, seq).
func collectResults(cons []*Proc, res *ConsumersResult) (map[[2]uint32]int64, error) {
	done := map[[2]uint32]int64{}
	var (
		errs []string
		mu   sync.Mutex
		wg   sync.WaitGroup
	)
	for i, c := range cons {
		wg.Add(1)
		go func(i int, c *Proc) {
			defer wg.Done()
			m, err := c.C.Expect("result")
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Sprintf("consumer %d: %v", i, err))
				return
			}
			res.Reads += uint64(m.Ints["reads"])
			res.Bytes += uint64(m.Ints["bytes"])
			res.Verified += uint64(m.Ints["verified"])
			res.Duration = max(res.Duration, time.Duration(m.Ints["ns"]))
			for b := m.Data; len(b) >= 12; b = b[12:] {
				done[[2]uint32{uint32(i), binary.LittleEndian.Uint32(b)}] = int64(binary.LittleEndian.Uint64(b[4:]))
			}
		}(i, c)
	}
	wg.Wait()
	if len(errs) > 0 {
		return nil, fmt.Errorf("fleet: %s", strings.Join(errs, "; "))
	}
	return done, nil
}

// notifLatencies matches the producer's records (consumer, seq, when it
// got the notification) with when the consumer saw DONE.
func notifLatencies(recs []byte, done map[[2]uint32]int64, res *ConsumersResult) {
	var lat []time.Duration
	for b := recs; len(b) >= 16; b = b[16:] {
		key := [2]uint32{binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:])}
		at, ok := done[key]
		if !ok {
			continue
		}
		d := int64(binary.LittleEndian.Uint64(b[8:])) - at
		if d < 0 {
			res.Early++
			d = 0
		}
		lat = append(lat, time.Duration(d))
	}
	sortDurations(lat)
	res.Notifs = len(lat)
	res.NotifP50, res.NotifP99 = quantile(lat, 0.5), quantile(lat, 0.99)
}

// maxTimed bounds the READs a consumer reports times for.
const maxTimed = 1 << 18

// producerChild is the producer: it serves READs, and between start and
// stop times every notification and its reactor's CPU.
func producerChild(c *ctrl.Conn) error {
	m, err := c.Expect("setup")
	if err != nil {
		return err
	}
	bs, nb := int(m.Ints["bs"]), int(m.Ints["nb"])
	t, err := ecxfer.New(ecxfer.Config{AgentName: fmt.Sprintf("fleet-producer-%d", monoNow()%1e9), BlockSize: bs, NumBlocks: nb,
		Reactor: reactor.Options{Idle: reactor.IdleStrategy(m.Ints["idle"])}})
	if err != nil {
		return err
	}
	defer t.Deregister()
	seed := uint64(monoNow())
	pattern.FillRegion(t.Region(), seed, bs)
	if err := c.Send(ctrl.Message{Kind: "hello", Metadata: t.AgentMetadata(), MemDesc: t.MemDescriptor(), Ints: map[string]int64{"seed": int64(seed)}}); err != nil {
		return err
	}
	if _, err := c.Expect("start"); err != nil {
		return err
	}
	cpu0, _ := t.ReactorCPU()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var recs []byte // (consumer, seq, when) per notification
	collected := make(chan struct{})
	go func() {
		defer close(collected)
		for {
			ns, err := t.WaitNotifs(ctx)
			now := monoNow()
			for _, msgs := range ns {
				for _, msg := range msgs {
					if len(msg) == 8 && len(recs) < ctrl.MaxFrame-4096 {
						recs = binary.LittleEndian.AppendUint64(append(recs, msg...), uint64(now))
					}
				}
			}
			if err != nil {
				return
			}
		}
	}()
	if err := c.Send(ctrl.Message{Kind: "started"}); err != nil {
		return err
	}
	if _, err := c.Expect("stop"); err != nil {
		return err
	}
	cancel()
	<-collected
	cpu1, _ := t.ReactorCPU()
	if err := c.Send(ctrl.Message{Kind: "stats", Data: recs, Ints: map[string]int64{"cpu": int64(cpu1 - cpu0)}}); err != nil {
		return err
	}
	return waitEOF(c)
}

// consumerChild reads scattered blocks from the producer, one READ at a
// time, each with a notification naming it, and verifies every 16th. It
// is longer than most: setup, warm-up and the measured loop share the
// transport and the read closure, and read in order they are the protocol.
func consumerChild(c *ctrl.Conn) error {
	m, err := c.Expect("setup")
	if err != nil {
		return err
	}
	id, bs, nb, k, seed := uint32(m.Ints["id"]), int(m.Ints["bs"]), int(m.Ints["nb"]), int(m.Ints["k"]), uint64(m.Ints["seed"])
	t, err := ecxfer.New(ecxfer.Config{AgentName: fmt.Sprintf("fleet-consumer-%d-%d", monoNow()%1e9, id), BlockSize: bs, NumBlocks: k,
		Reactor: reactor.Options{Idle: reactor.IdleStrategy(m.Ints["idle"])}})
	if err != nil {
		return err
	}
	defer t.Deregister()
	peer, err := t.AddRemotePeer(m.Metadata, m.MemDesc)
	if err != nil {
		return err
	}
	r := &fleetReader{t: t, peer: peer, nb: nb, rng: rand.New(rand.NewSource(int64(id) + 1)),
		local: make([]int, k), remote: make([]int, k)}
	for i := range r.local {
		r.local[i] = i
	}
	for i := 0; i < 8; i++ { // connect and warm up, unmeasured
		h, _, err := r.read(nil)
		if err != nil {
			return err
		}
		if err := t.ReleaseXferHandle(h); err != nil {
			return err
		}
	}
	if err := c.Send(ctrl.Message{Kind: "ready"}); err != nil {
		return err
	}
	g, err := c.Expect("go")
	if err != nil {
		return err
	}
	start := time.Now()
	reads, verified, checking, times, err := r.measure(time.Duration(g.Ints["ns"]), id, bs, seed)
	if err != nil {
		return err
	}
	el := time.Since(start) - checking // the READs' time, as the harness counts it
	err = c.Send(ctrl.Message{Kind: "result", Data: times, Ints: map[string]int64{
		"reads": int64(reads), "bytes": int64(reads) * int64(k*bs), "verified": int64(verified), "ns": int64(el)}})
	if err != nil {
		return err
	}
	return waitEOF(c)
}

// fleetReader is a consumer child's READ of random producer blocks into
// its whole region.
type fleetReader struct {
	t             *ecxfer.Transport
	peer          string
	nb            int // blocks of the producer
	rng           *rand.Rand
	local, remote []int
}

// read READs fresh random blocks and returns when it saw the READ DONE
// (CLOCK_MONOTONIC), with its handle, not yet released.
func (r *fleetReader) read(notif []byte) (ecxfer.Handle, int64, error) {
	for i := range r.remote {
		r.remote[i] = r.rng.Intn(r.nb)
	}
	h, err := r.t.PostRead(r.local, r.peer, r.remote, notif)
	if err != nil {
		return 0, 0, err
	}
	if err := r.t.Wait(context.Background(), h); err != nil {
		_ = r.t.ReleaseXferHandle(h)
		return 0, 0, err
	}
	return h, monoNow(), nil
}

// measure READs for dur, each with a notification naming consumer id and
// the READ's sequence number, verifies every 16th READ's blocks and
// returns the counts, the time the verification took, and the (sequence,
// DONE time) records of the first maxTimed READs.
func (r *fleetReader) measure(dur time.Duration, id uint32, bs int, seed uint64) (reads, verified uint64, checking time.Duration, times []byte, err error) {
	var notif [8]byte
	binary.LittleEndian.PutUint32(notif[:4], id)
	start := time.Now()
	region := r.t.Region()
	for seq := uint32(0); time.Since(start) < dur; seq++ {
		binary.LittleEndian.PutUint32(notif[4:], seq)
		check := seq%16 == 0
		// The check's CPU time (clearing the blocks before the READ,
		// checking them before its release, as the harness does: bytes
		// that land only after DONE must not pass) comes out of the
		// READs' time, as the harness takes it: its wall time would also
		// take out time the thread waited for a core, which other
		// consumers' READs had, and the more consumers, the more of it.
		if check {
			runtime.LockOSThread()
			t0 := threadCPU()
			clear(region[:len(r.local)*bs])
			checking += threadCPU() - t0
			runtime.UnlockOSThread()
		}
		h, doneAt, err := r.read(notif[:])
		if err != nil {
			return 0, 0, 0, nil, fmt.Errorf("READ %d: %w", seq, err)
		}
		if len(times) < maxTimed*12 {
			times = binary.LittleEndian.AppendUint32(times, seq)
			times = binary.LittleEndian.AppendUint64(times, uint64(doneAt))
		}
		reads++
		if check {
			runtime.LockOSThread()
			t0 := threadCPU()
			for i, b := range r.remote {
				if ok, off := pattern.Check(region[r.local[i]*bs:(r.local[i]+1)*bs], seed, b); !ok {
					runtime.UnlockOSThread()
					_ = r.t.ReleaseXferHandle(h)
					return 0, 0, 0, nil, fmt.Errorf("READ %d block %d: wrong byte at %d", seq, b, off)
				}
			}
			verified++
			checking += threadCPU() - t0
			runtime.UnlockOSThread()
		}
		if err := r.t.ReleaseXferHandle(h); err != nil {
			return 0, 0, 0, nil, fmt.Errorf("READ %d: release: %w", seq, err)
		}
	}
	return reads, verified, checking, times, nil
}

// threadCPU is the calling thread's CPU time (user and system).
func threadCPU() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	return time.Duration(ts.Nano())
}
