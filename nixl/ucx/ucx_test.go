package ucx

import (
	"math/rand"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// patternByte is the content of byte j of block i for a given seed; both
// sides of a test compute it independently.
func patternByte(seed uint64, i, j int) byte {
	x := seed*0x9E3779B97F4A7C15 + uint64(i)*0xBF58476D1CE4E5B9 + uint64(j>>3)*0x94D049BB133111EB
	x ^= x >> 29
	return byte(x >> (8 * uint(j&7)))
}

func fillBlocks(buf []byte, blockSize int, seed uint64) {
	for i := 0; i < len(buf)/blockSize; i++ {
		b := buf[i*blockSize : (i+1)*blockSize]
		for j := range b {
			b[j] = patternByte(seed, i, j)
		}
	}
}

// checkBlock reports the first mismatching byte of block dst against remote
// block i, or -1.
func checkBlock(dst []byte, seed uint64, i int) int {
	for j := range dst {
		if dst[j] != patternByte(seed, i, j) {
			return j
		}
	}
	return -1
}

func newTestAgent(t testing.TB, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	return a
}

// mmapBuf returns n bytes outside the Go heap.
func mmapBuf(t testing.TB, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Munmap(b)) })
	return b
}

// waitXfer drives every agent until id completes on a or the timeout.
func waitXfer(t testing.TB, a *Agent, id nixl.XferID, timeout time.Duration, others ...*Agent) error {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var comp [16]nixl.Completion
	for time.Now().Before(deadline) {
		for _, o := range others {
			_, err := o.Progress()
			require.NoError(t, err)
		}
		_, err := a.Progress()
		require.NoError(t, err)
		n := a.PollCompletions(comp[:])
		for _, c := range comp[:n] {
			if c.ID == id {
				done, serr := a.XferStatus(id)
				require.True(t, done)
				require.Equal(t, c.Err, serr)
				return c.Err
			}
		}
	}
	t.Fatalf("xfer %d did not complete within %v", id, timeout)
	return nil
}

func collectNotifs(t testing.TB, a *Agent, want int, timeout time.Duration, others ...*Agent) map[string][][]byte {
	t.Helper()
	got := map[string][][]byte{}
	n := 0
	deadline := time.Now().Add(timeout)
	for n < want && time.Now().Before(deadline) {
		for _, o := range others {
			_, err := o.Progress()
			require.NoError(t, err)
		}
		_, err := a.Progress()
		require.NoError(t, err)
		n += a.GetNotifs(got)
	}
	require.Equal(t, want, n, "notifications")
	return got
}

func fdCount(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

const (
	testBlock  = 5120
	testBlocks = 64
)

type pair struct {
	prod, cons       *Agent
	prodBuf, consBuf []byte
	local, remote    nixl.DlistID
	peer             string
}

func newPair(t *testing.T, prodAlloc bool) *pair {
	t.Helper()
	p := &pair{
		prod: newTestAgent(t, Config{Name: "producer"}),
		cons: newTestAgent(t, Config{Name: "consumer"}),
	}
	n := testBlock * testBlocks
	var err error
	if prodAlloc {
		_, p.prodBuf, err = p.prod.AllocMem(n, nixl.DRAM, 0)
		require.NoError(t, err)
	} else {
		p.prodBuf = mmapBuf(t, n)
		_, err = p.prod.RegisterMem(p.prodBuf, nixl.DRAM, 0)
		require.NoError(t, err)
	}
	fillBlocks(p.prodBuf, testBlock, 7)
	p.consBuf = mmapBuf(t, n)
	_, err = p.cons.RegisterMem(p.consBuf, nixl.DRAM, 0)
	require.NoError(t, err)

	md, err := p.prod.LocalMetadata()
	require.NoError(t, err)
	p.peer, err = p.cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	require.Equal(t, "producer", p.peer)
	// The producer knows the consumer too (for SendNotif).
	cmd, err := p.cons.LocalMetadata()
	require.NoError(t, err)
	_, err = p.prod.LoadRemoteMetadata(cmd)
	require.NoError(t, err)

	p.local, err = p.cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(p.consBuf), testBlocks, testBlock, 0), nixl.DRAM)
	require.NoError(t, err)
	p.remote, err = p.cons.PrepDlist(p.peer, descriptors.BuildBlockDescs(addrOf(p.prodBuf), testBlocks, testBlock, 0), nixl.DRAM)
	require.NoError(t, err)
	return p
}

func addrOf(b []byte) uint64 { return nixl.Addr(b) }

func TestReadInProcess(t *testing.T) {
	leakcheck.Check(t)
	for _, alloc := range []bool{true, false} {
		name := "registered"
		if alloc {
			name = "allocated"
		}
		t.Run(name, func(t *testing.T) {
			p := newPair(t, alloc)
			rng := rand.New(rand.NewSource(1))
			remoteIdx := rng.Perm(testBlocks)[:40]
			localIdx := rng.Perm(testBlocks)[:40]
			notif := []byte("image-42 done")
			id, err := p.cons.MakeXfer(nixl.Read, p.local, localIdx, p.remote, remoteIdx, notif)
			require.NoError(t, err)
			done, err := p.cons.XferStatus(id)
			require.False(t, done)
			require.ErrorIs(t, err, nixl.ErrNotPosted)
			require.NoError(t, p.cons.PostXfer(id))
			require.NoError(t, waitXfer(t, p.cons, id, 5*time.Second, p.prod))
			for k, li := range localIdx {
				got := p.consBuf[li*testBlock : (li+1)*testBlock]
				require.Equal(t, -1, checkBlock(got, 7, remoteIdx[k]), "block %d <- %d", li, remoteIdx[k])
			}
			notifs := collectNotifs(t, p.prod, 1, 5*time.Second, p.cons)
			require.Equal(t, map[string][][]byte{"consumer": {notif}}, notifs)

			// Repost the same request: same result, one more notification.
			clear(p.consBuf)
			require.NoError(t, p.cons.PostXfer(id))
			require.ErrorIs(t, p.cons.PostXfer(id), nixl.ErrRepostActive)
			require.NoError(t, waitXfer(t, p.cons, id, 5*time.Second, p.prod))
			for k, li := range localIdx {
				require.Equal(t, -1, checkBlock(p.consBuf[li*testBlock:(li+1)*testBlock], 7, remoteIdx[k]))
			}
			notifs = collectNotifs(t, p.prod, 1, 5*time.Second, p.cons)
			require.Equal(t, [][]byte{notif}, notifs["consumer"])
			require.NoError(t, p.cons.ReleaseXfer(id))
			require.ErrorIs(t, p.cons.ReleaseXfer(id), nixl.ErrNotFound)
		})
	}
}

func TestWriteAndSendNotif(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, true)
	src := p.consBuf
	fillBlocks(src, testBlock, 99)
	idx := []int{3, 4, 5, 9, 0}
	id, err := p.cons.MakeXfer(nixl.Write, p.local, idx, p.remote, idx, nil)
	require.NoError(t, err)
	require.NoError(t, p.cons.PostXfer(id))
	require.NoError(t, waitXfer(t, p.cons, id, 5*time.Second, p.prod))
	for _, i := range idx {
		require.Equal(t, -1, checkBlock(p.prodBuf[i*testBlock:(i+1)*testBlock], 99, i))
	}
	require.Equal(t, -1, checkBlock(p.prodBuf[1*testBlock:2*testBlock], 7, 1), "untouched block")
	// No notification for an empty message.
	got := map[string][][]byte{}
	for i := 0; i < 100; i++ {
		_, _ = p.prod.Progress()
		p.prod.GetNotifs(got)
	}
	require.Empty(t, got)

	require.NoError(t, p.prod.SendNotif("consumer", []byte("hello")))
	require.NoError(t, p.cons.SendNotif("producer", []byte{}))
	require.Equal(t, map[string][][]byte{"producer": {[]byte("hello")}}, collectNotifs(t, p.cons, 1, 5*time.Second, p.prod))
	require.Equal(t, map[string][][]byte{"consumer": {{}}}, collectNotifs(t, p.prod, 1, 5*time.Second, p.cons))
}

func TestValidation(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, true)
	c := p.cons
	outside := descriptors.List{{Addr: addrOf(p.prodBuf) + uint64(len(p.prodBuf)) - 10, Len: 20}}
	_, err := c.PrepDlist(p.peer, outside, nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = c.PrepDlist("", outside, nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = c.PrepDlist("nobody", nil, nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrNotFound)
	_, err = c.PrepDlist("", nil, nixl.VRAM)
	require.ErrorIs(t, err, nixl.ErrNotSupported)

	_, err = c.MakeXfer(nixl.Read, p.local, []int{1}, p.remote, []int{1, 2}, nil)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = c.MakeXfer(nixl.Read, p.local, []int{1}, p.remote, []int{testBlocks}, nil)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = c.MakeXfer(nixl.Read, p.local, []int{1}, p.remote, []int{1}, make([]byte, nixl.DefaultMaxNotif+1))
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = c.MakeXfer(nixl.Read, p.remote, []int{1}, p.local, []int{1}, nil)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	half, err := c.PrepDlist("", descriptors.List{{Addr: addrOf(p.consBuf), Len: testBlock / 2}}, nixl.DRAM)
	require.NoError(t, err)
	_, err = c.MakeXfer(nixl.Read, half, []int{0}, p.remote, []int{0}, nil)
	require.ErrorIs(t, err, nixl.ErrMismatch)
	require.ErrorIs(t, c.SendNotif("producer", make([]byte, nixl.DefaultMaxNotif+1)), nixl.ErrInvalidParam)

	// Memory in use by a list cannot be deregistered.
	mid, buf, err := c.AllocMem(4096, nixl.DRAM, 0)
	require.NoError(t, err)
	require.Len(t, buf, 4096)
	d, err := c.PrepDlist("", descriptors.List{{Addr: addrOf(buf), Len: 4096}}, nixl.DRAM)
	require.NoError(t, err)
	require.ErrorIs(t, c.DeregisterMem(mid), nixl.ErrNotAllowed)
	require.NoError(t, c.ReleaseDlist(d))
	require.ErrorIs(t, c.ReleaseDlist(d), nixl.ErrNotFound)
	require.NoError(t, c.DeregisterMem(mid))
	require.ErrorIs(t, c.DeregisterMem(mid), nixl.ErrNotFound)
	_, err = c.RegisterMem(p.consBuf[10:20], nixl.DRAM, 0)
	require.ErrorIs(t, err, nixl.ErrInvalidParam, "overlapping registration")

	// Metadata: identical reload is fine, changed metadata is refused.
	md, err := p.prod.LocalMetadata()
	require.NoError(t, err)
	name, err := c.LoadRemoteMetadata(md)
	require.NoError(t, err)
	require.Equal(t, "producer", name)
	_, _, err = p.prod.AllocMem(4096, nixl.DRAM, 0)
	require.NoError(t, err)
	md2, err := p.prod.LocalMetadata()
	require.NoError(t, err)
	name, err = c.LoadRemoteMetadata(md2)
	require.ErrorIs(t, err, nixl.ErrNotAllowed)
	require.Equal(t, "producer", name, "the refused peer is named")
	require.NoError(t, c.InvalidateRemoteMetadata("producer"))
	require.ErrorIs(t, c.InvalidateRemoteMetadata("producer"), nixl.ErrNotFound)
	_, err = c.MakeXfer(nixl.Read, p.local, []int{1}, p.remote, []int{1}, nil)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	name, err = c.LoadRemoteMetadata(md2)
	require.NoError(t, err)
	require.Equal(t, "producer", name)
}

func TestCloseIdempotentAndLeaks(t *testing.T) {
	leakcheck.Check(t)
	runtime.GC()
	fds := fdCount(t)
	goroutines := runtime.NumGoroutine()
	for i := 0; i < 3; i++ {
		a, err := New(Config{Name: "a"})
		require.NoError(t, err)
		b, err := New(Config{Name: "b"})
		require.NoError(t, err)
		_, buf, err := a.AllocMem(1<<20, nixl.DRAM, 0)
		require.NoError(t, err)
		md, err := a.LocalMetadata()
		require.NoError(t, err)
		_, err = b.LoadRemoteMetadata(md)
		require.NoError(t, err)
		_, _, err = b.AllocMem(1<<20, nixl.DRAM, 0)
		require.NoError(t, err)
		require.NoError(t, b.Close())
		require.NoError(t, b.Close())
		require.NoError(t, a.Close())
		require.NoError(t, a.Close())
		_, err = a.LocalMetadata()
		require.ErrorIs(t, err, nixl.ErrNotAllowed)
		require.Equal(t, -1, a.EventFD())
		_ = buf
	}
	require.Equal(t, fds, fdCount(t), "fds after Close")
	require.LessOrEqual(t, runtime.NumGoroutine(), goroutines, "goroutines after Close")
}

// TestSharedQueueGets: a same-host peer's registered memory is read with
// gets it answers through the shared-memory receive queue; its allocated
// memory is read one-sided, and over tcp alone there is no shared queue.
func TestSharedQueueGets(t *testing.T) {
	leakcheck.Check(t)
	for _, c := range []struct {
		name, tls   string
		alloc, want bool
	}{
		{"registered", "all", false, true},
		{"allocated", "all", true, false},
		{"registered-tcp", "tcp", false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Whatever UCX_TLS the environment has ("all" is UCX's
			// default, shared memory included).
			t.Setenv("UCX_TLS", c.tls)
			p := newPair(t, c.alloc)
			require.Equal(t, c.want, p.cons.SharedQueueGets(p.peer))
			require.False(t, p.cons.SharedQueueGets("nobody"))
			var _ nixl.SharedQueueGetter = p.cons
		})
	}
}

// A restarted peer's metadata is loaded beside the old peer: the old one
// keeps working until Commit, and Abort leaves it as it was.
func TestStageRemoteMetadata(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t) // the restarted producer answers gets without progressing
	p := newPair(t, true)
	read := func(remote nixl.DlistID, seed uint64) error {
		t.Helper()
		clear(p.consBuf[:testBlock])
		id, err := p.cons.MakeXfer(nixl.Read, p.local, []int{0}, remote, []int{3}, nil)
		if err != nil {
			return err
		}
		defer p.cons.ReleaseXfer(id)
		if err := p.cons.PostXfer(id); err != nil {
			return err
		}
		if err := waitXfer(t, p.cons, id, 5*time.Second, p.prod); err != nil {
			return err
		}
		require.Equal(t, -1, checkBlock(p.consBuf[:testBlock], seed, 3))
		return nil
	}
	oldMD, err := p.prod.LocalMetadata()
	require.NoError(t, err)
	_, err = p.cons.StageRemoteMetadata(oldMD)
	require.ErrorIs(t, err, nixl.ErrInvalidParam, "the metadata the peer was loaded from")
	other := newTestAgent(t, Config{Name: "stranger"})
	omd, err := other.LocalMetadata()
	require.NoError(t, err)
	_, err = p.cons.StageRemoteMetadata(omd)
	require.ErrorIs(t, err, nixl.ErrNotFound, "no peer of that name is loaded")
	_, err = p.cons.StageRemoteMetadata([]byte("junk"))
	require.ErrorIs(t, err, nixl.ErrInvalidParam)

	// The producer restarts under the same name with other memory.
	restarted := newTestAgent(t, Config{Name: "producer"})
	_, buf, err := restarted.AllocMem(testBlock*testBlocks, nixl.DRAM, 0)
	require.NoError(t, err)
	fillBlocks(buf, testBlock, 9)
	md, err := restarted.LocalMetadata()
	require.NoError(t, err)
	fds := fdCount(t)

	// Aborted: a list of the old memory does not fit the new peer, and
	// the old peer still reads.
	s, err := p.cons.StageRemoteMetadata(md)
	require.NoError(t, err)
	require.Equal(t, "producer", s.Name())
	require.False(t, s.SharedQueueGets(), "engine-allocated memory")
	_, err = s.PrepDlist(descriptors.BuildBlockDescs(addrOf(p.prodBuf), testBlocks, testBlock, 0), nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	newDescs := descriptors.BuildBlockDescs(addrOf(buf), testBlocks, testBlock, 0)
	staleID, err := s.PrepDlist(newDescs, nixl.DRAM)
	require.NoError(t, err)
	s.Abort()
	s.Commit() // after Abort: nothing
	require.NoError(t, read(p.remote, 7), "the old peer after an aborted stage")
	_, err = p.cons.MakeXfer(nixl.Read, p.local, []int{0}, staleID, []int{0}, nil)
	require.Error(t, err, "a list prepared on an aborted stage")
	require.NoError(t, p.cons.ReleaseDlist(staleID))
	require.Equal(t, fds, fdCount(t), "an aborted stage leaves no descriptor")
	_, err = s.PrepDlist(newDescs, nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrNotAllowed, "PrepDlist after the stage ended")

	// Committed: the old peer's lists stop working, the new peer reads
	// the restarted producer's memory, and loading its metadata again is
	// a no-op under the same name.
	s, err = p.cons.StageRemoteMetadata(md)
	require.NoError(t, err)
	newID, err := s.PrepDlist(newDescs, nixl.DRAM)
	require.NoError(t, err)
	require.NoError(t, read(p.remote, 7), "the old peer until Commit")
	s.Commit()
	s.Abort() // after Commit: nothing
	require.Error(t, read(p.remote, 7), "the old peer's list after Commit")
	require.NoError(t, read(newID, 9))
	name, err := p.cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	require.Equal(t, "producer", name)
	_, err = p.cons.LoadRemoteMetadata(oldMD)
	require.ErrorIs(t, err, nixl.ErrNotAllowed, "the old metadata is the other one now")
	require.NoError(t, p.cons.ReleaseDlist(newID))
}
