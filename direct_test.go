package ecxfer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/copypool"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/internal/procinfo"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// Tests of the direct path in one process: the producer's region is mapped
// (or, for anonymous memory, read with kernel copies) by the consumer, the
// same way as between two processes on one host.

// shmRegion is a MAP_SHARED mapping of a fresh /dev/shm file, like vLLM's
// region; the file is removed and the mapping undone at the end of the test.
func shmRegion(t testing.TB, size int) ([]byte, string) {
	t.Helper()
	path := filepath.Join("/dev/shm", uniqueName(fmt.Sprintf("ecxfer_test_%d", os.Getpid()))+".mmap")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(size)))
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem); _ = os.Remove(path) })
	return mem, path
}

func anonRegion(t testing.TB, size int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	return mem
}

func direct(c *Config) { c.Direct = DirectOn }

// holdDirectChunks holds every chunk of a direct READ on the copy workers
// before it is copied (testhook.DirectChunk), counting them in entered,
// until let is called (idempotent).
func holdDirectChunks() (entered *atomic.Int64, let func()) {
	gate := make(chan struct{})
	entered = new(atomic.Int64)
	hold := func() {
		entered.Add(1)
		<-gate
	}
	testhook.DirectChunk.Store(&hold)
	return entered, sync.OnceFunc(func() {
		close(gate)
		testhook.DirectChunk.Store(nil)
	})
}

// directPair makes a producer and a consumer on the direct path, named
// with prefix, the consumer knowing the producer.
func directPair(e env, prefix string, bs, nb int, opts ...func(*Config)) (prod, cons *Transport, pname string) {
	e.t.Helper()
	pname = uniqueName(prefix + "-prod")
	opts = append([]func(*Config){direct}, opts...)
	prod = e.transport(pname, bs, nb, opts...)
	cons = e.transport(uniqueName(prefix+"-cons"), bs, nb, opts...)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(e.t, err)
	return prod, cons, pname
}

// regionKinds are the producer regions the direct path knows, with the
// path a consumer gets for each.
var regionKinds = []struct {
	name, path string
	region     func(t testing.TB, size int) []byte
}{
	{"engine", "direct-sysv", nil},
	{"shmfile", "direct-file", func(t testing.TB, size int) []byte { m, _ := shmRegion(t, size); return m }},
	{"anon", "direct-proc", anonRegion},
}

func TestDirectRead(t *testing.T) {
	for _, k := range regionKinds {
		t.Run(k.name, func(t *testing.T) {
			leakcheck.Check(t)
			base := shmview.Mapped()
			e := env{t: t, backend: "ucx"}
			const bs, nb, seed = 5120, 1024, 77
			pname := uniqueName("dprod")
			prod := e.transport(pname, bs, nb, direct, func(c *Config) {
				if k.region != nil {
					c.Region = k.region(t, bs*nb)
				}
			})
			pattern.FillRegion(prod.Region(), seed, bs)
			cons := e.transport(uniqueName("dcons"), bs, nb, direct)
			got, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			require.Equal(t, pname, got)
			require.Equal(t, k.path, cons.PeerPath(pname))
			require.Equal(t, 1, cons.Stats().DirectPeers)

			rng := rand.New(rand.NewSource(seed))
			sent, inline := 0, 0
			for _, n := range []int{1, 3, 12, 13, 100, 880} {
				for _, scattered := range []bool{false, true} {
					remote, local := make([]int, n), make([]int, n)
					if scattered {
						remote, local = rng.Perm(nb)[:n], rng.Perm(nb)[:n]
					} else {
						s, d := rng.Intn(nb-n+1), rng.Intn(nb-n+1)
						for i := range n {
							remote[i], local[i] = s+i, d+i
						}
					}
					clear(cons.Region())
					msg := fmt.Appendf(nil, "read %d/%v", n, scattered)
					h, err := cons.PostRead(local, pname, remote, msg)
					require.NoError(t, err)
					if n*bs <= DefaultInlineBytes {
						inline++
						st, err := cons.CheckXferState(h)
						require.NoError(t, err)
						require.Equal(t, StateDone, st, "a READ of %d bytes is DONE when PostRead returns", n*bs)
					}
					st, err := wait(t, cons, h)
					require.NoError(t, err)
					require.Equal(t, StateDone, st)
					for i := range local {
						ok, off := pattern.Check(block(cons, bs, local[i]), seed, remote[i])
						require.True(t, ok, "%d blocks: local %d (remote %d) differs at %d", n, local[i], remote[i], off)
					}
					require.NoError(t, cons.ReleaseXferHandle(h))
					sent++
				}
			}
			notifs := notifsUntil(prod, sent, 10*time.Second)
			require.Len(t, notifs[cons.cfg.AgentName], sent)
			seen := map[string]bool{}
			for _, m := range notifs[cons.cfg.AgentName] {
				require.False(t, seen[string(m)], "notification %q twice", m)
				seen[string(m)] = true
			}
			st := cons.Stats()
			require.Equal(t, uint64(sent), st.DirectReads)
			require.Equal(t, uint64(inline), st.InlineReads)
			require.Less(t, inline, sent, "some READs went to the copy workers")
			require.NoError(t, cons.RemoveRemotePeer(pname))
			require.Equal(t, base, shmview.Mapped(), "mapping left after RemoveRemotePeer")
		})
	}
}

// A consumer without the direct path reads a producer that advertises,
// and the reverse: both through the engine.
func TestDirectMixed(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, seed = 4096, 64, 5
	for _, c := range []struct{ prod, cons DirectMode }{{DirectOn, DirectOff}, {DirectOff, DirectOn}} {
		pname := uniqueName("mprod")
		prod := e.transport(pname, bs, nb, func(cfg *Config) { cfg.Direct = c.prod })
		pattern.FillRegion(prod.Region(), seed, bs)
		cons := e.transport(uniqueName("mcons"), bs, nb, func(cfg *Config) { cfg.Direct = c.cons })
		_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		require.Equal(t, "engine", cons.PeerPath(pname))
		h, err := cons.PostRead([]int{1, 2}, pname, []int{7, 9}, nil)
		require.NoError(t, err)
		_, err = wait(t, cons, h)
		require.NoError(t, err)
		ok, _ := pattern.Check(block(cons, bs, 2), seed, 9)
		require.True(t, ok)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
}

// A descriptor outside the advertised region is refused at AddRemotePeer.
func TestDirectOutOfRange(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	prod := e.transport(uniqueName("rprod"), 4096, 16, direct)
	cons := e.transport(uniqueName("rcons"), 4096, 16, direct)
	descs, err := descriptors.Decode(prod.MemDescriptor())
	require.NoError(t, err)
	for _, bad := range []descriptors.Desc{
		{Addr: descs[15].Addr + 4096, Len: 4096},
		{Addr: descs[0].Addr - 1, Len: 4096},
		{Addr: descs[15].Addr, Len: 4097},
	} {
		list := append(descriptors.List{}, descs...)
		list[3] = bad
		md, err := descriptors.Encode(list)
		require.NoError(t, err)
		_, err = cons.AddRemotePeer(prod.AgentMetadata(), md)
		require.ErrorIs(t, err, ErrBadDescriptor, "descriptor %+v", bad)
	}
	require.Equal(t, 0, cons.Stats().Peers)
}

// A peer whose block list is not laid out end to end (here: in reverse)
// is read through its descriptors, inline and on the copy workers; a
// grid-shaped list is read by arithmetic on the index (descriptors.Grid).
func TestDirectNonGridPeer(t *testing.T) {
	for _, inline := range []int{0, -1} { // in PostRead, on the copy workers
		t.Run(fmt.Sprintf("inline=%d", inline), func(t *testing.T) {
			leakcheck.Check(t)
			e := env{t: t, backend: "ucx"}
			const bs, nb, seed = 4096, 64, 5
			pname := uniqueName("ngprod")
			prod := e.transport(pname, bs, nb, direct)
			pattern.FillRegion(prod.Region(), seed, bs)
			cons := e.transport(uniqueName("ngcons"), bs, nb, direct, func(c *Config) { c.InlineBytes = inline })
			descs, err := descriptors.Decode(prod.MemDescriptor())
			require.NoError(t, err)
			slices.Reverse(descs)
			_, isGrid := descriptors.GridOf(descs)
			require.False(t, isGrid)
			md, err := descriptors.Encode(descs)
			require.NoError(t, err)
			_, err = cons.AddRemotePeer(prod.AgentMetadata(), md)
			require.NoError(t, err)
			require.Equal(t, "direct-sysv", cons.PeerPath(pname))
			for _, n := range []int{1, 2, 40, nb} {
				local, remote := make([]int, n), make([]int, n)
				for i := range n {
					local[i], remote[i] = i, i // remote i is the producer's block nb-1-i
				}
				clear(cons.Region())
				h, err := cons.PostRead(local, pname, remote, nil)
				require.NoError(t, err)
				_, err = wait(t, cons, h)
				require.NoError(t, err)
				for i := range n {
					ok, at := pattern.Check(block(cons, bs, i), seed, nb-1-i)
					require.True(t, ok, "%d blocks: block %d differs at %d", n, i, at)
				}
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			_, err = cons.PostRead([]int{0}, pname, []int{nb}, nil)
			require.ErrorIs(t, err, ErrIndexRange)
		})
	}
}

// The copy workers cut a READ into chunks at byte offsets that need not
// fall between blocks; a READ between two block grids (every ecxfer
// region) is copied from its index lists, so a chunk may start and end
// inside a block. Every byte must land once, in its place.
func TestDirectGridChunks(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, seed = 5000, 1024, 9 // 5,000: no chunk boundary is a block boundary
	pname := uniqueName("gcprod")
	prod := e.transport(pname, bs, nb, direct)
	pattern.FillRegion(prod.Region(), seed, bs)
	cons := e.transport(uniqueName("gccons"), bs, nb, direct, func(c *Config) { c.InlineBytes = -1 })
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	rng := rand.New(rand.NewSource(seed))
	for _, n := range []int{1, 7, 333, 1000} {
		for _, scattered := range []bool{false, true} {
			local, remote := make([]int, n), make([]int, n)
			if scattered {
				local, remote = rng.Perm(nb)[:n], rng.Perm(nb)[:n]
			} else {
				s, d := rng.Intn(nb-n+1), rng.Intn(nb-n+1)
				for i := range n {
					remote[i], local[i] = s+i, d+i
				}
			}
			region := cons.Region()
			for i := range region {
				region[i] = 0xee
			}
			h, err := cons.PostRead(local, pname, remote, nil)
			require.NoError(t, err)
			_, err = wait(t, cons, h)
			require.NoError(t, err)
			read := make([]bool, nb)
			for i := range n {
				read[local[i]] = true
				ok, at := pattern.Check(block(cons, bs, local[i]), seed, remote[i])
				require.True(t, ok, "%d blocks (scattered %v): block %d differs at %d", n, scattered, local[i], at)
			}
			for b := range nb { // nothing written outside the READ's blocks
				if !read[b] {
					require.Equal(t, bs, bytes.Count(block(cons, bs, b), []byte{0xee}), "block %d was not read but changed", b)
				}
			}
			require.NoError(t, cons.ReleaseXferHandle(h))
		}
	}
}

// A producer that truncates its region file: the READ that faults ends in
// ErrRemoteDisconnect, the peer is gone for later READs (and reported dead,
// once, whichever goroutine copied), the consumer lives on, and another
// producer is unaffected.
func TestDirectTruncated(t *testing.T) {
	for _, inline := range []int{0, -1} { // in PostRead, on the copy workers
		t.Run(fmt.Sprintf("inline=%d", inline), func(t *testing.T) {
			leakcheck.Check(t)
			e := env{t: t, backend: "ucx"}
			const bs, nb = 32768, 64
			mem, path := shmRegion(t, bs*nb)
			victim := uniqueName("trunc")
			pv := e.transport(victim, bs, nb, direct, func(c *Config) { c.Region = mem })
			pattern.FillRegion(pv.Region(), 1, bs)
			healthy := uniqueName("ok")
			ph := e.transport(healthy, bs, nb, direct)
			pattern.FillRegion(ph.Region(), 2, bs)
			log := newEventLog()
			cons := e.transport(uniqueName("tcons"), bs, nb, direct, func(c *Config) {
				c.InlineBytes = inline
				c.Logger = slog.New(log)
			})
			for _, p := range []*Transport{pv, ph} {
				_, err := cons.AddRemotePeer(p.AgentMetadata(), p.MemDescriptor())
				require.NoError(t, err)
			}
			read := func(peer string, remote int) error {
				h, err := cons.PostRead([]int{0}, peer, []int{remote}, []byte("x"))
				require.NoError(t, err)
				_, err = wait(t, cons, h)
				require.NoError(t, cons.ReleaseXferHandle(h))
				return err
			}
			require.NoError(t, read(victim, 63))
			require.NoError(t, os.Truncate(path, bs))
			require.ErrorIs(t, read(victim, 63), ErrRemoteDisconnect)
			require.ErrorIs(t, read(victim, 0), ErrRemoteDisconnect, "the peer is gone after a fault")
			dead := log.eventually(t, EventPeerDead, 1)
			require.Equal(t, victim, dead[0].attrs["peer"].String())
			require.NotEmpty(t, dead[0].attrs["why"].String())
			require.NoError(t, read(healthy, 5))
			require.Len(t, log.named(EventPeerDead), 1)
			ok, _ := pattern.Check(block(cons, bs, 0), 2, 5)
			require.True(t, ok)
			_ = pv.NewNotifs()
			_ = ph.NewNotifs()
		})
	}
}

// RemoveRemotePeer, a producer restart and Deregister race large copies;
// nothing is unmapped under a running copy (the race detector and the
// fault handler would see it), and every handle ends.
func TestDirectLifetimeRace(t *testing.T) {
	leakcheck.Check(t)
	base := shmview.Mapped()
	e := env{t: t, backend: "ucx"}
	const bs, nb = 32768, 256
	cons := e.transport(uniqueName("lcons"), bs, nb, direct)
	for round := range 6 {
		pname := uniqueName("lprod")
		prod, err := New(Config{AgentName: pname, BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
		require.NoError(t, err)
		_, err = cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		idx := rand.New(rand.NewSource(int64(round))).Perm(nb)
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				for range 5 {
					h, err := cons.PostRead(idx[w*64:(w+1)*64], pname, idx[:64], []byte("r"))
					if err != nil {
						return
					}
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					werr := cons.Wait(ctx, h)
					cancel()
					require.NotErrorIs(t, werr, context.DeadlineExceeded)
					require.NoError(t, cons.ReleaseXferHandle(h))
				}
			})
		}
		time.Sleep(time.Duration(round) * 200 * time.Microsecond)
		switch round % 3 {
		case 0:
			require.NoError(t, cons.RemoveRemotePeer(pname))
		case 1:
			// The producer restarts under the same name.
			require.NoError(t, prod.Deregister())
			prod, err = New(Config{AgentName: pname, BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
			require.NoError(t, err)
			_, err = cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
		case 2:
			require.NoError(t, prod.Deregister())
		}
		wg.Wait()
		require.NoError(t, prod.Deregister())
		if cons.PeerPath(pname) != "" {
			require.NoError(t, cons.RemoveRemotePeer(pname))
		}
	}
	require.Eventually(t, func() bool { return cons.Stats().InFlight == 0 }, 10*time.Second, time.Millisecond)
	require.Equal(t, base, shmview.Mapped())
}

// Deregister with large copies running waits for them: the local region
// goes with the engine.
func TestDirectDeregisterInFlight(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 32768, 880
	prod, err := New(Config{AgentName: uniqueName("dp"), BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
	require.NoError(t, err)
	defer prod.Deregister()
	cons, err := New(Config{AgentName: uniqueName("dc"), BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
	require.NoError(t, err)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	idx := rand.New(rand.NewSource(3)).Perm(nb)
	var hs []Handle
	for range 8 {
		h, err := cons.PostRead(idx, pname, idx, nil)
		require.NoError(t, err)
		hs = append(hs, h)
	}
	require.NoError(t, cons.Deregister())
	for _, h := range hs {
		st, err := cons.CheckXferState(h)
		require.Equal(t, StateErr, st)
		require.ErrorIs(t, err, ErrClosed)
	}
}

// Steady-state direct READs allocate nothing, inline and on the workers.
func TestDirectAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	const bs, nb = 4096, 4096
	prod, err := New(Config{AgentName: uniqueName("ap"), BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
	require.NoError(t, err)
	defer prod.Deregister()
	cons, err := New(Config{AgentName: uniqueName("ac"), BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
	require.NoError(t, err)
	defer cons.Deregister()
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	for _, n := range []int{1, 12, 880, 1024, 4096} {
		idx := rand.New(rand.NewSource(int64(n))).Perm(nb)[:n]
		read := func() {
			h, err := cons.PostRead(idx, pname, idx, nil)
			if err != nil {
				panic(err)
			}
			for {
				if st, _ := cons.CheckXferState(h); st != StateProc {
					break
				}
				runtime.Gosched()
			}
			if err := cons.ReleaseXferHandle(h); err != nil {
				panic(err)
			}
		}
		for range 20 {
			read()
		}
		// Counted exactly (testing.AllocsPerRun rounds down). Not quite
		// zero for READs on the copy workers: 0.002-0.012 per READ here
		// (the higher figure while another test run held both cores); an
		// allocation profile shows copy jobs built anew when the pool was
		// empty (dirJob.build) and the runtime's own. The bound catches an
		// allocation per READ, or per slot, not that.
		runs := 2000
		if n > 1024 {
			runs = 1000
		}
		per := allocsPerRead(runs, read)
		t.Logf("%d blocks: %.4f allocations per READ over %d READs", n, per, runs)
		require.Less(t, per, 0.05, "%d-block direct READ: %.3f allocations per READ", n, per)
	}
}

// Inline READs with notifications, released at once, back to back: the
// handle table never fills, however far the reactor lags with sending the
// notifications (they do not hold the READs' slots), and each arrives once.
func TestDirectInlineNotifNoBusy(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, reads = 5120, 64, 20000
	pname := uniqueName("nprod")
	prod := e.transport(pname, bs, nb, direct)
	cons := e.transport(uniqueName("ncons"), bs, nb, direct, func(c *Config) { c.Reactor.Handles = 256 })
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	got := 0
	for i := range reads {
		h, err := cons.PostRead([]int{i % nb}, pname, []int{(i * 7) % nb}, []byte("n"))
		require.NoError(t, err, "READ %d", i)
		st, err := cons.CheckXferState(h)
		require.NoError(t, err)
		require.Equal(t, StateDone, st)
		require.NoError(t, cons.ReleaseXferHandle(h))
		if i%1000 == 0 {
			got += len(prod.NewNotifs()[cons.cfg.AgentName])
		}
	}
	rest := notifsUntil(prod, reads-got, 20*time.Second)
	require.Equal(t, reads, got+len(rest[cons.cfg.AgentName]))
	require.Equal(t, int64(0), cons.Stats().LiveHandles)
}

// TestNotifsDrainedByCaller: NewNotifs reads the notification socket
// itself, while the producer's reactor reads it too. Two consumers send
// numbered notifications; a goroutine on the producer polls NewNotifs
// without pause: every notification arrives exactly once, each sender's in
// the order its READs completed. A malformed datagram a caller's drain
// finds is counted as an engine error, like one the reactor finds.
func TestNotifsDrainedByCaller(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, reads = 4096, 64, 5000
	pname := uniqueName("dprod")
	prod := e.transport(pname, bs, nb, direct)
	var conss []*Transport
	for range 2 {
		c := e.transport(uniqueName("dcons"), bs, nb, direct)
		_, err := c.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		conss = append(conss, c)
	}
	collected := make(chan map[string][]string)
	go func() {
		got := map[string][]string{}
		deadline := time.Now().Add(30 * time.Second)
		for n := 0; n < 2*reads && time.Now().Before(deadline); {
			m := prod.NewNotifs()
			if len(m) == 0 {
				runtime.Gosched()
			}
			for who, msgs := range m {
				for _, msg := range msgs {
					got[who] = append(got[who], string(msg))
					n++
				}
			}
		}
		collected <- got
	}()
	var wg sync.WaitGroup
	for _, c := range conss {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range reads {
				h, err := c.PostRead([]int{i % nb}, pname, []int{(i * 3) % nb}, []byte(strconv.Itoa(i)))
				if !assert.NoError(t, err) {
					return
				}
				assert.NoError(t, c.ReleaseXferHandle(h))
			}
		}()
	}
	wg.Wait()
	got := <-collected
	for _, c := range conss {
		msgs := got[c.cfg.AgentName]
		require.Len(t, msgs, reads, "notifications from %s", c.cfg.AgentName)
		for i, m := range msgs {
			require.Equal(t, strconv.Itoa(i), m, "notification %d from %s", i, c.cfg.AgentName)
		}
	}

	// A malformed datagram on the producer's socket.
	_, adv, err := shmview.Split(prod.AgentMetadata())
	require.NoError(t, err)
	require.NotNil(t, adv)
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	errs0 := prod.Stats().EngineErrors
	to := &unix.SockaddrUnix{Name: shmview.NotifyAddr(uint32(unix.Getpid()), adv.Notify)}
	require.NoError(t, unix.Sendto(fd, []byte{9, 0, 'x'}, 0, to))
	require.Eventually(t, func() bool { return len(prod.NewNotifs()) == 0 && prod.Stats().EngineErrors > errs0 },
		5*time.Second, time.Millisecond, "a malformed datagram was not counted")
}

// TestDirectForgedNotifRefused: the producer's notification socket has
// an address any local user can read in /proc/net/unix, and a
// notification makes a producer free the blocks it names. Datagrams that
// do not carry the key from the producer's metadata, in the old layout,
// with a zero key or with a key one bit off, are dropped and reported as
// engine errors; a consumer's own notification still arrives.
func TestDirectForgedNotifRefused(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 16
	prod, cons, pname := directPair(e, "forged", bs, nb)
	_, adv, err := shmview.Split(prod.AgentMetadata())
	require.NoError(t, err)
	require.NotNil(t, adv)
	require.NotZero(t, adv.Notify)

	// What an outsider sees.
	addr := shmview.NotifyAddr(uint32(unix.Getpid()), adv.Notify)
	listing, err := os.ReadFile("/proc/net/unix")
	require.NoError(t, err)
	require.Contains(t, string(listing), addr, "the address is not listed: the test does not show the outsider's view")

	body := func(sender, msg string) []byte {
		b := binary.LittleEndian.AppendUint16(nil, uint16(len(sender)))
		b = append(b, sender...)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(msg)))
		return append(b, msg...)
	}
	sealed := func(key []byte, sender, msg string) []byte { return append(slices.Clone(key), body(sender, msg)...) }
	offByOne := adv.NotifyKey
	offByOne[7] ^= 4
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	to := &unix.SockaddrUnix{Name: addr}
	errs0 := prod.Stats().EngineErrors
	for _, d := range [][]byte{
		body(cons.cfg.AgentName, "sess:forged-1"),
		sealed(make([]byte, shmview.NotifyKeyLen), cons.cfg.AgentName, "sess:forged-2"),
		sealed(offByOne[:], cons.cfg.AgentName, "sess:forged-3"),
	} {
		require.NoError(t, unix.Sendto(fd, d, 0, to))
	}

	h, err := cons.PostRead([]int{3}, pname, []int{5}, []byte("sess:real"))
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
	var got []string
	require.Eventually(t, func() bool {
		for who, msgs := range prod.NewNotifs() {
			for _, m := range msgs {
				got = append(got, who+"/"+string(m))
			}
		}
		return slices.Contains(got, cons.cfg.AgentName+"/sess:real") && prod.Stats().EngineErrors > errs0
	}, 10*time.Second, time.Millisecond, "notifications %q, engine errors %d -> %d", got, errs0, prod.Stats().EngineErrors)
	require.Equal(t, []string{cons.cfg.AgentName + "/sess:real"}, got, "a forged notification was delivered")
}

// A READ on the copy workers that its peer's removal ends is published
// ERR only once its copy no longer writes its local blocks: the caller
// may release it and use the blocks for other data at once.
func TestDirectRemovedReadStopsWriting(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, seed = 32768, 880, 5
	cons := e.transport(uniqueName("rcons"), bs, nb, direct)
	local := cons.Region()
	idx := make([]int, nb)
	for i := range idx {
		idx[i] = i
	}
	var sentinel [8]byte
	for i := range sentinel {
		sentinel[i] = 0xA5
	}
	ended, skipped := 0, 0
	for round := range 12 {
		pname := uniqueName("rprod")
		prod := e.transport(pname, bs, nb, direct)
		pattern.FillRegion(prod.Region(), seed, bs)
		_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		for i := range local {
			local[i] = 0xA5
		}
		h, err := cons.PostRead(idx, pname, idx, nil)
		require.NoError(t, err)
		// Remove the peer once the copy has begun (its first bytes landed),
		// with most of it still to go.
		deadline := time.Now().Add(10 * time.Second)
		for bytes.Equal(local[:8], sentinel[:]) && time.Now().Before(deadline) {
			runtime.Gosched()
		}
		require.NoError(t, cons.RemoveRemotePeer(pname))
		st, err := wait(t, cons, h)
		require.NoError(t, cons.ReleaseXferHandle(h))
		if st == StateDone {
			require.NoError(t, prod.Deregister())
			continue // the copy won the race
		}
		require.ErrorIs(t, err, ErrCanceled)
		ended++
		// The blocks are the caller's again: nothing may land in them now.
		// (Blocks are counted as written when their first or last bytes
		// are no longer the sentinel.)
		written := func() int {
			n := 0
			for b := range nb {
				blk := local[b*bs : (b+1)*bs]
				if !bytes.Equal(blk[:8], sentinel[:]) || !bytes.Equal(blk[bs-8:], sentinel[:]) {
					n++
				}
			}
			return n
		}
		atEnd := written()
		time.Sleep(20 * time.Millisecond) // far longer than a copy chunk
		later := written()
		require.Equal(t, atEnd, later, "round %d: blocks written after the READ ended", round)
		if atEnd < nb {
			skipped++
		}
		require.NoError(t, prod.Deregister())
	}
	require.Positive(t, ended, "no READ was ended by the removal while copying")
	t.Logf("%d of 12 READs ended by the removal, %d of them with chunks left uncopied", ended, skipped)
}

// A Wait blocked on a READ that another goroutine releases while its copy
// runs returns when the release is taken, not when something else ends.
func TestDirectReleaseWakesWait(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 32768, 880
	// One copy worker: a READ is cut into four chunks, and the one the
	// worker is copying when Wait, having helped with the rest, blocks
	// leaves a window of a few ms for the release.
	opts := []func(*Config){direct, func(c *Config) { c.Reactor.WaitSpin = time.Microsecond; c.CopyWorkers = 1 }}
	prod := e.transport(uniqueName("wprod"), bs, nb, opts...)
	cons := e.transport(uniqueName("wcons"), bs, nb, opts...)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	idx := make([]int, nb)
	for i := range idx {
		idx[i] = i
	}
	// Whether the release lands while Wait is blocked is up to timing:
	// try until it has a few times (each try is a few ms).
	released, tries := 0, 0
	for ; tries < 300 && released < 3; tries++ {
		h, err := cons.PostRead(idx, pname, idx, nil)
		require.NoError(t, err)
		before := cons.Stats().WaitBlocks
		res := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			res <- cons.Wait(ctx, h)
		}()
		// Watched through Stats, not CheckXferState: a caller that checks
		// a READ helps copy it, and would finish the copy here.
		blocked, ended := false, false
		var werr error
		for !blocked && !ended {
			select {
			case werr = <-res:
				ended = true // the copy ended before Wait blocked
			default:
				blocked = cons.Stats().WaitBlocks > before
				runtime.Gosched()
			}
		}
		rerr := cons.ReleaseXferHandle(h)
		if !ended {
			werr = <-res
		}
		require.NotErrorIs(t, werr, context.DeadlineExceeded, "Wait was not woken by the release")
		if blocked && rerr == nil && werr != nil {
			released++
		}
	}
	t.Logf("%d READs released while their Wait was blocked, in %d tries", released, tries)
	require.Positive(t, released, "no READ was released while its Wait was blocked")
	// A release of a READ whose copy runs returns once the copy stopped.
	require.Zero(t, cons.Stats().LiveHandles)
}

// A caller that checks a READ still on the copy workers copies one chunk
// per call, not every chunk left: CheckXferState (vLLM's check, once per
// engine step) is held for a chunk at most, and a Wait whose ctx ends
// while it copies returns then, with the READ still in flight. A check
// that copied the last chunk and published the end reports DONE.
func TestDirectCheckHelpsOneChunk(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 32768, 880
	opts := []func(*Config){direct, func(c *Config) { c.CopyWorkers = 1 }}
	prod := e.transport(uniqueName("hprod"), bs, nb, opts...)
	cons := e.transport(uniqueName("hcons"), bs, nb, opts...)
	pattern.FillRegion(prod.Region(), 3, bs)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	// Hold the only copy worker: the READ's chunks are left to callers.
	hold, started := make(chan struct{}), make(chan struct{})
	var holder copypool.Job
	holder.Run = func(lo, hi int) error { close(started); <-hold; return nil }
	holder.Done = func(error) {}
	cons.pool.Submit(&holder, 1)
	<-started
	unblocked := false
	defer func() {
		if !unblocked {
			close(hold)
		}
	}()
	idx := make([]int, nb)
	for i := range idx {
		idx[i] = i
	}
	landed := func() int {
		n := 0
		for i := range nb {
			if ok, _ := pattern.Check(block(cons, bs, i), 3, i); ok {
				n++
			}
		}
		return n
	}
	h, err := cons.PostRead(idx, pname, idx, nil)
	require.NoError(t, err)
	require.Equal(t, 4, cons.pool.Chunks(nb*bs), "one worker: four chunks")
	// The reactor hands the READ to the pool in its own time: until then a
	// check finds nothing to copy.
	for deadline := time.Now().Add(10 * time.Second); landed() == 0; {
		require.True(t, time.Now().Before(deadline), "no check found the READ's chunks")
		st, err := cons.CheckXferState(h)
		require.NoError(t, err)
		require.Equal(t, StateProc, st)
	}
	require.Equal(t, nb/4, landed(), "blocks landed by the first check that found the chunks")
	st, err := cons.CheckXferState(h)
	require.NoError(t, err)
	require.Equal(t, StateProc, st)
	require.Equal(t, nb/2, landed(), "blocks landed after one more check")
	ctx, cancel := context.WithTimeout(context.Background(), time.Nanosecond)
	defer cancel()
	<-ctx.Done()
	require.ErrorIs(t, cons.Wait(ctx, h), context.DeadlineExceeded)
	require.Equal(t, 3*nb/4, landed(), "Wait with an ended ctx copied one chunk, then returned")
	// The check that copies the last chunk finishes the copy: it publishes
	// the READ's end itself when the reactor thread is asleep (its engine
	// token free) and then reports DONE; else the loop publishes it, and
	// the check reports what it finds (PROC unless the loop was quicker).
	before := cons.Stats().FinisherEnds
	st, err = cons.CheckXferState(h)
	require.NoError(t, err)
	require.Contains(t, []State{StateProc, StateDone}, st)
	published := cons.Stats().FinisherEnds > before
	if published {
		require.Equal(t, StateDone, st, "the check published the READ's end and reported it in flight")
	}
	t.Logf("the check that copied the last chunk: %s, end published by it: %v", st, published)
	require.Equal(t, nb, landed())
	close(hold)
	unblocked = true
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	require.NoError(t, cons.Wait(ctx2, h))
	require.Equal(t, nb, landed())
	require.NoError(t, cons.ReleaseXferHandle(h))
}

// Releasing a READ while the copy workers run it returns once its copy has
// stopped: nothing writes its local blocks afterwards, so the caller may
// read other data into them at once (vLLM hands an aborted request's
// blocks out again), and the chunks not started are skipped.
func TestDirectReleaseStopsCopy(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 32768, 880
	cons := e.transport(uniqueName("scons"), bs, nb, direct)
	big := e.transport(uniqueName("sbig"), bs, nb, direct)
	small := e.transport(uniqueName("ssmall"), bs, nb, direct)
	pattern.FillRegion(big.Region(), 5, bs)
	pattern.FillRegion(small.Region(), 99, bs)
	bigName, err := cons.AddRemotePeer(big.AgentMetadata(), big.MemDescriptor())
	require.NoError(t, err)
	smallName, err := cons.AddRemotePeer(small.AgentMetadata(), small.MemDescriptor())
	require.NoError(t, err)
	idx := make([]int, nb)
	for i := range idx {
		idx[i] = i
	}
	local := cons.Region()
	const mark = 0xA5A5A5A5A5A5A5A5
	landed := func(b []byte) int { // blocks whose first word has landed
		n := 0
		for k := 0; k*bs < len(b); k++ {
			if binary.LittleEndian.Uint64(b[k*bs:]) != mark {
				n++
			}
		}
		return n
	}
	midway, skipped := 0, 0
	for round := range 24 {
		for i := range local {
			local[i] = mark & 0xff
		}
		h, err := cons.PostRead(idx, bigName, idx, nil)
		require.NoError(t, err)
		// Release at a different point of the copy each round (it takes
		// a millisecond or two): every other round a time after the
		// post, the others as soon as the first block has landed (when
		// the copy starts varies by more than the copy takes).
		if round%2 == 1 {
			for end := time.Now().Add(time.Second); binary.LittleEndian.Uint64(local) == mark && time.Now().Before(end); {
			}
		} else {
			for end := time.Now().Add(time.Duration(round/2%12) * 150 * time.Microsecond); time.Now().Before(end); {
				runtime.Gosched()
			}
		}
		require.NoError(t, cons.ReleaseXferHandle(h))
		snap := bytes.Clone(local)
		n := landed(snap)
		// The last block takes another producer's block at once (inline,
		// DONE when PostRead returns).
		h2, err := cons.PostRead([]int{nb - 1}, smallName, []int{7}, nil)
		require.NoError(t, err)
		st, err := cons.CheckXferState(h2)
		require.NoError(t, err)
		require.Equal(t, StateDone, st)
		copy(snap[(nb-1)*bs:], block(cons, bs, nb-1))
		time.Sleep(20 * time.Millisecond) // time for any late chunk to land
		ok, at := pattern.Check(block(cons, bs, nb-1), 99, 7)
		require.True(t, ok, "round %d: the reused block was overwritten after its READ was DONE (word %d)", round, at)
		require.True(t, bytes.Equal(snap, local), "round %d: the released READ wrote its blocks after ReleaseXferHandle returned (%d blocks landed by then)", round, n)
		if n > 0 && n < nb {
			midway++
			if landed(local[:(nb-1)*bs]) < nb-1 {
				skipped++
			}
		}
		require.NoError(t, cons.ReleaseXferHandle(h2))
		require.Zero(t, cons.Stats().LiveHandles)
	}
	require.Positive(t, midway, "no READ was released while its copy ran")
	require.Positive(t, skipped, "no READ released midway left a chunk uncopied")
	t.Logf("%d of 24 READs released midway through their copy, %d with chunks skipped", midway, skipped)
}

// While READs are on the copy workers and nothing else needs the loop,
// the reactor thread sleeps with its goroutine blocked (copyNap), its P
// free for the copy, and the goroutine that copies a READ's last chunk
// publishes its end itself (Stats.FinisherEnds). With ReactorOnly the
// finisher may not, and only READs of 8 MiB or more in all put the
// thread to sleep so; a smaller one leaves it on the idle strategy (here
// its spin, yield and epoll_wait), and the loop publishes every end. The
// chunks are held (testhook.DirectChunk) while the reactor's goroutine
// is looked at, then let go; each READ ends DONE with every byte.
func TestDirectCopyNap(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 32768, 880
	napping := func() (bool, string) {
		buf := make([]byte, 1<<20)
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "reactor.(*Reactor).copyNap(") {
				header, _, _ := strings.Cut(g, "\n")
				return strings.Contains(header, "[select"), g
			}
		}
		return false, ""
	}
	for _, c := range []struct {
		reactorOnly bool
		blocks      int
		nap         bool
	}{{false, nb, true}, {false, 200, true}, {true, nb, true}, {true, 200, false}} { // 28.8 MB and 6.6 MB
		t.Run(fmt.Sprintf("reactorOnly=%v/%d", c.reactorOnly, c.blocks), func(t *testing.T) {
			e := env{t: t, backend: "ucx"}
			only := func(cfg *Config) { cfg.Reactor.ReactorOnly = c.reactorOnly }
			cons := e.transport(uniqueName("ncons"), bs, nb, direct, only)
			prod := e.transport(uniqueName("nprod"), bs, nb, direct)
			pattern.FillRegion(prod.Region(), 8, bs)
			pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			// The reactor thread sleeps at most 1 ms at a time, and a
			// finisher finds the token taken if the copy ends while it is
			// awake: a few READs, so that one is published by its
			// finisher for certain.
			const reads = 5
			for k := range reads {
				entered, let := holdDirectChunks()
				defer let()
				idx := make([]int, c.blocks)
				for i := range idx {
					idx[i] = (i*7 + k) % nb // scattered, no two alike (7 and 880 are coprime)
				}
				clear(cons.Region())
				h, err := cons.PostRead(idx, pname, idx, nil)
				require.NoError(t, err)
				require.Eventually(t, func() bool { return entered.Load() > 0 }, 5*time.Second, 100*time.Microsecond, "no chunk started")
				if c.nap {
					var g string
					require.Eventually(t, func() bool {
						ok, stack := napping()
						g = stack
						return ok
					}, 5*time.Second, 200*time.Microsecond, "the reactor thread never slept beside the copy:\n%s", g)
				} else {
					for end := time.Now().Add(50 * time.Millisecond); time.Now().Before(end); time.Sleep(200 * time.Microsecond) {
						ok, g := napping()
						require.False(t, ok, "the reactor thread napped beside a %d-byte copy:\n%s", c.blocks*bs, g)
					}
				}
				let()
				require.NoError(t, cons.Wait(context.Background(), h))
				for _, i := range idx {
					ok, at := pattern.Check(block(cons, bs, i), 8, i)
					require.True(t, ok, "block %d differs at word %d", i, at)
				}
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			st := cons.Stats()
			require.Equal(t, uint64(reads), st.DirectReads)
			if c.reactorOnly {
				require.Zero(t, st.FinisherEnds, "a finisher published a READ's end with ReactorOnly")
			} else {
				require.Positive(t, st.FinisherEnds, "no READ's end was published by its finisher")
			}
		})
	}
}

// PostRead racing Deregister: a READ copied inline writes the local
// region, which goes with the engine, so Deregister waits for such copies
// and a Post after it has begun copies nothing. (A race test: without the
// wait it crashes or reports a fault only when the timing hits.)
func TestDirectInlinePostVsDeregister(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 5120, 64
	for round := range 20 {
		prod, err := New(Config{AgentName: uniqueName("iprod"), BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
		require.NoError(t, err)
		cons, err := New(Config{AgentName: uniqueName("icons"), BlockSize: bs, NumBlocks: nb, Direct: DirectOn})
		require.NoError(t, err)
		pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		var wg sync.WaitGroup
		bad := make(chan string, 4)
		for w := range 4 {
			wg.Go(func() {
				for i := 0; ; i++ {
					b := (w*16 + i) % nb
					h, err := cons.PostRead([]int{b, (b + 1) % nb}, pname, []int{b, (b + 1) % nb}, []byte("n"))
					if errors.Is(err, ErrClosed) || errors.Is(err, ErrUnknownPeer) {
						return
					}
					if err != nil {
						bad <- err.Error()
						return
					}
					st, err := cons.CheckXferState(h)
					if st == StateErr && !errors.Is(err, ErrClosed) {
						bad <- fmt.Sprintf("state %v: %v", st, err)
						return
					}
					_ = cons.ReleaseXferHandle(h)
				}
			})
		}
		time.Sleep(time.Duration(round%5) * 100 * time.Microsecond)
		require.NoError(t, cons.Deregister())
		wg.Wait()
		close(bad)
		for msg := range bad {
			t.Fatalf("round %d: %s", round, msg)
		}
		require.NoError(t, prod.Deregister())
	}
}

// READs copied inline are DONE when PostRead returns; their producer is
// told even when the consumer removes it right after, before the reactor
// has sent the notifications (they go over the producer's own socket).
func TestDirectInlineNotifsSurviveRemoval(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, n = 5120, 64, 300
	for round := range 5 {
		prod, cons, pname := directPair(e, "removal", bs, nb)
		for i := range n {
			h, err := cons.PostRead([]int{i % nb}, pname, []int{(i + 1) % nb}, fmt.Appendf(nil, "r%d-%d", round, i))
			require.NoError(t, err)
			st, err := cons.CheckXferState(h)
			require.NoError(t, err)
			require.Equal(t, StateDone, st)
			require.NoError(t, cons.ReleaseXferHandle(h))
		}
		require.NoError(t, cons.RemoveRemotePeer(pname))
		got := notifsUntil(prod, n, 10*time.Second)[cons.cfg.AgentName]
		require.Equal(t, n, len(got), "round %d: notifications of DONE READs lost with the removal", round)
		for i, m := range got {
			require.Equal(t, fmt.Sprintf("r%d-%d", round, i), string(m))
		}
	}
}

// A caller that sees a READ the copy workers ran DONE and then posts an
// inline one does not get that one's notification to the producer first:
// whoever publishes the first READ DONE (the loop, or the goroutine that
// copied its last chunk) holds its notification from before it publishes
// until it has sent it. The hook stands in for that goroutine being
// descheduled between the two.
func TestDirectInlineNotifAfterPoolNotif(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 32768, 64
	prod, cons, pname := directPair(e, "order", bs, nb)
	for i := range nb {
		copy(block(prod, bs, i), fmt.Appendf(nil, "block %d", i))
	}
	delay := func() { time.Sleep(5 * time.Millisecond) }
	testhook.AfterDirectDone.Store(&delay)
	defer testhook.AfterDirectDone.Store(nil)
	big := []int{0, 1, 2, 3, 4, 5, 6, 7} // 256 KiB: above the inline limit
	h, err := cons.PostRead(big, pname, big, []byte("first"))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(cons.PeerPath(pname), "direct-"), cons.PeerPath(pname))
	for {
		st, err := cons.CheckXferState(h)
		require.NoError(t, err)
		if st == StateDone {
			break
		}
		runtime.Gosched()
	}
	h2, err := cons.PostRead([]int{9}, pname, []int{9}, []byte("second")) // inline
	require.NoError(t, err)
	st, err := cons.CheckXferState(h2)
	require.NoError(t, err)
	require.Equal(t, StateDone, st, "a one-block READ is copied inside PostRead")
	got := notifsUntil(prod, 2, 10*time.Second)[cons.AgentName()]
	require.NoError(t, cons.ReleaseXferHandle(h))
	require.NoError(t, cons.ReleaseXferHandle(h2))
	require.Len(t, got, 2)
	require.Equal(t, []string{"first", "second"}, []string{string(got[0]), string(got[1])}, "order the producer saw")
	for _, i := range append(big, 9) {
		require.True(t, bytes.HasPrefix(block(cons, bs, i), fmt.Appendf(nil, "block %d", i)), "block %d", i)
	}
}

// The notification of an inline READ that was DONE before its peer was
// removed reaches the producer also when it is too long for the direct
// path's socket (the engine carries it, by the peer's name): the loop
// sends what callers queued before it removes the peer. (It found the
// peer gone and dropped them, counted nowhere.)
func TestDirectQueuedNotifsBeforeRemoval(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb, rounds = 4096, 16, 20
	bigNotifs := func(c *Config) { c.Reactor.MaxNotif = 256 << 10 }
	pname := uniqueName("qprod")
	prod := e.transport(pname, bs, nb, direct, bigNotifs)
	cons := e.transport(uniqueName("qcons"), bs, nb, direct, bigNotifs)
	for i := range rounds {
		_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		msg := bytes.Repeat([]byte{byte(i)}, 100<<10) // over a datagram's 64 KiB
		h, err := cons.PostRead([]int{i % nb}, pname, []int{i % nb}, msg)
		require.NoError(t, err)
		st, err := cons.CheckXferState(h)
		require.NoError(t, err)
		require.Equal(t, StateDone, st, "a one-block READ is copied inside PostRead")
		require.NoError(t, cons.RemoveRemotePeer(pname))
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	got := notifsUntil(prod, rounds, 10*time.Second)[cons.AgentName()]
	s := cons.Stats()
	require.Equal(t, rounds, len(got), "notifications of DONE READs (sent %d, undelivered %d, engine errors %d)",
		s.NotifsSent, s.NotifsUndelivered, s.EngineErrors)
	for i, m := range got {
		require.True(t, bytes.Equal(bytes.Repeat([]byte{byte(i)}, 100<<10), m), "notification %d is not READ %d's", i, i)
	}
}

// Metadata whose engine part the engine cannot read is refused before the
// advertised region is opened, mapped and its pages loaded (it was
// refused only after).
func TestDirectUnreadableMetadataRefusedFirst(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 16
	prod := e.transport(uniqueName("uprod"), bs, nb, direct)
	cons := e.transport(uniqueName("ucons"), bs, nb, direct)
	_, adv, err := shmview.Split(prod.AgentMetadata())
	require.NoError(t, err)
	require.NotNil(t, adv)
	_, err = cons.AddRemotePeer(shmview.Wrap([]byte("not engine metadata"), adv), prod.MemDescriptor())
	require.ErrorIs(t, err, ErrBadMetadata)
	require.ErrorContains(t, err, "cannot read the metadata's process")
	require.Zero(t, cons.Stats().Peers)
}

// An advertisement naming another process than the engine metadata does
// (here init, alive and with its real start time) is refused: the direct
// path would read that process's memory, and notifications would go to
// its socket.
func TestDirectAdvertMustNameTheMetadataProcess(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 16
	mem, _ := shmRegion(t, bs*nb)
	prod := e.transport(uniqueName("aprod"), bs, nb, direct, func(c *Config) { c.Region = mem })
	cons := e.transport(uniqueName("acons"), bs, nb, direct)
	md, adv, err := shmview.Split(prod.AgentMetadata())
	require.NoError(t, err)
	require.NotNil(t, adv)
	start, err := procinfo.StartTime(1)
	require.NoError(t, err)
	forged := *adv
	forged.PID, forged.Start = 1, start
	_, err = cons.AddRemotePeer(shmview.Wrap(md, &forged), prod.MemDescriptor())
	require.ErrorIs(t, err, ErrBadMetadata)
	require.ErrorContains(t, err, "advertised as process 1")
	require.Zero(t, cons.Stats().Peers)
	// The producer's own advertisement is accepted, and read directly.
	name, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	require.Equal(t, "direct-file", cons.PeerPath(name))
}

// A same-host producer's advertisement must name the file window the
// producer itself maps at the advertised address: one naming another file
// this process may read (another tenant's region), or the producer's own
// file at another offset, is refused, and nothing of that file is read.
// (It used to be mapped and read, its bytes handed out as the producer's.)
func TestDirectAdvertMustBeTheProducersFile(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 16
	mem, _ := shmRegion(t, 2*bs*nb) // the region is the file's first half
	prod := e.transport(uniqueName("fprod"), bs, nb, direct, func(c *Config) { c.Region = mem[:bs*nb] })
	cons := e.transport(uniqueName("fcons"), bs, nb, direct)
	other, otherPath := shmRegion(t, 2*bs*nb)
	pattern.FillRegion(other, 42, bs)
	var st unix.Stat_t
	require.NoError(t, unix.Stat(otherPath, &st))
	md, adv, err := shmview.Split(prod.AgentMetadata())
	require.NoError(t, err)
	require.NotNil(t, adv)
	require.Equal(t, shmview.KindFile, adv.Kind)

	foreign := *adv
	foreign.Path, foreign.Dev, foreign.Ino, foreign.Offset = otherPath, st.Dev, st.Ino, 0
	shifted := *adv
	shifted.Offset += bs
	for name, forged := range map[string]*shmview.Advert{"another file": &foreign, "another offset": &shifted} {
		before := shmview.Mapped()
		_, err = cons.AddRemotePeer(shmview.Wrap(md, forged), prod.MemDescriptor())
		require.Error(t, err, name)
		require.ErrorContains(t, err, "process", name)
		require.ErrorContains(t, err, "maps", name)
		require.Zero(t, cons.Stats().Peers, name)
		require.Equal(t, before, shmview.Mapped(), "%s: a view stayed mapped", name)
	}
	name, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	require.Equal(t, "direct-file", cons.PeerPath(name))
}

// An inline READ's notification leaves from PostRead itself, after the
// READ is published DONE: the consumer's reactor, idle between sporadic
// READs, is not in its way.
func TestDirectInlineNotifSentByCaller(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 8
	prod := e.transport(uniqueName("nprod"), bs, nb, direct)
	cons := e.transport(uniqueName("ncons"), bs, nb, direct)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	require.Equal(t, "direct-sysv", cons.PeerPath(pname))
	for i := range 20 {
		before := cons.Stats().NotifsSent
		msg := fmt.Appendf(nil, "sess-%d:mm", i)
		h, err := cons.PostRead([]int{0}, pname, []int{i % nb}, msg)
		require.NoError(t, err)
		require.Equal(t, before+1, cons.Stats().NotifsSent, "READ %d: the notification was not sent by PostRead", i)
		st, err := cons.CheckXferState(h)
		require.NoError(t, err)
		require.Equal(t, StateDone, st)
		require.NoError(t, cons.ReleaseXferHandle(h))
		got := notifsUntil(prod, 1, 10*time.Second)
		require.Equal(t, map[string][][]byte{cons.cfg.AgentName: {msg}}, got)
	}
}

// An inline READ's notification the reactor cannot send, because its
// producer closed its transport (and socket) but its process lives on, is
// counted as one that waited and was dropped unsent: in NotifsSent and in
// NotifsUndelivered, besides the engine error. It used to be only an
// engine error, while the same loss a moment after the producer was seen
// to exit counted in both. (A producer that advertises a lifeword retires
// it at close, and the READ then fails: the producer here advertises none,
// as one of an older build, so its process's pidfd answers, alive.)
func TestDirectInlineNotifToClosedProducerCounted(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 8
	prod := e.transport(uniqueName("uprod"), bs, nb, direct, func(c *Config) { c.noLifewordForTest = true })
	cons := e.transport(uniqueName("ucons"), bs, nb, direct)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	require.Equal(t, "direct-sysv", cons.PeerPath(pname))
	require.Equal(t, "pidfd", cons.r.PeerLiveness(pname))
	require.NoError(t, prod.Deregister())
	before := cons.Stats()
	h, err := cons.PostRead([]int{0}, pname, []int{1}, []byte("sess:mm"))
	require.NoError(t, err)
	st, err := cons.CheckXferState(h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st, "the region is still mapped and its process alive")
	require.NoError(t, cons.ReleaseXferHandle(h))
	// The reactor counts the notification undelivered, then the engine
	// error; Stats loads the first before the second (parts before
	// wholes), so one snapshot can show the error and not yet the
	// notification: wait for both.
	var s Stats
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if s = cons.Stats(); s.EngineErrors > before.EngineErrors && s.NotifsUndelivered > before.NotifsUndelivered {
			break
		}
	}
	require.Greater(t, s.EngineErrors, before.EngineErrors, "the failed send is an engine error")
	require.Equal(t, before.NotifsSent+1, s.NotifsSent)
	require.Equal(t, before.NotifsUndelivered+1, s.NotifsUndelivered)
}

// Stats never shows a part above its whole while READs end: inline READs
// are direct READs, direct READs are READs done, failures by reason add
// up to at most ReadsFailed. Direct and inline READs used to be counted
// before ReadsDone and loaded after it.
func TestDirectStatsPartsWithinWholes(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 4096, 64
	_, cons, pname := directPair(e, "parts", bs, nb)
	var stop atomic.Bool
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 1 + g*(DefaultInlineBytes/bs) // inline, and on the copy workers
			idx := make([]int, n)
			for i := range idx {
				idx[i] = i
			}
			for !stop.Load() {
				h, err := cons.PostRead(idx, pname, idx, nil)
				if err != nil {
					continue
				}
				_ = cons.Wait(context.Background(), h)
				_ = cons.ReleaseXferHandle(h)
			}
		}()
	}
	var n, bad int
	var first Stats
	for deadline := time.Now().Add(1500 * time.Millisecond); time.Now().Before(deadline); n++ {
		s := cons.Stats()
		var byReason uint64
		for _, k := range s.FailedBy {
			byReason += k
		}
		if s.InlineReads > s.DirectReads || s.DirectReads > s.ReadsDone || byReason > s.ReadsFailed {
			if bad == 0 {
				first = s
			}
			bad++
		}
	}
	stop.Store(true)
	wg.Wait()
	s := cons.Stats()
	require.Greater(t, s.InlineReads, uint64(100), "too few inline READs to tell")
	require.Greater(t, s.DirectReads, s.InlineReads, "no READ on the copy workers")
	require.Zero(t, bad, "%d of %d snapshots with a part above its whole; first: inline %d, direct %d, done %d",
		bad, n, first.InlineReads, first.DirectReads, first.ReadsDone)
}

// A same-host producer that closes its transport (Deregister) and lives
// on: READs of it end in ErrRemoteDisconnect from then on, copied in
// PostRead or on the copy workers, and so does one whose copy was running
// when the producer closed (its region, which the producer may now reuse,
// was overwritten meanwhile); the peer is reported dead once, "closed its
// transport". Before, such READs ended DONE from memory the producer no
// longer registered: its lifeword went quiet at close, and the pidfd said
// the process was alive.
func TestDirectProducerDeregistered(t *testing.T) {
	for _, k := range regionKinds {
		t.Run(k.name, func(t *testing.T) {
			leakcheck.Check(t)
			e := env{t: t, backend: "ucx"}
			const bs, nb = 32768, 64
			var region []byte
			name := uniqueName("leaving")
			prod := e.transport(name, bs, nb, direct, func(c *Config) {
				if k.region != nil {
					region = k.region(t, bs*nb)
					c.Region = region
				}
			})
			pattern.FillRegion(prod.Region(), 3, bs)
			log := newEventLog()
			inline := e.transport(uniqueName("icons"), bs, nb, direct, func(c *Config) { c.Logger = slog.New(log) })
			workers := e.transport(uniqueName("wcons"), bs, nb, direct, func(c *Config) { c.InlineBytes = -1 })
			for _, c := range []*Transport{inline, workers} {
				_, err := c.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
				require.NoError(t, err)
				require.Equal(t, k.path, c.PeerPath(name))
			}
			read := func(c *Transport, blocks int) error {
				idx := make([]int, blocks)
				for i := range idx {
					idx[i] = (i * 5) % nb
				}
				clear(c.Region())
				h, err := c.PostRead(idx, name, idx, nil)
				require.NoError(t, err)
				_, err = wait(t, c, h)
				require.NoError(t, c.ReleaseXferHandle(h))
				if err == nil {
					for _, i := range idx {
						ok, at := pattern.Check(block(c, bs, i), 3, i)
						require.True(t, ok, "block %d differs at word %d", i, at)
					}
				}
				return err
			}
			require.NoError(t, read(inline, 2))
			require.NoError(t, read(workers, 16))

			// One READ on the copy workers is held inside its copy while
			// the producer closes.
			entered, let := holdDirectChunks()
			defer let()
			idx := []int{1, 2, 3, 40, 41, 42}
			h, err := workers.PostRead(idx, name, idx, nil)
			require.NoError(t, err)
			require.Eventually(t, func() bool { return entered.Load() > 0 }, 5*time.Second, 100*time.Microsecond, "no chunk started")
			require.NoError(t, prod.Deregister())
			for i := range region {
				region[i] = 0xab // the producer's memory is its own again
			}
			let()
			st, err := wait(t, workers, h)
			require.Equal(t, StateErr, st, "a READ whose copy ended after its producer closed")
			require.ErrorIs(t, err, ErrRemoteDisconnect)
			require.NoError(t, workers.ReleaseXferHandle(h))

			require.ErrorIs(t, read(inline, 2), ErrRemoteDisconnect, "copied in PostRead")
			require.ErrorIs(t, read(inline, 1), ErrRemoteDisconnect)
			require.ErrorIs(t, read(workers, 16), ErrRemoteDisconnect, "on the copy workers")
			dead := log.eventually(t, EventPeerDead, 1)
			require.Equal(t, name, dead[0].attrs["peer"].String())
			require.Equal(t, "closed its transport", dead[0].attrs["why"].String())
			require.Len(t, log.named(EventPeerDead), 1, "dead is logged once")
			require.Equal(t, 1, inline.Stats().Peers, "the peer stays until it is removed")
			require.NoError(t, inline.RemoveRemotePeer(name))
			require.NoError(t, workers.RemoveRemotePeer(name))
		})
	}
}

// A copy pool closed before the reactor (an embedder's order: a
// Transport closes its reactor first) fails the READs it did not run with
// ErrClosed, and the producer is not taken for dead: it used to be, and
// stayed dead.
func TestDirectPoolClosedIsNotADeadPeer(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "ucx"}
	const bs, nb = 5120, 1024
	_, cons, pname := directPair(e, "dpool", bs, nb)
	require.NotNil(t, cons.pool)
	cons.pool.Close()
	idx := make([]int, 880) // past inline: a READ for the pool
	for i := range idx {
		idx[i] = i
	}
	h, err := cons.PostRead(idx, pname, idx, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.ErrorIs(t, cons.Wait(ctx, h), ErrClosed)
	require.NoError(t, cons.ReleaseXferHandle(h))
	for _, ps := range cons.PeerStats(nil) {
		if ps.Name == pname {
			require.Equal(t, "up", ps.State, "the producer taken for dead")
		}
	}
	// One-block READs are copied inline, without the pool: they go on.
	h, err = cons.PostRead([]int{0}, pname, []int{1}, nil)
	require.NoError(t, err)
	st, err := cons.CheckXferState(h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
}
