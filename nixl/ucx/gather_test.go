package ucx

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// gatherPair is a producer and a consumer that reach each other in error
// mode PEER over tcp, as agents on two hosts do: the consumer's READs of
// the producer go as gathers unless one of them has NoGather.
type gatherPair struct {
	prod, cons   *Agent
	pbuf, cbuf   []byte
	local, remot nixl.DlistID
	pmem         nixl.MemID // the producer's region
	name         string
	bs, nb       int
}

func newGatherPair(t *testing.T, bs, nb int, prodCfg, consCfg Config) *gatherPair {
	t.Helper()
	t.Setenv("UCX_TLS", "tcp")
	return buildGatherPair(t, bs, nb, prodCfg, consCfg)
}

// buildGatherPair is newGatherPair with UCX_TLS left to the caller.
func buildGatherPair(t testing.TB, bs, nb int, prodCfg, consCfg Config) *gatherPair {
	t.Helper()
	prodCfg.Name, prodCfg.ErrMode = "producer", ErrModePeer
	consCfg.Name, consCfg.ErrMode = "consumer", ErrModePeer
	g := &gatherPair{prod: newTestAgent(t, prodCfg), cons: newTestAgent(t, consCfg), bs: bs, nb: nb}
	g.pbuf = mmapBuf(t, bs*nb)
	var err error
	g.pmem, err = g.prod.RegisterMem(g.pbuf, nixl.DRAM, 0)
	require.NoError(t, err)
	for i := range g.pbuf {
		g.pbuf[i] = byte(i*7 + i>>12)
	}
	g.cbuf = mmapBuf(t, bs*nb)
	_, err = g.cons.RegisterMem(g.cbuf, nixl.DRAM, 0)
	require.NoError(t, err)
	g.local, err = g.cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(g.cbuf), nb, uint64(bs), 0), nixl.DRAM)
	require.NoError(t, err)
	md, err := g.prod.LocalMetadata()
	require.NoError(t, err)
	g.name, err = g.cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	g.remot, err = g.cons.PrepDlist(g.name, descriptors.BuildBlockDescs(addrOf(g.pbuf), nb, uint64(bs), 0), nixl.DRAM)
	require.NoError(t, err)
	return g
}

// read makes and posts a READ of remote blocks ridx into local blocks lidx.
func (g *gatherPair) read(t testing.TB, lidx, ridx []int, notif []byte) nixl.XferID {
	t.Helper()
	id, err := g.cons.MakeXfer(nixl.Read, g.local, lidx, g.remot, ridx, notif)
	require.NoError(t, err)
	require.NoError(t, g.cons.PostXfer(id))
	return id
}

// check verifies that local blocks lidx hold remote blocks ridx.
func (g *gatherPair) check(t testing.TB, lidx, ridx []int) {
	t.Helper()
	for i := range lidx {
		l, r := lidx[i]*g.bs, ridx[i]*g.bs
		if !bytes.Equal(g.cbuf[l:l+g.bs], g.pbuf[r:r+g.bs]) {
			t.Fatalf("local block %d does not hold remote block %d", lidx[i], ridx[i])
		}
	}
}

// TestGatherRead: READs of a peer on "another host" go as gathers, and
// their bytes land: one block, scattered blocks, blocks of an odd size,
// a READ of many requests (more than the window), a notification after
// the bytes; and with NoGather at either end the same READs go as gets.
func TestGatherRead(t *testing.T) {
	leakcheck.Check(t)
	for _, c := range []struct {
		name       string
		bs, nb     int
		prod, cons Config
		gather     bool
	}{
		{"gather", 5120, 2048, Config{}, Config{}, true},
		{"gather-odd-blocks", 4097, 2048, Config{}, Config{}, true},
		{"gather-32KiB", 32768, 1024, Config{}, Config{}, true},
		{"producer-nogather", 5120, 2048, Config{NoGather: true}, Config{}, false},
		{"consumer-nogather", 5120, 2048, Config{}, Config{NoGather: true}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := newGatherPair(t, c.bs, c.nb, c.prod, c.cons)
			require.Equal(t, c.gather, g.cons.peers[g.name].gather)
			rng := rand.New(rand.NewSource(1))
			cases := [][2][]int{
				{{5}, {7}},
				{rng.Perm(c.nb)[:880], rng.Perm(c.nb)[:880]},
				{seq(0, 880), seq(c.nb-880, c.nb)},
			}
			if c.bs == 32768 {
				// 32 MiB in one READ: ten requests, more than the window.
				cases = append(cases, [2][]int{seq(0, c.nb), seq(0, c.nb)})
			}
			for _, rc := range cases {
				clear(g.cbuf)
				id := g.read(t, rc[0], rc[1], nil)
				require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
				g.check(t, rc[0], rc[1])
				require.NoError(t, g.cons.ReleaseXfer(id))
			}
			// A notification goes once the bytes have landed.
			id := g.read(t, seq(0, 64), seq(100, 164), []byte("after the bytes"))
			require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
			g.check(t, seq(0, 64), seq(100, 164))
			require.Equal(t, map[string][][]byte{"consumer": {[]byte("after the bytes")}},
				collectNotifs(t, g.prod, 1, 5*time.Second, g.cons))
			require.NoError(t, g.cons.ReleaseXfer(id))
			ps, cs := g.prod.GatherCounts(), g.cons.GatherCounts()
			t.Logf("producer %+v, consumer %+v", ps, cs)
			if c.gather {
				require.Positive(t, ps.Served)
			} else {
				require.Zero(t, ps.Served)
			}
			require.Zero(t, ps.Refused+ps.Dropped+cs.Bad)
		})
	}
}

// TestGatherBuffersReused: the producer keeps the buffers of the answers
// it copies for the next requests instead of allocating one per request
// (an allocation of that size is mapped and zeroed by the kernel every
// time), and what a reused buffer held before does not leak into later
// answers. Blocks of 1 KiB scattered lie in 60 pieces per answer, too
// many to send out of the registered memory: those answers are copied.
func TestGatherBuffersReused(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 1024, 8192, Config{}, Config{})
	rng := rand.New(rand.NewSource(3))
	const reads = 12
	for i := range reads {
		// Scattered on both sides, a different set every time, two
		// requests each (at most 2,048 ranges a request), 2 MiB each.
		n := 4096 - 16*(i%2)
		lidx, ridx := rng.Perm(8192)[:n], rng.Perm(8192)[:n]
		clear(g.cbuf)
		id := g.read(t, lidx, ridx, nil)
		require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
		g.check(t, lidx, ridx)
		require.NoError(t, g.cons.ReleaseXfer(id))
	}
	ps := g.prod.GatherCounts()
	require.Equal(t, uint64(reads*2), ps.Served)
	_, copied := g.prod.answerChunks()
	require.Positive(t, copied, "no answer was copied: the buffers were not used")
	allocs, kept := g.prod.gbufStats()
	t.Logf("%d requests served from %d buffers, %d kept", ps.Served, allocs, kept)
	// One consumer has at most ECX_GATHER_WINDOW requests answered at
	// once; twice the cache leaves room for sends that complete late.
	require.LessOrEqual(t, allocs, uint64(2*gbufCache))
	require.LessOrEqual(t, kept, uint32(gbufCache))
}

// TestGatherAnswersOutOfRegisteredMemory: an answer whose bytes lie in
// one piece of the producer's registered memory is sent out of it, with
// no copy of ecxfer's; one of more pieces is copied into an answer buffer
// first (UCX would send a vector on its zero-copy path, which UCX 1.13's
// tcp aborts on when the socket fails mid-send). The bytes land either
// way. Each READ is one request into the consumer's first blocks, of the
// producer's blocks in order or every other one, and the test works out
// which 60 KiB answers fall inside one run of adjacent blocks.
func TestGatherAnswersOutOfRegisteredMemory(t *testing.T) {
	leakcheck.Check(t)
	for _, c := range []struct {
		name  string
		bs, n int
		step  int // distance between the producer's blocks read
	}{
		{"32KiB-contiguous", 32768, 100, 1},
		{"5120B-contiguous", 5120, 700, 1},
		{"32KiB-every-other", 32768, 100, 2},
		{"128KiB-every-other", 131072, 28, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := newGatherPair(t, c.bs, c.step*c.n, Config{}, Config{})
			ridx := make([]int, c.n)
			for i := range ridx {
				ridx[i] = c.step * i
			}
			id := g.read(t, seq(0, c.n), ridx, nil)
			require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
			g.check(t, seq(0, c.n), ridx)
			require.NoError(t, g.cons.ReleaseXfer(id))
			require.Equal(t, uint64(1), g.prod.GatherCounts().Served)
			// The runs of adjacent blocks, as byte ranges of the answers'
			// stream: all of it, or each block alone.
			run := c.bs
			if c.step == 1 {
				run = c.n * c.bs
			}
			var wantZC, wantCopied uint64
			for at := 0; at < c.n*c.bs; at += gatherChunk {
				end := min(at+gatherChunk, c.n*c.bs)
				if at/run == (end-1)/run {
					wantZC++
				} else {
					wantCopied++
				}
			}
			zc, copied := g.prod.answerChunks()
			t.Logf("%d answers out of registered memory, %d copied", zc, copied)
			require.Equal(t, [2]uint64{wantZC, wantCopied}, [2]uint64{zc, copied})
			if c.step == 1 {
				// The consumer cuts the READ's one range at every 1 MiB;
				// the producer sees the cuts follow each other.
				require.Zero(t, copied)
			} else {
				require.Positive(t, copied)
			}
			if c.bs > gatherChunk {
				require.Positive(t, zc, "large blocks read one by one: some answers lie in one")
			}
			require.False(t, g.prod.answersReading(addrOf(g.pbuf), uint64(len(g.pbuf))))
		})
	}
}

// TestDeregisterMemWaitsForAnswers: answers sent out of registered memory
// read it until their sends call back. DeregisterMem of that memory drives
// the engine until they have; when a reader stops taking its answers it
// gives up within its bound and fails, the memory still registered, and
// the READ lands intact once the reader goes on; then the memory goes,
// and a READ of it is refused.
func TestDeregisterMemWaitsForAnswers(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 32768, 1024, Config{}, Config{})
	// Connected both ways first, so the big READ's requests leave at once.
	id := g.read(t, seq(0, 8), seq(0, 8), nil)
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	require.NoError(t, g.cons.ReleaseXfer(id))
	// 32 MiB, four requests of 3.75 MiB at a time; the consumer takes
	// nothing, so the answers fill the sockets and the rest wait.
	id = g.read(t, seq(0, 1024), seq(0, 1024), nil)
	addr, n := addrOf(g.pbuf), uint64(len(g.pbuf))
	for deadline := time.Now().Add(5 * time.Second); !g.prod.answersReading(addr, n); {
		require.True(t, time.Now().Before(deadline), "the producer never answered")
		_, err := g.prod.Progress()
		require.NoError(t, err)
	}
	for range 1000 {
		_, err := g.prod.Progress()
		require.NoError(t, err)
	}
	require.True(t, g.prod.answersReading(addr, n), "every answer went out: this tests nothing")
	start := time.Now()
	err := g.prod.DeregisterMem(g.pmem)
	require.ErrorIs(t, err, nixl.ErrNotAllowed)
	require.Less(t, time.Since(start), closeWait+time.Second)
	require.True(t, g.prod.answersReading(addr, n))
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	g.check(t, seq(0, 1024), seq(0, 1024))
	require.NoError(t, g.cons.ReleaseXfer(id))
	require.Zero(t, g.prod.GatherCounts().Refused)
	require.NoError(t, g.prod.DeregisterMem(g.pmem))
	require.False(t, g.prod.answersReading(addr, n))
	id = g.read(t, seq(0, 8), seq(0, 8), nil)
	require.Error(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	require.NoError(t, g.cons.ReleaseXfer(id))
	require.Positive(t, g.prod.GatherCounts().Refused)
}

// TestGatherEndpointFailsInSend: UCX fails an endpoint inside a send
// that finds the peer's connection gone, and calls its error handler
// there, which ends the gathered READs waiting on it; a READ being posted
// is one of them. Each READ must end once, in an error: one moved on both
// from the error handler and from the post was queued twice, which made
// the ready list a cycle that progress walked for ever (found by
// ecxfer-soak over tcp alone on the engine path, producers replaced every
// 500 ms). Here the handler is run from the send on purpose, for READs
// of one request and of several (a window's worth and more), with and
// without a notification; the agents stay usable after.
func TestGatherEndpointFailsInSend(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 32768, 1024, Config{}, Config{})
	for _, c := range []struct {
		name   string
		blocks int
		notif  []byte
	}{{"one-request", 8, nil}, {"many-requests", 1024, nil}, {"with-notification", 200, []byte("n")}} {
		t.Run(c.name, func(t *testing.T) {
			g.cons.failSendsForTest(true)
			id := g.read(t, seq(0, c.blocks), seq(0, c.blocks), c.notif)
			g.cons.failSendsForTest(false)
			require.ErrorIs(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod), nixl.ErrRemoteDisconnect)
			var comp [16]nixl.Completion
			for range 100 {
				_, err := g.cons.Progress()
				require.NoError(t, err)
				for _, cm := range comp[:g.cons.PollCompletions(comp[:])] {
					require.NotEqual(t, id, cm.ID, "the READ completed twice")
				}
			}
			require.Zero(t, g.cons.listFaults(), "a READ was queued twice")
			require.NoError(t, g.cons.ReleaseXfer(id))
			// The endpoint itself is fine: the next READ lands.
			id = g.read(t, seq(0, 64), seq(64, 128), nil)
			require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
			g.check(t, seq(0, 64), seq(64, 128))
			require.NoError(t, g.cons.ReleaseXfer(id))
		})
	}
}

func seq(lo, hi int) []int {
	s := make([]int, 0, hi-lo)
	for i := lo; i < hi; i++ {
		s = append(s, i)
	}
	return s
}

// TestGatherBusyRetries: a producer whose answers in flight reach its
// limit refuses further requests as busy, and the consumer asks again
// until every byte has come.
func TestGatherBusyRetries(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 32768, 1024, Config{}, Config{})
	// Any request that comes while answers are in flight is refused: 32
	// MiB of answers do not fit the socket's buffer, so some are.
	g.prod.c.gather_max_out = 1
	var ids []nixl.XferID
	var halves [][2][]int
	for k := range 4 {
		l, r := seq(k*256, (k+1)*256), seq(1024-(k+1)*256, 1024-k*256)
		ids = append(ids, g.read(t, l, r, nil))
		halves = append(halves, [2][]int{l, r})
	}
	// All four at once: waitXfer would drop the others' completions.
	for deadline := time.Now().Add(20 * time.Second); ; {
		_, err := g.prod.Progress()
		require.NoError(t, err)
		_, err = g.cons.Progress()
		require.NoError(t, err)
		left := 0
		for _, id := range ids {
			done, err := g.cons.XferStatus(id)
			require.NoError(t, err)
			if !done {
				left++
			}
		}
		if left == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "%d READs still in flight after 20s", left)
	}
	for i, id := range ids {
		g.check(t, halves[i][0], halves[i][1])
		require.NoError(t, g.cons.ReleaseXfer(id))
	}
	ps, cs := g.prod.GatherCounts(), g.cons.GatherCounts()
	t.Logf("producer %+v, consumer %+v", ps, cs)
	require.Positive(t, ps.Busy, "the producer never refused a request as busy: this tests nothing")
	require.Positive(t, cs.Retries)
}

// TestGatherReleaseInFlight: READs released while their answers are on
// the way: what comes after is dropped (counted late), nothing of it
// reaches the local memory, and the agents go on.
func TestGatherReleaseInFlight(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 32768, 1024, Config{}, Config{})
	for i := range g.cbuf {
		g.cbuf[i] = 0xA5
	}
	id := g.read(t, seq(0, 1024), seq(0, 1024), []byte("never"))
	// Let the first requests be answered in part.
	for range 5 {
		_, err := g.prod.Progress()
		require.NoError(t, err)
		_, err = g.cons.Progress()
		require.NoError(t, err)
	}
	require.NoError(t, g.cons.ReleaseXfer(id))
	snap := append([]byte(nil), g.cbuf...)
	for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); {
		_, err := g.prod.Progress()
		require.NoError(t, err)
		_, err = g.cons.Progress()
		require.NoError(t, err)
	}
	require.True(t, bytes.Equal(snap, g.cbuf), "a released READ's answers still wrote local memory")
	cs := g.cons.GatherCounts()
	t.Logf("consumer %+v", cs)
	require.Positive(t, cs.Late, "no answer came after the release: this tests nothing")
	require.Empty(t, g.prod.GetNotifs(map[string][][]byte{}), "a released READ's notification was sent")
	// The pair still works.
	id = g.read(t, seq(0, 880), seq(100, 980), nil)
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	g.check(t, seq(0, 880), seq(100, 980))
	require.NoError(t, g.cons.ReleaseXfer(id))
}

// TestGatherOutOfBounds: a consumer that claims the producer has more
// memory than it registered (its metadata altered) asks for bytes beyond
// it: the producer refuses, checked against its own registrations, and
// the READ fails; a request inside the memory is still served.
func TestGatherOutOfBounds(t *testing.T) {
	leakcheck.Check(t)
	t.Setenv("UCX_TLS", "tcp")
	const bs, nb = 4096, 64
	prod := newTestAgent(t, Config{Name: "producer", ErrMode: ErrModePeer})
	cons := newTestAgent(t, Config{Name: "consumer", ErrMode: ErrModePeer})
	pbuf := mmapBuf(t, 2*bs*nb)
	// Only the first half is registered; the second holds a secret.
	_, err := prod.RegisterMem(pbuf[:bs*nb], nixl.DRAM, 0)
	require.NoError(t, err)
	copy(pbuf[bs*nb:], bytes.Repeat([]byte("secret"), bs*nb/6))
	cbuf := mmapBuf(t, bs*nb)
	_, err = cons.RegisterMem(cbuf, nixl.DRAM, 0)
	require.NoError(t, err)
	md, err := prod.LocalMetadata()
	require.NoError(t, err)
	m, err := decodeMetadata(md)
	require.NoError(t, err)
	m.Region[0].Len *= 2 // the lie
	lie, err := encodeMetadata(m)
	require.NoError(t, err)
	name, err := cons.LoadRemoteMetadata(lie)
	require.NoError(t, err)
	require.True(t, cons.peers[name].gather)
	local, err := cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(cbuf), nb, bs, 0), nixl.DRAM)
	require.NoError(t, err)
	remote, err := cons.PrepDlist(name, descriptors.BuildBlockDescs(addrOf(pbuf), 2*nb, bs, 0), nixl.DRAM)
	require.NoError(t, err)
	for _, ridx := range [][]int{{nb}, {3, nb + 5}, {2*nb - 1}} {
		id, err := cons.MakeXfer(nixl.Read, local, seq(0, len(ridx)), remote, ridx, nil)
		require.NoError(t, err)
		require.NoError(t, cons.PostXfer(id))
		err = waitXfer(t, cons, id, 10*time.Second, prod)
		require.Error(t, err, "a READ beyond the producer's registered memory succeeded")
		require.NoError(t, cons.ReleaseXfer(id))
	}
	require.False(t, bytes.Contains(cbuf, []byte("secret")), "bytes the producer did not register reached the consumer")
	id, err := cons.MakeXfer(nixl.Read, local, []int{0, 1}, remote, []int{2, nb - 1}, nil)
	require.NoError(t, err)
	require.NoError(t, cons.PostXfer(id))
	require.NoError(t, waitXfer(t, cons, id, 10*time.Second, prod))
	require.Equal(t, pbuf[2*bs:3*bs], cbuf[:bs])
	require.NoError(t, cons.ReleaseXfer(id))
	ps := prod.GatherCounts()
	t.Logf("producer %+v", ps)
	require.Equal(t, uint64(3), ps.Refused)
}

// TestGatherLargeTCPSegments: between two agents with LargeTCPSegments a
// gathered READ's answers come in 252 KiB chunks (each one message in
// their 256 KiB tcp segments), out of the producer's memory when they lie
// in one piece of it; the bytes land, with a notification too.
func TestGatherLargeTCPSegments(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb, big = 32768, 256, 252 << 10
	on := Config{LargeTCPSegments: true}
	g := newGatherPair(t, bs, nb, on, on)
	require.NotZero(t, g.prod.c.big_segs)
	require.NotZero(t, g.cons.c.big_segs)
	require.True(t, g.cons.peers[g.name].gatherBig)
	chunks := func(bytes int) uint64 { return uint64((bytes + big - 1) / big) }
	// 128 contiguous blocks (4 MiB: two requests, the first of 15 whole
	// chunks, 3.69 MiB), then 100 blocks apart.
	id := g.read(t, seq(0, 128), seq(0, 128), []byte("n"))
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	g.check(t, seq(0, 128), seq(0, 128))
	require.NoError(t, g.cons.ReleaseXfer(id))
	zc, copied := g.prod.answerChunks()
	require.Equal(t, [2]uint64{15 + chunks(128*bs-15*big), 0}, [2]uint64{zc, copied})
	apart := make([]int, 100)
	for i := range apart {
		apart[i] = nb - 1 - 2*i
	}
	id = g.read(t, seq(0, 100), apart, nil)
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	g.check(t, seq(0, 100), apart)
	require.NoError(t, g.cons.ReleaseXfer(id))
	zc2, copied2 := g.prod.answerChunks()
	require.Equal(t, [2]uint64{zc, chunks(100 * bs)}, [2]uint64{zc2, copied2})
	require.Equal(t, uint64(3), g.prod.GatherCounts().Served)
	require.Zero(t, g.prod.GatherCounts().Refused)
}

// TestLargeTCPSegmentsBothEnds: an agent with LargeTCPSegments and one
// without refuse each other's metadata (one would send tcp messages the
// other has no room for), and the option conflicts with UCX's own
// segment settings in the environment.
func TestLargeTCPSegmentsBothEnds(t *testing.T) {
	leakcheck.Check(t)
	t.Setenv("UCX_TLS", "tcp")
	on := newTestAgent(t, Config{Name: "on", LargeTCPSegments: true, ErrMode: ErrModePeer})
	off := newTestAgent(t, Config{Name: "off", ErrMode: ErrModePeer})
	// Builds from before LargeTCPSegments read version 1 alone: they
	// refuse the agent with it whole, and read the other.
	for _, c := range []struct {
		a   *Agent
		ver uint64
	}{{on, 2}, {off, 1}} {
		md, err := c.a.LocalMetadata()
		require.NoError(t, err)
		require.Equal(t, c.ver, envelopeVersion(t, md), c.a.cfg.Name)
	}
	for _, c := range []struct{ from, to *Agent }{{on, off}, {off, on}} {
		md, err := c.to.LocalMetadata()
		require.NoError(t, err)
		_, err = c.from.LoadRemoteMetadata(md)
		require.ErrorIs(t, err, nixl.ErrInvalidParam)
		require.ErrorContains(t, err, "LargeTCPSegments")
	}
	for _, v := range []string{"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"} {
		t.Run(v, func(t *testing.T) {
			t.Setenv(v, "64k")
			_, err := New(Config{Name: "env", LargeTCPSegments: true})
			require.ErrorIs(t, err, nixl.ErrInvalidParam)
			require.ErrorContains(t, err, v)
		})
	}
}

// TestGatherChunkSizes: a producer answers requests naming 60 KiB chunks
// (or 0, as builds before the field send), and 252 KiB ones only with
// LargeTCPSegments; it refuses any other size, and the consumer's READ
// fails; the agents go on.
func TestGatherChunkSizes(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 5120, 512
	g := newGatherPair(t, bs, nb, Config{}, Config{})
	require.False(t, g.cons.peers[g.name].gatherBig)
	for _, size := range []uint32{0, gatherChunk} {
		g.cons.gatherChunkForTest(size)
		clear(g.cbuf)
		id := g.read(t, seq(0, nb), seq(0, nb), nil)
		require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
		g.check(t, seq(0, nb), seq(0, nb))
		require.NoError(t, g.cons.ReleaseXfer(id))
	}
	for i, size := range []uint32{252 << 10, 32 << 10, 1, gatherChunk + 1} {
		g.cons.gatherChunkForTest(size)
		id := g.read(t, seq(0, 4), seq(100, 104), nil)
		require.Error(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod), "chunks of %d", size)
		require.NoError(t, g.cons.ReleaseXfer(id))
		require.Equal(t, uint64(i+1), g.prod.GatherCounts().Refused)
	}
	g.cons.gatherChunkForTest(0)
	id := g.read(t, seq(0, 4), seq(100, 104), nil)
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	g.check(t, seq(0, 4), seq(100, 104))
	require.NoError(t, g.cons.ReleaseXfer(id))
}

// gatherReq lays out a request's ranges as the wire carries them.
func gatherReq(ranges ...uint64) []byte {
	b := make([]byte, 8*len(ranges))
	for i, v := range ranges {
		binary.LittleEndian.PutUint64(b[8*i:], v)
	}
	return b
}

// TestGatherIDsUnguessable: answers are matched to a READ by its id
// alone, whatever endpoint they come in on, so a peer that has seen the
// ids of READs from itself must not be able to name one from another
// peer: with ids in sequence, the id after one's own was another
// producer's READ, and an answer naming it wrote into that READ's blocks
// (or failed it). The ids are random: answers that guess from a seen id
// (the next ones, the ones before) name no READ and are dropped as late.
func TestGatherIDsUnguessable(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 4096, 64, Config{}, Config{})
	for i := range g.cbuf {
		g.cbuf[i] = 0xEE
	}
	// Two READs in flight, never answered (the producer is not
	// progressed): "seen" stands for the hostile peer's own READ, the
	// other for another producer's.
	a := g.read(t, []int{0}, []int{1}, nil)
	seen := uint64(g.cons.c.glast)
	b := g.read(t, []int{1, 2}, []int{3, 4}, nil)
	other := uint64(g.cons.c.glast)
	require.NotZero(t, seen)
	require.NotEqual(t, seen, other)
	late0 := g.cons.GatherCounts().Late
	guesses := []uint64{seen + 1, seen + 2, seen - 1, seen ^ 1, seen + 1<<32}
	for _, id := range guesses {
		require.NotEqual(t, other, id, "the other READ's id follows from the one seen")
		h := make([]byte, 24)
		binary.LittleEndian.PutUint64(h, id)
		binary.LittleEndian.PutUint32(h[20:], 2*4096)
		g.cons.gatherInject(h, bytes.Repeat([]byte{0x66}, 2*4096))
	}
	require.Equal(t, late0+uint64(len(guesses)), g.cons.GatherCounts().Late, "every guessed answer dropped")
	require.False(t, bytes.Contains(g.cbuf, []byte{0x66}), "a guessed answer wrote local memory")
	// Both READs still complete with the producer's bytes.
	var comp [16]nixl.Completion
	for deadline := time.Now().Add(10 * time.Second); ; {
		require.True(t, time.Now().Before(deadline), "the READs did not complete")
		_, err := g.prod.Progress()
		require.NoError(t, err)
		_, err = g.cons.Progress()
		require.NoError(t, err)
		g.cons.PollCompletions(comp[:])
		da, ea := g.cons.XferStatus(a)
		db, eb := g.cons.XferStatus(b)
		if da && db {
			require.NoError(t, ea)
			require.NoError(t, eb)
			break
		}
	}
	g.check(t, []int{0, 1, 2}, []int{1, 3, 4})
	require.NoError(t, g.cons.ReleaseXfer(a))
	require.NoError(t, g.cons.ReleaseXfer(b))
}

// TestGatherRefusalIsTheOwnersWord: a refusal carries the owner's status,
// which is the peer's word: one that says the connection was reset, or
// the READ canceled, fails the READ as refused, not as a disconnected
// peer (which the reactor takes for dead) or a READ this side canceled;
// the statuses the owner's check gives pass as they are.
func TestGatherRefusalIsTheOwnersWord(t *testing.T) {
	leakcheck.Check(t)
	g := newGatherPair(t, 4096, 64, Config{}, Config{})
	for _, c := range []struct {
		st   int32
		want string
	}{
		{-25, "rejected"},         // UCS_ERR_CONNECTION_RESET
		{-16, "rejected"},         // UCS_ERR_CANCELED
		{-80, "rejected"},         // UCS_ERR_ENDPOINT_TIMEOUT
		{-7, "address not valid"}, // UCS_ERR_INVALID_ADDR
		{-5, "invalid param"},     // UCS_ERR_INVALID_PARAM
	} {
		before := g.cons.c.glast
		id := g.read(t, []int{0}, []int{1}, nil)
		require.NotEqual(t, before, g.cons.c.glast, "the READ is held, not posted")
		h := make([]byte, 24)
		binary.LittleEndian.PutUint64(h, uint64(g.cons.c.glast))
		binary.LittleEndian.PutUint32(h[16:], uint32(c.st))
		g.cons.gatherInject(h, nil)
		err := waitXfer(t, g.cons, id, 10*time.Second, g.prod)
		require.Error(t, err, "status %d", c.st)
		require.NotErrorIs(t, err, nixl.ErrRemoteDisconnect, "status %d", c.st)
		require.NotErrorIs(t, err, nixl.ErrCanceled, "status %d", c.st)
		require.Contains(t, strings.ToLower(err.Error()), c.want, "status %d", c.st)
		require.NoError(t, g.cons.ReleaseXfer(id))
	}
}

// TestGatherStalledReaderHoldsHalf: a reader that stops taking its
// answers (stopped, stuck, or hostile) leaves them in the owner's sends
// once the sockets' buffers are full. It may hold half of the owner's
// bound on answers in flight and no more (its further requests are
// refused as busy), so another reader's READ is still served; the stalled
// one's READs complete once it reads again.
//
// With the bound on refusals to one reader lowered to 2, its requests
// past it are dropped unanswered, and its READs wait until released.
func TestGatherStalledReaderHoldsHalf(t *testing.T) {
	t.Run("busy", func(t *testing.T) { stalledReader(t, false) })
	t.Run("dropped", func(t *testing.T) { stalledReader(t, true) })
}

// stalledReader runs it with the owner's bound on refusals to one reader
// at its default, or with few at 2.
func stalledReader(t *testing.T, few bool) {
	leakcheck.Check(t)
	const bs, nb = 32768, 2048
	g := newGatherPair(t, bs, nb, Config{}, Config{})
	g.prod.c.gather_max_out = 16 << 20
	if few {
		g.prod.c.gather_max_refused = 2
	}
	a := newTestAgent(t, Config{Name: "stalled", ErrMode: ErrModePeer})
	abuf := mmapBuf(t, bs*nb)
	_, err := a.RegisterMem(abuf, nixl.DRAM, 0)
	require.NoError(t, err)
	local, err := a.PrepDlist("", descriptors.BuildBlockDescs(addrOf(abuf), nb, bs, 0), nixl.DRAM)
	require.NoError(t, err)
	md, err := g.prod.LocalMetadata()
	require.NoError(t, err)
	name, err := a.LoadRemoteMetadata(md)
	require.NoError(t, err)
	remote, err := a.PrepDlist(name, descriptors.BuildBlockDescs(addrOf(g.pbuf), nb, bs, 0), nixl.DRAM)
	require.NoError(t, err)
	// One READ first, which sets the connection up.
	id, err := a.MakeXfer(nixl.Read, local, []int{nb - 1}, remote, []int{nb - 1}, nil)
	require.NoError(t, err)
	require.NoError(t, a.PostXfer(id))
	require.NoError(t, waitXfer(t, a, id, 10*time.Second, g.prod))
	require.NoError(t, a.ReleaseXfer(id))
	// The stalled reader asks for 64 MiB in eight READs, then takes
	// nothing while the owner serves it.
	var ids []nixl.XferID
	for k := range 8 {
		id, err := a.MakeXfer(nixl.Read, local, seq(k*256, (k+1)*256), remote, seq(k*256, (k+1)*256), nil)
		require.NoError(t, err)
		require.NoError(t, a.PostXfer(id))
		ids = append(ids, id)
	}
	_, err = a.Progress() // the requests out
	require.NoError(t, err)
	for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); {
		_, err := g.prod.Progress()
		require.NoError(t, err)
	}
	held := uint64(g.prod.c.gather_out)
	t.Logf("the stalled reader's answers in the owner's sends: %d bytes; producer %+v", held, g.prod.GatherCounts())
	require.GreaterOrEqual(t, held, uint64(4<<20), "the stalled reader's answers did not pile up: this tests nothing")
	require.LessOrEqual(t, held, uint64(8<<20), "one reader holds more than half the bound")
	require.Positive(t, g.prod.GatherCounts().Busy)
	if few {
		require.Positive(t, g.prod.GatherCounts().Dropped, "no request dropped past 2 refusals")
	}

	// Another reader is served meanwhile.
	id = g.read(t, seq(0, 64), seq(100, 164), nil)
	require.NoError(t, waitXfer(t, g.cons, id, 10*time.Second, g.prod))
	g.check(t, seq(0, 64), seq(100, 164))
	require.NoError(t, g.cons.ReleaseXfer(id))

	if few {
		// Requests went unanswered: the READs wait until released.
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); {
			_, err := g.prod.Progress()
			require.NoError(t, err)
			_, err = a.Progress()
			require.NoError(t, err)
		}
		for _, id := range ids {
			require.NoError(t, a.ReleaseXfer(id))
		}
		return
	}
	// The stalled reader reads again: its READs complete, bytes intact.
	var comp [16]nixl.Completion
	for deadline := time.Now().Add(20 * time.Second); ; {
		_, err := g.prod.Progress()
		require.NoError(t, err)
		_, err = a.Progress()
		require.NoError(t, err)
		a.PollCompletions(comp[:])
		left := 0
		for _, id := range ids {
			done, err := a.XferStatus(id)
			require.NoError(t, err)
			if !done {
				left++
			}
		}
		if left == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "%d READs of the stalled reader still in flight", left)
	}
	require.Equal(t, g.pbuf[:8*256*bs], abuf[:8*256*bs])
	for _, id := range ids {
		require.NoError(t, a.ReleaseXfer(id))
	}
}

// Two readers that stop taking their answers, each up to half the owner's
// bound, fill it between them; a third reader, which takes its answers,
// is still served (a reader with nothing in flight is served past the
// bound, up to twice it), and the bytes it reads are right. It used to be
// refused as busy for as long as the two stayed stalled, and its READ
// ended at its timeout.
func TestGatherTwoStalledReaders(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 32768, 2048
	g := newGatherPair(t, bs, nb, Config{}, Config{})
	g.prod.c.gather_max_out = 16 << 20
	md, err := g.prod.LocalMetadata()
	require.NoError(t, err)
	for s := range 2 {
		a := newTestAgent(t, Config{Name: fmt.Sprintf("stalled-%d", s), ErrMode: ErrModePeer})
		abuf := mmapBuf(t, bs*nb)
		_, err := a.RegisterMem(abuf, nixl.DRAM, 0)
		require.NoError(t, err)
		local, err := a.PrepDlist("", descriptors.BuildBlockDescs(addrOf(abuf), nb, bs, 0), nixl.DRAM)
		require.NoError(t, err)
		name, err := a.LoadRemoteMetadata(md)
		require.NoError(t, err)
		remote, err := a.PrepDlist(name, descriptors.BuildBlockDescs(addrOf(g.pbuf), nb, bs, 0), nixl.DRAM)
		require.NoError(t, err)
		id, err := a.MakeXfer(nixl.Read, local, []int{nb - 1}, remote, []int{nb - 1}, nil)
		require.NoError(t, err)
		require.NoError(t, a.PostXfer(id))
		require.NoError(t, waitXfer(t, a, id, 10*time.Second, g.prod))
		require.NoError(t, a.ReleaseXfer(id))
		for k := range 8 { // 64 MiB asked for, then nothing taken
			id, err := a.MakeXfer(nixl.Read, local, seq(k*256, (k+1)*256), remote, seq(k*256, (k+1)*256), nil)
			require.NoError(t, err)
			require.NoError(t, a.PostXfer(id))
		}
		_, err = a.Progress()
		require.NoError(t, err)
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); {
			_, err := g.prod.Progress()
			require.NoError(t, err)
		}
	}
	held := uint64(g.prod.c.gather_out)
	t.Logf("the stalled readers' answers in the owner's sends: %d bytes; %+v", held, g.prod.GatherCounts())
	require.GreaterOrEqual(t, held, uint64(12<<20), "the stalled readers did not fill the bound: this tests nothing")
	id := g.read(t, seq(0, 256), seq(1000, 1256), nil) // 8 MiB: more than one request
	require.NoError(t, waitXfer(t, g.cons, id, 20*time.Second, g.prod))
	g.check(t, seq(0, 256), seq(1000, 1256))
	require.NoError(t, g.cons.ReleaseXfer(id))
	require.LessOrEqual(t, uint64(g.prod.c.gather_out), uint64(2*16<<20), "past twice the bound")
}
