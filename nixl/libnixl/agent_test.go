package libnixl

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// needNIXL skips the test unless the library loads.
func needNIXL(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv(RequireEnv) == "1" {
			t.Fatalf("%s=1 but the NIXL engine is not usable: %v", RequireEnv, err)
		}
		t.Skipf("NIXL engine not available: %v", err)
	}
}

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

var agentSeq int

func testName(prefix string) string {
	agentSeq++
	return fmt.Sprintf("%s-%d-%d", prefix, os.Getpid(), agentSeq)
}

// side is one agent with a block region and its local list.
type side struct {
	a     *Agent
	buf   []byte
	bs    int
	descs descriptors.List
	local nixl.DlistID
}

func newSide(t *testing.T, name string, bs, nb int) *side {
	t.Helper()
	a, err := New(Config{Name: name})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	_, buf, err := a.AllocMem(bs*nb, nixl.DRAM, 0)
	require.NoError(t, err)
	base := uint64(uintptr(unsafePointer(buf)))
	s := &side{a: a, buf: buf, bs: bs, descs: descriptors.BuildBlockDescs(base, nb, uint64(bs), 0)}
	s.local, err = a.PrepDlist("", s.descs, nixl.DRAM)
	require.NoError(t, err)
	return s
}

func (s *side) block(i int) []byte { return s.buf[i*s.bs : (i+1)*s.bs] }

// connect loads p's metadata into s and prepares p's block list.
func (s *side) connect(t *testing.T, p *side) (string, nixl.DlistID) {
	t.Helper()
	md, err := p.a.LocalMetadata()
	require.NoError(t, err)
	name, err := s.a.LoadRemoteMetadata(md)
	require.NoError(t, err)
	require.Equal(t, p.a.Name(), name)
	dl, err := s.a.PrepDlist(name, p.descs, nixl.DRAM)
	require.NoError(t, err)
	return name, dl
}

// pump drives every agent once, as a reactor turn would, and collects
// completions and notifications.
type pump struct {
	agents []*Agent
	comps  map[nixl.XferID]error
	notifs map[*Agent]map[string][][]byte
}

func newPump(agents ...*Agent) *pump {
	p := &pump{agents: agents, comps: map[nixl.XferID]error{}, notifs: map[*Agent]map[string][][]byte{}}
	for _, a := range agents {
		p.notifs[a] = map[string][][]byte{}
	}
	return p
}

func (p *pump) turn() {
	var buf [64]nixl.Completion
	for _, a := range p.agents {
		_, _ = a.Progress()
		n := a.PollCompletions(buf[:])
		for _, c := range buf[:n] {
			if _, dup := p.comps[c.ID]; dup {
				panic(fmt.Sprintf("completion %d reported twice", c.ID))
			}
			p.comps[c.ID] = c.Err
		}
		a.GetNotifs(p.notifs[a])
	}
}

func (p *pump) until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		p.turn()
	}
}

func (p *pump) done(id nixl.XferID) func() bool {
	return func() bool { _, ok := p.comps[id]; return ok }
}

func TestAgentRead(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	const bs, nb = 5120, 1000
	prod := newSide(t, testName("prod"), bs, nb)
	cons := newSide(t, testName("cons"), bs, nb)
	rand.New(rand.NewSource(1)).Read(prod.buf)
	pname, rdl := cons.connect(t, prod)
	pm := newPump(cons.a, prod.a)

	rng := rand.New(rand.NewSource(2))
	for _, n := range []int{1, 17, 880} {
		local, remote := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
		clear(cons.buf)
		msg := []byte(fmt.Sprintf("session:%d", n))
		id, err := cons.a.MakeXfer(nixl.Read, cons.local, local, rdl, remote, msg)
		require.NoError(t, err)
		require.NoError(t, cons.a.PostXfer(id))
		pm.until(t, "the read", pm.done(id))
		require.NoError(t, pm.comps[id])
		for i := range local {
			require.True(t, bytes.Equal(cons.block(local[i]), prod.block(remote[i])), "block %d", i)
		}
		pm.until(t, "the notification", func() bool { return len(pm.notifs[prod.a][cons.a.Name()]) > 0 })
		require.Equal(t, [][]byte{msg}, pm.notifs[prod.a][cons.a.Name()])
		delete(pm.notifs[prod.a], cons.a.Name())
		done, err := cons.a.XferStatus(id)
		require.True(t, done)
		require.NoError(t, err)
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	// Exactly once.
	for i := 0; i < 200; i++ {
		pm.turn()
	}
	require.Empty(t, pm.notifs[prod.a])
	require.NoError(t, cons.a.SendNotif(pname, []byte("direct")))
	pm.until(t, "a direct notification", func() bool { return len(pm.notifs[prod.a][cons.a.Name()]) > 0 })
	require.Equal(t, [][]byte{[]byte("direct")}, pm.notifs[prod.a][cons.a.Name()])
}

func TestAgentMetadata(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	pn := testName("prod")
	prod := newSide(t, pn, 4096, 8)
	cons := newSide(t, testName("cons"), 4096, 8)
	md, err := prod.a.LocalMetadata()
	require.NoError(t, err)
	pm, err := parseMD(md)
	require.NoError(t, err)
	require.True(t, pm.known, "this NIXL's metadata layout is the one md.go knows")
	require.Equal(t, []nixl.Span{{Addr: prod.descs[0].Addr, Len: 8 * 4096}}, pm.regions)

	for _, bad := range [][]byte{nil, {}, []byte("garbage"), md[:len(md)/2], md[:len(md)-1]} {
		_, err := cons.a.LoadRemoteMetadata(bad)
		require.Error(t, err)
	}
	_, err = cons.a.LoadRemoteMetadata(md)
	require.NoError(t, err, "failed loads left nothing behind")
	name, err := cons.a.LoadRemoteMetadata(md)
	require.NoError(t, err)
	require.Equal(t, pn, name)
	own, err := cons.a.LocalMetadata()
	require.NoError(t, err)
	_, err = cons.a.LoadRemoteMetadata(own)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)

	// Out of the advertised regions.
	_, err = cons.a.PrepDlist(pn, descriptors.BuildBlockDescs(prod.descs[0].Addr, 9, 4096, 0), nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = cons.a.PrepDlist("nobody", prod.descs, nixl.DRAM)
	require.ErrorIs(t, err, nixl.ErrNotFound)

	// A restarted producer: same name, new metadata.
	require.NoError(t, prod.a.Close())
	prod2 := newSide(t, pn, 4096, 8)
	md2, err := prod2.a.LocalMetadata()
	require.NoError(t, err)
	name, err = cons.a.LoadRemoteMetadata(md2)
	require.ErrorIs(t, err, nixl.ErrNotAllowed)
	require.Equal(t, pn, name, "the refusal names the peer")
	require.NoError(t, cons.a.InvalidateRemoteMetadata(pn))
	require.ErrorIs(t, cons.a.InvalidateRemoteMetadata(pn), nixl.ErrNotFound)
	name, err = cons.a.LoadRemoteMetadata(md2)
	require.NoError(t, err)
	require.Equal(t, pn, name)

	rand.New(rand.NewSource(3)).Read(prod2.buf)
	rdl, err := cons.a.PrepDlist(pn, prod2.descs, nixl.DRAM)
	require.NoError(t, err)
	id, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0, 1}, rdl, []int{6, 7}, []byte("after restart"))
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(id))
	p := newPump(cons.a, prod2.a)
	p.until(t, "the read", p.done(id))
	require.NoError(t, p.comps[id])
	require.Equal(t, prod2.buf[6*4096:8*4096], cons.buf[:2*4096])
	p.until(t, "the notification", func() bool { return len(p.notifs[prod2.a][cons.a.Name()]) > 0 })
	require.NoError(t, cons.a.ReleaseXfer(id))
}

// Metadata NIXL refuses partway (here: a memory section it does not
// recognise, which md.go leaves to NIXL) leaves nothing behind that would
// make NIXL refuse the same peer's good metadata next.
func TestAgentHalfLoadedMetadata(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	prod := newSide(t, testName("prod"), 4096, 8)
	cons := newSide(t, testName("cons"), 4096, 8)
	md, err := prod.a.LocalMetadata()
	require.NoError(t, err)
	at := bytes.Index(md, []byte("MemSection"))
	require.Positive(t, at)
	bad := bytes.Clone(md)
	bad[at+len("MemSection")-1] = 'X'
	pm, err := parseMD(bad)
	require.NoError(t, err)
	require.False(t, pm.known, "md.go leaves this layout to NIXL")
	_, err = cons.a.LoadRemoteMetadata(bad)
	require.ErrorIs(t, err, nixl.ErrInvalidParam, "malformed, as the engine contract says")
	name, err := cons.a.LoadRemoteMetadata(md)
	require.NoError(t, err, "the good metadata after a refused one")
	require.Equal(t, prod.a.Name(), name)
}

// Metadata whose agent name has a NUL byte is refused: NIXL's C API would
// hand the name back cut at the NUL, the name of another, loaded peer.
func TestAgentNameWithNUL(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	pn := testName("prod")
	prod := newSide(t, pn, 4096, 8)
	other := newSide(t, pn+"_x", 4096, 8) // renamed to pn+"\x00x" below
	cons := newSide(t, testName("cons"), 4096, 8)
	rand.New(rand.NewSource(5)).Read(prod.buf)
	_, rdl := cons.connect(t, prod)

	md, err := other.a.LocalMetadata()
	require.NoError(t, err)
	at := bytes.Index(md, []byte(pn+"_x"))
	require.Positive(t, at)
	bad := bytes.Clone(md)
	bad[at+len(pn)] = 0 // same length: the record stays well formed
	_, err = cons.a.LoadRemoteMetadata(bad)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)

	// The peer it would have hit still reads.
	id, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{3}, nil)
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(id))
	p := newPump(cons.a, prod.a)
	p.until(t, "the read", p.done(id))
	require.NoError(t, p.comps[id])
	require.Equal(t, prod.block(3), cons.block(0))
	require.NoError(t, cons.a.ReleaseXfer(id))
}

func TestAgentBadXfers(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	prod := newSide(t, testName("prod"), 1024, 4)
	cons := newSide(t, testName("cons"), 1024, 4)
	_, rdl := cons.connect(t, prod)
	for _, c := range []struct {
		l, r []int
		want error
	}{
		{[]int{0, 1}, []int{0}, nixl.ErrInvalidParam},
		{[]int{4}, []int{0}, nixl.ErrInvalidParam},
		{[]int{0}, []int{-1}, nixl.ErrInvalidParam},
	} {
		_, err := cons.a.MakeXfer(nixl.Read, cons.local, c.l, rdl, c.r, nil)
		require.ErrorIs(t, err, c.want)
	}
	_, err := cons.a.MakeXfer(nixl.Read, rdl, []int{0}, cons.local, []int{0}, nil)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	_, err = cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{0}, make([]byte, nixl.DefaultMaxNotif+1))
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	id, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{0}, nil)
	require.NoError(t, err)
	done, err := cons.a.XferStatus(id)
	require.False(t, done)
	require.ErrorIs(t, err, nixl.ErrNotPosted)
	mems := cons.a.mems.Sorted()[0].ID
	require.ErrorIs(t, cons.a.DeregisterMem(mems), nixl.ErrNotAllowed)
	require.NoError(t, cons.a.ReleaseXfer(id))
	require.ErrorIs(t, cons.a.ReleaseXfer(id), nixl.ErrNotFound)
}

// bigPair is a producer and a consumer of 512 blocks of 32 KiB, the
// consumer knowing the producer, all blocks in a random order, and a pump
// of both: READs that take long enough to be caught in flight.
func bigPair(t *testing.T, seed int64) (prod, cons *side, pname string, rdl nixl.DlistID, idx []int, pm *pump) {
	t.Helper()
	needNIXL(t)
	const bs, nb = 32768, 512
	prod = newSide(t, testName("prod"), bs, nb)
	cons = newSide(t, testName("cons"), bs, nb)
	pname, rdl = cons.connect(t, prod)
	return prod, cons, pname, rdl, rand.New(rand.NewSource(seed)).Perm(nb), newPump(cons.a, prod.a)
}

// postReads posts n READs of the blocks idx of rdl into the same local
// blocks, each with notif, and returns their ids.
func postReads(t *testing.T, cons *side, rdl nixl.DlistID, idx []int, n int, notif []byte) []nixl.XferID {
	t.Helper()
	var ids []nixl.XferID
	for range n {
		id, err := cons.a.MakeXfer(nixl.Read, cons.local, idx, rdl, idx, notif)
		require.NoError(t, err)
		require.NoError(t, cons.a.PostXfer(id))
		ids = append(ids, id)
	}
	return ids
}

// A READ released in flight keeps running in NIXL until it ends (a
// zombie): the memory it writes into cannot be deregistered, and an
// allocated region not unmapped, until then.
func TestAgentZombieHoldsMemory(t *testing.T) {
	_, cons, _, rdl, idx, pm := bigPair(t, 6)
	mem := cons.a.mems.Sorted()[0].ID
	for _, id := range postReads(t, cons, rdl, idx, 8, nil) {
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	require.NoError(t, cons.a.ReleaseDlist(cons.local))
	if len(cons.a.zombies) == 0 {
		t.Skip("every READ of 16 MiB ended before its release")
	}
	require.ErrorIs(t, cons.a.DeregisterMem(mem), nixl.ErrNotAllowed, "released READs still running into it")
	pm.until(t, "the released READs", func() bool { return len(cons.a.zombies) == 0 })
	require.NoError(t, cons.a.DeregisterMem(mem))
}

// A READ into local blocks that a released READ still running in NIXL may
// write is held, in flight with nothing posted, until that one has ended:
// NIXL cannot cancel it, and its late data would land on the new READ's
// (which used to end DONE and then be overwritten). READs into other
// blocks go out at once.
func TestAgentZombieFencesLocalBlocks(t *testing.T) {
	_, cons, _, rdl, idx, pm := bigPair(t, 7)
	half := len(idx) / 2
	for _, id := range postReads(t, cons, rdl, idx[:half], 8, nil) {
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	if len(cons.a.zombies) == 0 {
		t.Skip("every READ of 8 MiB ended before its release")
	}
	same, err := cons.a.MakeXfer(nixl.Read, cons.local, idx[half-1:half], rdl, idx[:1], []byte("held"))
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(same))
	require.Len(t, cons.a.held, 1, "posted into blocks a released READ may still write")
	require.Nil(t, cons.a.xfers[same].req)
	done, err := cons.a.XferStatus(same)
	require.NoError(t, err)
	require.False(t, done)
	other, err := cons.a.MakeXfer(nixl.Read, cons.local, idx[half:half+1], rdl, idx[:1], nil)
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(other))
	require.Len(t, cons.a.held, 1, "held a READ of blocks no released READ writes")
	for _, id := range []nixl.XferID{same, other} {
		pm.until(t, "a READ", pm.done(id))
		require.NoError(t, pm.comps[id])
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	require.Empty(t, cons.a.zombies, "the held READ ended before the released READs it waited for")
	require.Empty(t, cons.a.held)

	// A held READ can be released, and then never goes out.
	for _, id := range postReads(t, cons, rdl, idx[:half], 8, nil) {
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	if len(cons.a.zombies) == 0 {
		return
	}
	again, err := cons.a.MakeXfer(nixl.Read, cons.local, idx[:1], rdl, idx[:1], nil)
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(again))
	require.Len(t, cons.a.held, 1)
	require.NoError(t, cons.a.ReleaseXfer(again))
	pm.until(t, "the released READs", func() bool { return len(cons.a.zombies) == 0 })
	require.Empty(t, cons.a.held)
	require.NotContains(t, pm.comps, again)
}

func TestAgentCancelAndInvalidate(t *testing.T) {
	prod, cons, pname, rdl, idx, pm := bigPair(t, 4)

	// Released while in flight: never reported, no notification.
	ids := postReads(t, cons, rdl, idx, 8, []byte("canceled"))
	for _, id := range ids {
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	for i := 0; i < 500; i++ {
		pm.turn()
	}
	for _, id := range ids {
		require.NotContains(t, pm.comps, id)
	}
	require.Empty(t, cons.a.inflight)
	require.Empty(t, cons.a.zombies)

	// Invalidated while in flight: ErrRemoteDisconnect (or done, if it
	// finished first).
	ids = postReads(t, cons, rdl, idx, 8, nil)
	require.NoError(t, cons.a.InvalidateRemoteMetadata(pname))
	for _, id := range ids {
		pm.until(t, "the end of an invalidated read", pm.done(id))
		if err := pm.comps[id]; err != nil {
			require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
		}
		require.NoError(t, cons.a.ReleaseXfer(id))
	}
	_, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{0}, nil)
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	require.NoError(t, cons.a.ReleaseDlist(rdl))
	// The abandoned requests run to their end (the producer must progress
	// for that), then NIXL forgets the peer.
	require.NotEmpty(t, cons.a.draining)
	pm.until(t, "the abandoned requests", func() bool { return len(cons.a.zombies) == 0 })
	require.Empty(t, cons.a.draining)
	// The agent still works: load the peer again and read.
	_, rdl = cons.connect(t, prod)
	id, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{1}, nil)
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(id))
	pm.until(t, "a read after reloading", pm.done(id))
	require.NoError(t, pm.comps[id])
}

func TestAgentClosed(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	a, err := New(Config{Name: testName("c")})
	require.NoError(t, err)
	require.NoError(t, a.Close())
	require.NoError(t, a.Close())
	_, err = a.LocalMetadata()
	require.ErrorIs(t, err, nixl.ErrNotAllowed)
	_, _, err = a.AllocMem(10, nixl.DRAM, 0)
	require.ErrorIs(t, err, nixl.ErrNotAllowed)
	require.Equal(t, -1, a.EventFD())
}

// A message longer than the shim's cap (MaxNotif's limit; lowered here so
// that a sender within its own MaxNotif can exceed it) is dropped by the
// shim as NIXL hands it over, uncopied, and counted in DroppedNotifs; the
// messages around it arrive in order. Before, the shim copied any length
// (a multi-GiB one twice, its length cut to 32 bits in the record) and
// the agent grew its C buffer to whatever the shim asked.
func TestAgentOversizedNotifDroppedByShim(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	defer func(v int) { shimMaxNotif = v }(shimMaxNotif)
	shimMaxNotif = 1000
	prod := newSide(t, testName("big-prod"), 4096, 4)
	cons := newSide(t, testName("big-cons"), 4096, 4)
	pname, rdl := cons.connect(t, prod)
	cname, _ := prod.connect(t, cons)
	pm := newPump(cons.a, prod.a)
	at, over := bytes.Repeat([]byte{'a'}, 1000), bytes.Repeat([]byte{'o'}, 1001)
	huge := bytes.Repeat([]byte{'h'}, 60<<10) // within MaxNotif, beyond the first buffer and the cap
	base := prod.a.DroppedNotifs()
	for _, m := range [][]byte{[]byte("first"), over, at, huge, []byte("last")} {
		require.NoError(t, cons.a.SendNotif(pname, m))
	}
	pm.until(t, "the last notification", func() bool {
		got := pm.notifs[prod.a][cname]
		return len(got) > 0 && string(got[len(got)-1]) == "last"
	})
	require.Equal(t, [][]byte{[]byte("first"), at, []byte("last")}, pm.notifs[prod.a][cname])
	require.Equal(t, base+2, prod.a.DroppedNotifs(), "the two over the cap are counted dropped")
	require.Equal(t, firstBuf, prod.a.ncap, "the agent's buffer never grew for them")

	// A READ's notification over the cap goes the same way; the READ itself completes.
	id, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{1}, over)
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(id))
	pm.until(t, "the read", pm.done(id))
	require.NoError(t, pm.comps[id])
	require.NoError(t, cons.a.ReleaseXfer(id))
	require.NoError(t, cons.a.SendNotif(pname, []byte("after")))
	pm.until(t, "the notification after it", func() bool {
		got := pm.notifs[prod.a][cname]
		return string(got[len(got)-1]) == "after"
	})
	require.Equal(t, base+3, prod.a.DroppedNotifs())
	require.Len(t, pm.notifs[prod.a][cname], 4, "the READ's notification was not delivered")
}

// A peer NIXL invalidated on its own (as it does when a transfer finds the
// peer disconnected) is marked gone by the first request that NIXL then
// answers NOT_FOUND: loading its metadata again is refused with
// ErrNotAllowed and its name, so the caller invalidates it and loads it
// anew, after which READs work. Before, the same blob loaded again
// "succeeded" and changed nothing, and every READ kept failing.
func TestAgentPeerInvalidatedByNIXLIsGone(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	prod := newSide(t, testName("gone-prod"), 4096, 8)
	cons := newSide(t, testName("gone-cons"), 4096, 8)
	pname, rdl := cons.connect(t, prod)
	pm := newPump(cons.a, prod.a)
	require.NoError(t, cons.a.forget(pname, true)) // NIXL forgets it; the agent still knows it
	id, err := cons.a.MakeXfer(nixl.Read, cons.local, []int{0}, rdl, []int{0}, nil)
	require.NoError(t, err)
	err = cons.a.PostXfer(id)
	if err == nil {
		pm.until(t, "the READ", pm.done(id))
		err = pm.comps[id]
	}
	require.ErrorIs(t, err, nixl.ErrRemoteDisconnect)
	require.NoError(t, cons.a.ReleaseXfer(id))
	md, err := prod.a.LocalMetadata()
	require.NoError(t, err)
	name, err := cons.a.LoadRemoteMetadata(md)
	require.ErrorIs(t, err, nixl.ErrNotAllowed, "the same blob again: the peer is gone")
	require.Equal(t, pname, name)
	require.NoError(t, cons.a.ReleaseDlist(rdl))
	require.NoError(t, cons.a.InvalidateRemoteMetadata(pname))
	pname2, rdl2 := cons.connect(t, prod)
	require.Equal(t, pname, pname2)
	rng := rand.New(rand.NewSource(5))
	rng.Read(prod.buf)
	id, err = cons.a.MakeXfer(nixl.Read, cons.local, []int{1}, rdl2, []int{2}, nil)
	require.NoError(t, err)
	require.NoError(t, cons.a.PostXfer(id))
	pm.until(t, "the READ after the reload", pm.done(id))
	require.NoError(t, pm.comps[id])
	require.Equal(t, prod.block(2), cons.block(1))
	require.NoError(t, cons.a.ReleaseXfer(id))
}

// Metadata whose UCX worker address is of another format than this
// UCX's (garbage, or another UCX) is refused with ErrInvalidParam before
// NIXL sees it: UCX asserts on such an address, which aborted the
// process inside LoadRemoteMetadata.
func TestAgentWorkerAddressOfAnotherFormat(t *testing.T) {
	leakcheck.Check(t)
	needNIXL(t)
	prod := newSide(t, testName("fmt-prod"), 4096, 8)
	cons := newSide(t, testName("fmt-cons"), 4096, 8)
	md, err := prod.a.LocalMetadata()
	require.NoError(t, err)
	r := &mdReader{b: md, off: len(mdMagic)}
	_, err = r.record("Agent")
	require.NoError(t, err)
	conns, err := r.count("Conns")
	require.NoError(t, err)
	require.NotZero(t, conns)
	_, err = r.record("t")
	require.NoError(t, err)
	at := r.off + len("c") + 8 // the address's first byte
	bad := bytes.Clone(md)
	bad[at] ^= 0x0f
	_, err = cons.a.LoadRemoteMetadata(bad)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.ErrorContains(t, err, "format")
	// The same address in metadata whose layout after it is not this
	// NIXL's (another release's): the address is checked all the same.
	// (NIXL connects to the address before it reads the rest, and UCX
	// aborted the process on it.)
	ms := bytes.Index(bad, []byte("MemSection"))
	require.Positive(t, ms)
	other := bytes.Clone(bad)
	other[ms+len("MemSection")-1] = 'X'
	pm, err := parseMD(other)
	require.NoError(t, err)
	require.False(t, pm.known)
	_, err = cons.a.LoadRemoteMetadata(other)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.ErrorContains(t, err, "format")
	name, err := cons.a.LoadRemoteMetadata(md) // the real one still loads
	require.NoError(t, err)
	require.Equal(t, prod.a.Name(), name)
}
