package ecxfer

import (
	"bytes"
	"errors"
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/testhook"
	"github.com/ecxfer/ecxfer/reactor"
)

// countAgents counts, until the test ends, the engines New starts.
func countAgents(t *testing.T) *atomic.Int64 {
	var n atomic.Int64
	count := func() { n.Add(1) }
	testhook.NewAgent.Store(&count)
	t.Cleanup(func() { testhook.NewAgent.Store(nil) })
	return &n
}

// Reactor options New cannot use are ErrConfig, found before the engine
// starts: no engine is started for them.
func TestNewRejectsBadReactorOptions(t *testing.T) {
	leakcheck.Check(t)
	agents := countAgents(t)
	cases := map[string]reactor.Options{
		"notification larger than the engines carry": {MaxNotif: reactor.MaxNotifLimit + 1},
		"negative notification limit":                {MaxNotif: -1},
		"negative handle table":                      {Handles: -1},
		"huge submission ring":                       {SubmitRing: 1 << 30},
		"negative batch":                             {BatchSize: -5},
		"negative spin":                              {SpinFor: -1},
		"unknown idle strategy":                      {Idle: reactor.IdlePark + 1},
		"CPU that does not exist":                    {PinCPU: true, CPU: 1 << 20},
		"NUMA node that does not exist":              {BindNUMA: true, NUMANode: 1 << 20},
	}
	for name, opts := range cases {
		for _, backend := range []string{"ucx", "loopback", "nixl"} {
			t.Run(name+"/"+backend, func(t *testing.T) {
				tr, err := New(Config{AgentName: uniqueName("cfg"), Backend: backend, BlockSize: 64, NumBlocks: 4, Reactor: opts})
				if tr != nil {
					_ = tr.Deregister()
				}
				require.ErrorIs(t, err, ErrConfig)
				require.False(t, errors.Is(err, ErrEngine), "an engine error: the options reached the engine")
				require.Zero(t, agents.Load(), "an engine was started")
			})
		}
	}
}

// Direct-path settings New cannot use are ErrConfig too, found before
// the engine starts (the copy worker count used to be checked after it).
func TestNewRejectsBadDirectOptions(t *testing.T) {
	leakcheck.Check(t)
	agents := countAgents(t)
	cases := map[string]func(*Config){
		"negative copy workers":  func(c *Config) { c.CopyWorkers = -1 },
		"too many copy workers":  func(c *Config) { c.CopyWorkers = maxCopyWorkers + 1 },
		"unknown direct mode":    func(c *Config) { c.Direct = DirectOff + 1 },
		"direct mode wrapped up": func(c *Config) { c.Direct = DirectMode(255) },
	}
	for name, set := range cases {
		for _, backend := range []string{"ucx", "loopback", "nixl"} {
			t.Run(name+"/"+backend, func(t *testing.T) {
				cfg := Config{AgentName: uniqueName("cfg"), Backend: backend, BlockSize: 64, NumBlocks: 4}
				set(&cfg)
				tr, err := New(cfg)
				if tr != nil {
					_ = tr.Deregister()
				}
				require.ErrorIs(t, err, ErrConfig)
				require.False(t, errors.Is(err, ErrNoBackend), "the engine was started first")
				require.Zero(t, agents.Load(), "an engine was started")
			})
		}
	}
}

// LargeTCPSegments is an option of the ucx backend alone, and conflicts
// with UCX's own segment sizes in the environment: ErrConfig, found
// before an engine starts.
func TestNewRejectsLargeTCPSegmentsMisuse(t *testing.T) {
	leakcheck.Check(t)
	agents := countAgents(t)
	try := func(t *testing.T, backend, want string) {
		tr, err := New(Config{AgentName: uniqueName("cfg"), Backend: backend, BlockSize: 64, NumBlocks: 4, LargeTCPSegments: true})
		if tr != nil {
			_ = tr.Deregister()
		}
		require.ErrorIs(t, err, ErrConfig)
		require.ErrorContains(t, err, want)
		require.Zero(t, agents.Load(), "an engine was started")
	}
	for _, backend := range []string{"loopback", "nixl"} {
		t.Run(backend, func(t *testing.T) { try(t, backend, "ucx backend") })
	}
	for _, v := range []string{"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"} {
		t.Run(v, func(t *testing.T) {
			t.Setenv(v, "64k")
			try(t, "ucx", v)
		})
	}
}

// A notification of the largest size the options allow travels end to end
// on the real engine.
func TestMaxNotifLimitTravels(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	big := func(c *Config) { c.Reactor.MaxNotif = reactor.MaxNotifLimit }
	pname := uniqueName("bigp")
	prod := e.transport(pname, 64, 4, big)
	cons := e.transport(uniqueName("bigc"), 64, 4, big)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	msg := bytes.Repeat([]byte("n"), reactor.MaxNotifLimit)
	msg[len(msg)-1] = 'z'
	h, err := cons.PostRead([]int{0}, pname, []int{1}, msg)
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
	got := notifsUntil(prod, 1, 10*time.Second)
	require.Len(t, got[cons.cfg.AgentName], 1)
	require.Equal(t, msg, got[cons.cfg.AgentName][0])

	_, err = cons.PostRead([]int{0}, pname, []int{1}, append(msg, 'x'))
	require.ErrorIs(t, err, ErrBadNotif)
}

var globalBlocks [4096]byte

func TestOnGoHeap(t *testing.T) {
	small, large := make([]byte, 64), make([]byte, 4<<20)
	require.True(t, onGoHeap(small), "a small heap slice")
	require.True(t, onGoHeap(large), "a large heap slice")
	require.True(t, onGoHeap(large[1000:]), "a slice into the middle of a heap object")
	m, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(m)) }()
	require.False(t, onGoHeap(m), "mmap memory")
	require.False(t, onGoHeap(m[100:]), "the middle of mmap memory")
	require.False(t, onGoHeap(globalBlocks[:]), "a package variable (never freed or moved)")
	require.False(t, onGoHeap(nil))
	runtime.KeepAlive(small)
	runtime.KeepAlive(large)
}

// A Region on the Go heap is refused: the engine would keep the address of
// memory the garbage collector manages. Memory outside the heap works.
// A Region not mapped writable from end to end (a read-only page, a hole
// after its mapping) is refused with ErrConfig by every engine: READs
// land in it, and on the direct path a fault there was taken for the
// producer's death.
func TestNewRefusesRegionNotWritable(t *testing.T) {
	leakcheck.Check(t)
	page := unix.Getpagesize()
	m, err := unix.Mmap(-1, 0, 5*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(m)) }()
	require.NoError(t, unix.Mprotect(m[4*page:], unix.PROT_NONE))
	for _, backend := range []string{"ucx", "loopback"} {
		cfg := func(region []byte, nb int) Config {
			return Config{AgentName: uniqueName("rw"), Backend: backend, BlockSize: page, NumBlocks: nb, Region: region}
		}
		ok, err := New(cfg(m[:4*page], 4))
		require.NoError(t, err, backend)
		require.NoError(t, ok.Deregister())
		refused := func(what string, region []byte, nb int) {
			tr, err := New(cfg(region, nb))
			if tr != nil {
				_ = tr.Deregister()
			}
			require.ErrorIs(t, err, ErrConfig, "%s: %s", backend, what)
			require.Contains(t, err.Error(), "not mapped writable", "%s: %s", backend, what)
		}
		refused("into the guard page", m[2*page:], 3)
		require.NoError(t, unix.Mprotect(m[page:2*page], unix.PROT_READ))
		refused("a read-only page inside", m[:4*page], 4)
		require.NoError(t, unix.Mprotect(m[page:2*page], unix.PROT_READ|unix.PROT_WRITE))
	}
}

func TestNewRefusesGoHeapRegion(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 64, 8
	for _, backend := range []string{"ucx", "loopback"} {
		t.Run(backend, func(t *testing.T) {
			tr, err := New(Config{AgentName: uniqueName("heap"), Backend: backend, BlockSize: bs, NumBlocks: nb,
				Region: make([]byte, bs*nb)})
			if tr != nil {
				_ = tr.Deregister()
			}
			require.ErrorIs(t, err, ErrConfig)

			m, err := unix.Mmap(-1, 0, bs*nb, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			require.NoError(t, err)
			defer func() { require.NoError(t, unix.Munmap(m)) }()
			e := env{t: t, backend: backend}
			pname := uniqueName("mmap")
			prod := e.transport(pname, bs, nb, func(c *Config) { c.Region = m })
			copy(m[3*bs:4*bs], bytes.Repeat([]byte{0xa5}, bs))
			cons := e.transport(uniqueName("c"), bs, nb)
			_, err = cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			h, err := cons.PostRead([]int{0}, pname, []int{3}, nil)
			require.NoError(t, err)
			st, err := wait(t, cons, h)
			require.NoError(t, err)
			require.Equal(t, StateDone, st)
			require.Equal(t, m[3*bs:4*bs], block(cons, bs, 0))
			require.NoError(t, cons.ReleaseXferHandle(h))
			require.NoError(t, cons.Deregister())
			require.NoError(t, prod.Deregister())
		})
	}
}

// A Config whose block list no peer would accept is refused by New, not
// found out when a peer refuses its MemDescriptor.
func TestNewRefusesTooManyBlocks(t *testing.T) {
	_, err := New(Config{AgentName: uniqueName("many"), Backend: "loopback", BlockSize: 1, NumBlocks: descriptors.DefaultMaxDescs + 1})
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "longest block list")
}

// A Transport dropped without Deregister is torn down once the garbage
// collector finds it unreachable: its reactor thread stops, and its copy
// workers, engine, descriptors and lifeword go (leakcheck). They used to
// stay for the life of the process, the lifeword telling same-host
// consumers the region was still served.
func TestTransportDroppedWithoutDeregister(t *testing.T) {
	leakcheck.Check(t)
	for _, backend := range []string{"ucx", "loopback"} {
		var done <-chan struct{}
		func() {
			tr, err := New(Config{AgentName: uniqueName("dropped"), Backend: backend, BlockSize: 4096, NumBlocks: 16,
				Direct: DirectOn})
			require.NoError(t, err)
			require.NotEmpty(t, tr.AgentMetadata())
			done = tr.r.Done()
		}()
		require.Eventually(t, func() bool {
			runtime.GC()
			select {
			case <-done:
				return true
			default:
				return false
			}
		}, 20*time.Second, 10*time.Millisecond, "%s: the dropped transport's reactor still runs", backend)
	}
}

// With too few descriptors left, New refuses to start a UCX engine
// (ErrEngine, EMFILE) instead of letting UCX 1.13 abort the process in an
// assertion as it did when one of its own descriptors could not be opened.
func TestNewWithFewDescriptorsLeft(t *testing.T) {
	leakcheck.Check(t)
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	low := lim
	low.Cur = uint64(len(ents)) + 8
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	tr, err := New(Config{AgentName: uniqueName("fds"), BlockSize: 4096, NumBlocks: 16})
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	if tr != nil {
		_ = tr.Deregister()
	}
	require.ErrorIs(t, err, ErrEngine)
	require.ErrorIs(t, err, unix.EMFILE)
	require.ErrorContains(t, err, "descriptors in use")
}
