package ucx

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// fenceRig is a consumer with one registered region and two producers of
// caller memory (their gets are emulated: answered only when they
// progress), each filled with its own pattern.
type fenceRig struct {
	cons   *Agent
	buf    []byte
	local  nixl.DlistID
	prod   [2]*Agent
	remote [2]nixl.DlistID
	seeds  [2]uint64
	mem    nixl.MemID
}

func newFenceRig(t *testing.T, mode ErrMode) *fenceRig {
	t.Helper()
	r := &fenceRig{seeds: [2]uint64{7, 9}}
	r.cons = newTestAgent(t, Config{Name: "consumer", ErrMode: mode})
	n := testBlock * testBlocks
	r.buf = mmapBuf(t, n)
	var err error
	r.mem, err = r.cons.RegisterMem(r.buf, nixl.DRAM, 0)
	require.NoError(t, err)
	r.local, err = r.cons.PrepDlist("", descriptors.BuildBlockDescs(addrOf(r.buf), testBlocks, testBlock, 0), nixl.DRAM)
	require.NoError(t, err)
	for i, name := range []string{"old", "new"} {
		r.prod[i] = newTestAgent(t, Config{Name: name, ErrMode: mode})
		pb := mmapBuf(t, n)
		_, err := r.prod[i].RegisterMem(pb, nixl.DRAM, 0)
		require.NoError(t, err)
		fillBlocks(pb, testBlock, r.seeds[i])
		md, err := r.prod[i].LocalMetadata()
		require.NoError(t, err)
		peer, err := r.cons.LoadRemoteMetadata(md)
		require.NoError(t, err)
		r.remote[i], err = r.cons.PrepDlist(peer, descriptors.BuildBlockDescs(addrOf(pb), testBlocks, testBlock, 0), nixl.DRAM)
		require.NoError(t, err)
	}
	return r
}

func (r *fenceRig) post(t *testing.T, prod int, local, remote []int) nixl.XferID {
	t.Helper()
	id, err := r.cons.MakeXfer(nixl.Read, r.local, local, r.remote[prod], remote, nil)
	require.NoError(t, err)
	require.NoError(t, r.cons.PostXfer(id))
	return id
}

// orphan posts a READ of the old producer into local and releases it with
// its gets outstanding (the old producer does not progress).
func (r *fenceRig) orphan(t *testing.T, local, remote []int) {
	t.Helper()
	id := r.post(t, 0, local, remote)
	for range 10 {
		r.cons.Progress() // the gets leave; nobody answers them yet
	}
	require.NoError(t, r.cons.ReleaseXfer(id))
	require.Positive(t, int(r.cons.c.nlive), "the gets are outstanding (else this tests nothing)")
	require.Len(t, r.cons.fences, 1)
}

// progress runs the consumer and the producers marked true for d, or until
// every READ of ids is done.
func (r *fenceRig) progress(t *testing.T, d time.Duration, prods [2]bool, ids ...nixl.XferID) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		r.cons.Progress()
		for i, on := range prods {
			if on {
				r.prod[i].Progress()
			}
		}
		done := len(ids) > 0
		for _, id := range ids {
			ok, err := r.cons.XferStatus(id)
			require.NoError(t, err)
			done = done && ok
		}
		if done {
			return
		}
	}
}

func (r *fenceRig) verify(t *testing.T, prod int, local, remote []int) {
	t.Helper()
	for k, l := range local {
		require.Equal(t, -1, checkBlock(r.buf[l*testBlock:(l+1)*testBlock], r.seeds[prod], remote[k]),
			"local block %d should hold block %d of producer %d", l, remote[k], prod)
	}
}

// A READ into local blocks that a released READ's outstanding gets may
// still write is held until those gets have called back: the late reply
// lands first and the new READ's bytes stay. READs into other blocks are
// not held. (Before, the new READ completed at once and the old peer's
// late reply then overwrote its blocks.)
func TestFencedLocalBlocks(t *testing.T) {
	leakcheck.Check(t)
	forFenceModes(t, func(t *testing.T, r *fenceRig, _ bool) { testFencedLocalBlocks(t, r) })
}

// forFenceModes runs test on a rig with the default transports (same
// host, error mode NONE) and on one over tcp in error mode PEER (the mode
// of peers on other hosts).
func forFenceModes(t *testing.T, test func(t *testing.T, r *fenceRig, peerMode bool)) {
	for _, tc := range []struct {
		name, tls string
		mode      ErrMode
	}{{"default", "", ErrModeAuto}, {"tcp/peer-mode", "tcp", ErrModePeer}} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.tls != "" {
				t.Setenv("UCX_TLS", tc.tls)
			}
			test(t, newFenceRig(t, tc.mode), tc.mode == ErrModePeer)
		})
	}
}

func testFencedLocalBlocks(t *testing.T, r *fenceRig) {
	require.False(t, r.cons.Fencing())
	r.orphan(t, []int{0, 1, 2, 3}, []int{0, 1, 2, 3})
	// What other goroutines see (nixl.LocalFencer): fenced at once; the
	// ranges once the engine has progressed.
	base := uint64(addrOf(r.buf))
	blk := func(i int) uint64 { return base + uint64(i*testBlock) }
	require.True(t, r.cons.Fencing())
	require.True(t, r.cons.Fenced(blk(2), testBlock))
	r.cons.Progress()
	require.True(t, r.cons.Fenced(blk(2), testBlock))
	require.True(t, r.cons.Fenced(blk(4)-1, 1), "the last byte of block 3")
	require.True(t, r.cons.Fenced(blk(0)-1, 2), "a range ending in block 0")
	require.True(t, r.cons.Fenced(blk(1), ^uint64(0)), "a range running to the end of memory")
	require.False(t, r.cons.Fenced(blk(4), testBlock))
	require.False(t, r.cons.Fenced(blk(0)-1, 1))
	require.False(t, r.cons.Fenced(blk(2), 0), "an empty range")

	held := r.post(t, 1, []int{2, 3, 4, 5}, []int{10, 11, 12, 13})
	free := r.post(t, 1, []int{8, 9}, []int{20, 21})
	r.progress(t, 10*time.Second, [2]bool{false, true}, free)
	ok, err := r.cons.XferStatus(free)
	require.NoError(t, err)
	require.True(t, ok, "a READ into unfenced blocks is not held")
	r.verify(t, 1, []int{8, 9}, []int{20, 21})
	r.progress(t, 200*time.Millisecond, [2]bool{false, true})
	ok, err = r.cons.XferStatus(held)
	require.NoError(t, err)
	require.False(t, ok, "completed while the old READ's gets were outstanding")

	// The old producer answers; its late reply lands, then the held READ
	// goes out and completes over it.
	r.progress(t, 10*time.Second, [2]bool{true, true}, held)
	ok, err = r.cons.XferStatus(held)
	require.NoError(t, err)
	require.True(t, ok)
	for deadline := time.Now().Add(10 * time.Second); r.cons.c.nlive > 0 && time.Now().Before(deadline); {
		r.progress(t, time.Millisecond, [2]bool{true, true})
	}
	require.Zero(t, int(r.cons.c.nlive), "the old READ's gets never called back")
	require.Empty(t, r.cons.fences)
	require.Empty(t, r.cons.held)
	require.False(t, r.cons.Fencing())
	require.False(t, r.cons.Fenced(blk(2), testBlock))
	r.verify(t, 1, []int{2, 3, 4, 5}, []int{10, 11, 12, 13})
	require.NoError(t, r.cons.ReleaseXfer(held))
	require.NoError(t, r.cons.ReleaseXfer(free))
}

// A held READ that is released is forgotten; one of the peer whose orphan
// fences its blocks ends with that peer's error when the peer is removed.
// The fence stays until the orphan's gets have called back: a removed
// same-host peer that is alive still answers them (here it progresses); a
// peer on another host (mode PEER) has its endpoint closed and UCX ends
// them. READs into those blocks then go out again.
func TestFenceReleaseAndRemoval(t *testing.T) {
	leakcheck.Check(t)
	forFenceModes(t, testFenceReleaseAndRemoval)
}

func testFenceReleaseAndRemoval(t *testing.T, r *fenceRig, peerMode bool) {
	r.orphan(t, []int{0, 1}, []int{0, 1})

	released := r.post(t, 1, []int{0}, []int{5})
	require.Len(t, r.cons.held, 1)
	require.NoError(t, r.cons.ReleaseXfer(released))
	require.Empty(t, r.cons.held)

	mine := r.post(t, 0, []int{1}, []int{6})
	require.Len(t, r.cons.held, 1)
	require.NoError(t, r.cons.InvalidateRemoteMetadata("old"))
	require.Empty(t, r.cons.held)
	if !peerMode {
		require.NotEmpty(t, r.cons.fences, "lifted while the old READ's gets may still land")
	}
	for deadline := time.Now().Add(10 * time.Second); len(r.cons.fences) > 0 && time.Now().Before(deadline); {
		r.progress(t, time.Millisecond, [2]bool{!peerMode, true})
	}
	require.Empty(t, r.cons.fences, "the fence outlived the old READ's gets")
	ok, err := r.cons.XferStatus(mine)
	require.True(t, ok)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	require.NoError(t, r.cons.ReleaseXfer(mine))

	after := r.post(t, 1, []int{0, 1}, []int{6, 7})
	require.Empty(t, r.cons.held)
	r.progress(t, 10*time.Second, [2]bool{false, true}, after)
	ok, err = r.cons.XferStatus(after)
	require.NoError(t, err)
	require.True(t, ok)
	r.verify(t, 1, []int{0, 1}, []int{6, 7})
	require.NoError(t, r.cons.ReleaseXfer(after))
}

// A same-host producer dies with a released READ's emulated gets
// unanswered: once its process is gone its fence is lifted, and the READ
// held behind it ends with the peer. Over shared memory without cma those
// gets never call back (the endpoint, error mode NONE, cannot be
// force-closed), so without the lift those local blocks could never be
// read into again. (Over tcp alone the broken connection ends them, but
// killing a same-host tcp peer can trip UCX 1.13's wire-up assertion:
// README, "Failure behaviour".) "removed": the peer is removed first and
// dies later, with no other same-host peer left and nobody arming the
// agent (a spinning reactor only calls Progress): the lift still comes.
func TestFenceLiftedWhenPeerDies(t *testing.T) {
	for _, removed := range []bool{false, true} {
		t.Run(map[bool]string{false: "loaded", true: "removed"}[removed], func(t *testing.T) {
			testFenceLiftedWhenPeerDies(t, removed)
		})
	}
}

func testFenceLiftedWhenPeerDies(t *testing.T, removed bool) {
	leakcheck.Check(t)
	const tls = "posix,sysv"
	t.Setenv("UCX_TLS", tls)
	ch := startChild(t, childOpts{name: "prod", seed: 5, tls: tls})
	c := newConsumer(t, Config{Name: "cons"}, testBlocks, testBlock)
	c.connect(t, ch)
	ch.command('S', nil, c.a) // the producer stops progressing
	id, err := c.a.MakeXfer(nixl.Read, c.local, []int{0, 1}, c.remote, []int{0, 1}, nil)
	require.NoError(t, err)
	require.NoError(t, c.a.PostXfer(id))
	for range 10 {
		c.a.Progress()
	}
	require.NoError(t, c.a.ReleaseXfer(id))
	require.Len(t, c.a.fences, 1, "the gets are outstanding (else this tests nothing)")
	held, err := c.a.MakeXfer(nixl.Read, c.local, []int{1}, c.remote, []int{3}, nil)
	require.NoError(t, err)
	require.NoError(t, c.a.PostXfer(held))
	require.Len(t, c.a.held, 1)
	if removed {
		require.NoError(t, c.a.InvalidateRemoteMetadata("prod"))
		require.Empty(t, c.a.held, "the removal ends the READ held behind the fence")
		require.Empty(t, c.a.pidPeers)
		require.Len(t, c.a.gone, 1, "the removed peer's process is not watched")
		require.False(t, c.a.checkPids())
		require.Len(t, c.a.fences, 1, "lifted while the producer lives and its gets may land")
	}

	ch.kill()
	for deadline := time.Now().Add(10 * time.Second); len(c.a.fences) > 0 && time.Now().Before(deadline); {
		c.a.Progress()
		time.Sleep(time.Millisecond)
	}
	require.Empty(t, c.a.fences, "the dead producer's fence was not lifted")
	require.Empty(t, c.a.gone)
	require.Empty(t, c.a.held)
	ok, err := c.a.XferStatus(held)
	require.True(t, ok)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	require.NoError(t, c.a.ReleaseXfer(held))
}

// A READ held behind a fence is posted when the fence lifts, without the
// poll of pidfds PostXfer does first: when its same-host producer died
// meanwhile, its gets copied what the dead process left in its segment
// and the READ ended DONE. Its pidfd is now polled when it ends.
func TestHeldReadOfDeadPeerFails(t *testing.T) {
	leakcheck.Check(t)
	const tls = "posix,sysv" // no cma: gets of the fencing peer's memory are emulated
	t.Setenv("UCX_TLS", tls)
	fencer := startChild(t, childOpts{name: "fencer", seed: 5, tls: tls})
	dying := startChild(t, childOpts{name: "dying", seed: 6, tls: tls, alloc: true})
	// Progress never polls pidfds on its own here: only the fix can see
	// the death before the READ ends.
	c := newConsumer(t, Config{Name: "cons", LivenessPoll: time.Hour}, testBlocks, testBlock)
	c.connect(t, fencer)
	m, err := decodeMetadata(dying.md)
	require.NoError(t, err)
	dname, err := c.a.LoadRemoteMetadata(dying.md)
	require.NoError(t, err)
	dremote, err := c.a.PrepDlist(dname, descriptors.BuildBlockDescs(m.Region[0].Addr, testBlocks, testBlock, 0), nixl.DRAM)
	require.NoError(t, err)

	fencer.command('S', nil, c.a) // stops progressing: its gets stay outstanding
	id, err := c.a.MakeXfer(nixl.Read, c.local, []int{0}, c.remote, []int{0}, nil)
	require.NoError(t, err)
	require.NoError(t, c.a.PostXfer(id))
	for range 10 {
		c.a.Progress()
	}
	require.NoError(t, c.a.ReleaseXfer(id))
	require.Len(t, c.a.fences, 1, "the gets are outstanding (else this tests nothing)")

	held, err := c.a.MakeXfer(nixl.Read, c.local, []int{0}, dremote, []int{2}, nil)
	require.NoError(t, err)
	require.NoError(t, c.a.PostXfer(held))
	require.Len(t, c.a.held, 1)
	dying.kill() // reaped: its pidfd is readable

	fencer.command('R', nil, c.a) // answers the gets: the fence lifts, the held READ goes out
	var done bool
	for deadline := time.Now().Add(10 * time.Second); !done && time.Now().Before(deadline); {
		c.a.Progress()
		done, err = c.a.XferStatus(held)
	}
	require.True(t, done, "the held READ did not end")
	require.Empty(t, c.a.fences)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect, "DONE from a producer that died before its gets went out")
	require.NoError(t, c.a.ReleaseXfer(held))
}
