package enginekit

import (
	"errors"
	"strings"
	"testing"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

func TestCompletionsPollAndCompact(t *testing.T) {
	var c Completions
	gens := map[nixl.XferID]uint64{1: 1, 2: 2, 3: 1}
	live := func(id nixl.XferID, gen uint64) bool { return gens[id] == gen }
	c.Push(1, 1, nil)
	c.Push(2, 1, nil) // reposted since: stale
	c.Push(3, 1, nixl.ErrCanceled)
	c.Push(2, 2, nil)

	dst := make([]nixl.Completion, 2)
	if n := c.Poll(dst, live); n != 2 || dst[0].ID != 1 || dst[1].ID != 3 || !errors.Is(dst[1].Err, nixl.ErrCanceled) {
		t.Fatalf("first poll: %d %+v", n, dst)
	}
	if c.Len() != 1 {
		t.Fatalf("left %d, want 1", c.Len())
	}
	if n := c.Poll(dst, live); n != 1 || dst[0].ID != 2 {
		t.Fatalf("second poll: %d %+v", n, dst)
	}
	if n := c.Poll(dst, live); n != 0 {
		t.Fatalf("empty poll: %d", n)
	}

	c.Push(1, 0, nil)
	c.Push(1, 1, nil)
	c.Compact(live)
	if c.Len() != 1 {
		t.Fatalf("after compact %d, want 1", c.Len())
	}
	c.Reset()
	if c.Len() != 0 {
		t.Fatal("reset left entries")
	}
}

type testMem struct {
	Region
	tag string
}

func TestRegions(t *testing.T) {
	s := NewRegions[*testMem]("eng")
	a := &testMem{Region: Region{ID: 1, Addr: 0x1000, Len: 0x100}, tag: "a"}
	b := &testMem{Region: Region{ID: 2, Addr: 0x100, Len: 0x10}, tag: "b"}
	s.Add(a)
	if err := s.CheckOverlap(0x10ff, 1); !errors.Is(err, nixl.ErrInvalidParam) || !strings.HasPrefix(err.Error(), "nixl: NIXL_ERR_INVALID_PARAM: eng: ") {
		t.Fatalf("overlap: %v", err)
	}
	if err := s.CheckOverlap(^uint64(0), 2); !errors.Is(err, nixl.ErrInvalidParam) {
		t.Fatalf("wrap: %v", err)
	}
	if err := s.CheckOverlap(b.Addr, b.Len); err != nil {
		t.Fatal(err)
	}
	s.Add(b)
	if got := s.Sorted(); len(got) != 2 || got[0] != b || got[1] != a {
		t.Fatalf("sorted: %v", got)
	}
	if !s.Spans().Contains(0x1000, 0x100) || s.Spans().Contains(0x1000, 0x101) {
		t.Fatal("spans")
	}
	if m, ok := s.At(0x1010, 0x10); !ok || m != a {
		t.Fatal("At inside a")
	}
	if _, ok := s.At(0x10f0, 0x20); ok {
		t.Fatal("At across the end of a")
	}

	ms, bad := s.Covering(descriptors.List{{Addr: 0x1000, Len: 8}, {Addr: 0x100, Len: 8}, {Addr: 0x1008, Len: 8}})
	if bad != -1 || len(ms) != 2 || ms[0] != a || ms[1] != b {
		t.Fatalf("covering: %v %d", ms, bad)
	}
	if _, bad := s.Covering(descriptors.List{{Addr: 0x1000, Len: 8}, {Addr: 0x1000, Len: 0}}); bad != 1 {
		t.Fatalf("zero-length descriptor: bad %d", bad)
	}
	if _, bad := s.Covering(descriptors.List{{Addr: 0x2000, Len: 8}}); bad != 0 {
		t.Fatalf("outside: bad %d", bad)
	}

	AddRefs(ms, 1)
	if _, err := s.Removable(1); !errors.Is(err, nixl.ErrNotAllowed) {
		t.Fatalf("referenced: %v", err)
	}
	AddRefs(ms, -1)
	if _, err := s.Removable(9); !errors.Is(err, nixl.ErrNotFound) {
		t.Fatalf("unknown: %v", err)
	}
	m, err := s.Removable(1)
	if err != nil || m != a {
		t.Fatalf("removable: %v %v", m, err)
	}
	s.Remove(1)
	if _, ok := s.At(0x1000, 1); ok || len(s.Sorted()) != 1 {
		t.Fatal("remove")
	}
	s.Clear()
	if len(s.Sorted()) != 0 || s.Spans().Contains(0x100, 1) {
		t.Fatal("clear")
	}
}

type testPeer struct{ dead error }

func (p *testPeer) Gone() error { return p.dead }

type testDlist struct {
	peer  *testPeer
	valid bool
}

func (d *testDlist) Remote() bool { return d.peer != nil }
func (d *testDlist) Usable() bool { return d.valid && d.peer.dead == nil }

func TestChecks(t *testing.T) {
	const p Prefix = "eng"
	dead := &testPeer{dead: nixl.ErrRemoteDisconnect}
	peers := map[string]*testPeer{"ok": {}, "dead": dead}
	if _, err := LivePeer(p, peers, "nope"); !errors.Is(err, nixl.ErrNotFound) {
		t.Fatal(err)
	}
	if _, err := LivePeer(p, peers, "dead"); err != dead.dead {
		t.Fatal(err)
	}
	if q, err := LivePeer(p, peers, "ok"); err != nil || q != peers["ok"] {
		t.Fatal(err)
	}

	dl := map[nixl.DlistID]*testDlist{
		1: {valid: true}, 2: {peer: peers["ok"], valid: true},
		3: {peer: peers["ok"]}, 4: {peer: dead, valid: true},
	}
	for _, c := range []struct {
		op     nixl.Op
		l, r   nixl.DlistID
		notif  int
		status nixl.Status
	}{
		{nixl.Op(9), 1, 2, 0, nixl.ErrInvalidParam},
		{nixl.Read, 1, 7, 0, nixl.ErrNotFound},
		{nixl.Read, 2, 2, 0, nixl.ErrInvalidParam},
		{nixl.Read, 1, 1, 0, nixl.ErrInvalidParam},
		{nixl.Read, 1, 3, 0, nixl.ErrRemoteDisconnect},
		{nixl.Write, 1, 4, 0, nixl.ErrRemoteDisconnect},
		{nixl.Write, 1, 2, 9, nixl.ErrInvalidParam},
	} {
		if _, _, err := XferLists(p, dl, c.op, c.l, c.r, c.notif, 8); !errors.Is(err, c.status) {
			t.Errorf("%+v: %v", c, err)
		}
	}
	if ld, rd, err := XferLists(p, dl, nixl.Read, 1, 2, 8, 8); err != nil || ld != dl[1] || rd != dl[2] {
		t.Fatal(err)
	}

	var buf []descriptors.Range
	l := descriptors.List{{Addr: 0, Len: 4}}
	r := descriptors.List{{Addr: 0, Len: 8}}
	if _, err := p.MergeRuns(&buf, l, r, []int{0}, []int{0}); !errors.Is(err, nixl.ErrMismatch) {
		t.Fatal(err)
	}
	if _, err := p.MergeRuns(&buf, l, r, []int{0}, []int{1}); !errors.Is(err, nixl.ErrInvalidParam) {
		t.Fatal(err)
	}

	lim := 0
	if err := p.CheckConfig("n", 4, &lim, 16); err != nil || lim != 16 {
		t.Fatal(err, lim)
	}
	if err := p.CheckConfig("toolong", 4, &lim, 16); !errors.Is(err, nixl.ErrInvalidParam) {
		t.Fatal(err)
	}
	lim = MaxNotifLimit + 1
	if err := p.CheckConfig("n", 4, &lim, 16); !errors.Is(err, nixl.ErrInvalidParam) {
		t.Fatal(err)
	}
	if err := p.CheckPost(1, Inflight); !errors.Is(err, nixl.ErrRepostActive) {
		t.Fatal(err)
	}
	if err := p.CheckPost(1, Done); err != nil {
		t.Fatal(err)
	}
}
