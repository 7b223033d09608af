package enginekit

import (
	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// IDs hands out an agent's IDs. One counter serves regions, lists and
// transfer requests, so no two objects of an agent share an ID and 0 (the
// invalid ID of every kind) is never handed out.
type IDs struct{ last uint64 }

// Next returns a fresh ID.
func (i *IDs) Next() uint64 {
	i.last++
	return i.last
}

// PeerBase is the engine-independent state of a loaded peer. Engines embed
// it in their peer type, which then satisfies Peer.
type PeerBase struct {
	Dead error // why the peer is unusable, nil while it is usable
}

// Gone implements Peer.
func (p *PeerBase) Gone() error { return p.Dead }

// ListBase is the engine-independent state of a prepared descriptor list.
// Engines embed it in their list type, which then satisfies Dlist; P is
// the engine's peer type, M its region type.
type ListBase[P interface {
	comparable
	Peer
}, M Mem] struct {
	ID    nixl.DlistID
	Peer  P // the zero P (nil): a list of local memory
	Descs descriptors.List
	Mems  []M  // local: the regions the list uses, each once
	Valid bool // false once its peer was invalidated
}

// Remote implements Dlist.
func (d *ListBase[P, M]) Remote() bool {
	var zero P
	return d.Peer != zero
}

// Usable implements Dlist.
func (d *ListBase[P, M]) Usable() bool { return d.Valid && d.Peer.Gone() == nil }

// List returns d; through embedding it gives Lists an engine list's base.
func (d *ListBase[P, M]) List() *ListBase[P, M] { return d }

// Lists is an agent's prepared lists by ID. L is the engine's list type (a
// pointer to a struct embedding ListBase[P, M]).
type Lists[L interface {
	comparable
	List() *ListBase[P, M]
}, P interface {
	comparable
	Peer
}, M Mem] struct {
	byID map[nixl.DlistID]L
}

// NewLists returns an empty set.
func NewLists[L interface {
	comparable
	List() *ListBase[P, M]
}, P interface {
	comparable
	Peer
}, M Mem]() Lists[L, P, M] {
	return Lists[L, P, M]{byID: map[nixl.DlistID]L{}}
}

// Add gives l a fresh ID, files it and takes its references on local
// regions. l's Peer, Descs, Mems and Valid are already set.
func (s *Lists[L, P, M]) Add(l L, ids *IDs) nixl.DlistID {
	b := l.List()
	b.ID = nixl.DlistID(ids.Next())
	AddRefs(b.Mems, 1)
	s.byID[b.ID] = l
	return b.ID
}

// ByID returns the lists by ID, for lookups. The map is the set's own.
func (s *Lists[L, P, M]) ByID() map[nixl.DlistID]L { return s.byID }

// Clear forgets every list, without touching region references: for an
// agent that is closing.
func (s *Lists[L, P, M]) Clear() { clear(s.byID) }

// Release unfiles list id and drops its references on local regions; the
// engine then frees what it holds of it. ErrNotFound if there is none.
func (s *Lists[L, P, M]) Release(prefix Prefix, id nixl.DlistID) (L, error) {
	l, ok := s.byID[id]
	if !ok {
		var zero L
		return zero, prefix.DlistNotFound(id)
	}
	AddRefs(l.List().Mems, -1)
	delete(s.byID, id)
	return l, nil
}

// Invalidate marks every list of peer p unusable: they can only be
// released.
func (s *Lists[L, P, M]) Invalidate(p P) {
	for _, l := range s.byID {
		if b := l.List(); b.Peer == p {
			b.Valid = false
		}
	}
}
