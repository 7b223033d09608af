package enginekit

import (
	"errors"
	"testing"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

type kitPeer struct{ PeerBase }

type kitMem struct{ Region }

type kitList struct {
	ListBase[*kitPeer, *kitMem]
}

func TestIDs(t *testing.T) {
	var ids IDs
	seen := map[uint64]bool{}
	for i := 0; i < 100; i++ {
		id := ids.Next()
		if id == 0 || seen[id] {
			t.Fatalf("id %d (zero or repeated)", id)
		}
		seen[id] = true
	}
}

func TestLists(t *testing.T) {
	var ids IDs
	s := NewLists[*kitList]()
	m := &kitMem{Region{ID: 1, Addr: 0x1000, Len: 0x1000}}
	p := &kitPeer{}
	other := &kitPeer{}

	local := &kitList{}
	local.Descs, local.Mems, local.Valid = descriptors.List{{Addr: 0x1000, Len: 16}}, []*kitMem{m}, true
	remote := &kitList{}
	remote.Peer, remote.Valid = p, true
	remote2 := &kitList{}
	remote2.Peer, remote2.Valid = other, true

	lid := s.Add(local, &ids)
	rid := s.Add(remote, &ids)
	s.Add(remote2, &ids)
	if lid == 0 || rid == 0 || lid == rid || local.ID != lid || remote.ID != rid {
		t.Fatalf("ids %d %d, lists have %d %d", lid, rid, local.ID, remote.ID)
	}
	if m.Refs != 1 {
		t.Fatalf("region refs %d after Add, want 1", m.Refs)
	}
	if local.Remote() || !remote.Remote() {
		t.Fatal("Remote() wrong")
	}
	if !remote.Usable() {
		t.Fatal("fresh remote list not usable")
	}
	p.Dead = errors.New("gone")
	if remote.Usable() {
		t.Fatal("list of a dead peer is usable")
	}
	p.Dead = nil

	s.Invalidate(p)
	if remote.Usable() || remote.Valid {
		t.Fatal("list of an invalidated peer is usable")
	}
	if !remote2.Usable() {
		t.Fatal("Invalidate reached another peer's list")
	}
	if s.ByID()[rid] != remote {
		t.Fatal("an invalidated list must stay filed until released")
	}

	if _, err := s.Release("kit", 999); !errors.Is(err, nixl.ErrNotFound) {
		t.Fatalf("release of an unknown id: %v", err)
	}
	got, err := s.Release("kit", lid)
	if err != nil || got != local {
		t.Fatalf("release: %v %v", got, err)
	}
	if m.Refs != 0 {
		t.Fatalf("region refs %d after Release, want 0", m.Refs)
	}
	if _, err := s.Release("kit", lid); !errors.Is(err, nixl.ErrNotFound) {
		t.Fatalf("second release: %v", err)
	}
	s.Clear()
	if len(s.ByID()) != 0 {
		t.Fatal("Clear left lists")
	}
}
