package enginekit

import (
	"sort"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// Region is the engine-independent part of a registered memory region.
// Engines embed it in their own region type.
type Region struct {
	ID   nixl.MemID
	Addr uint64
	Len  uint64
	Refs int // prepared lists and transfer requests using the region
}

// Mem returns r; through embedding it makes an engine's region type a Mem.
func (r *Region) Mem() *Region { return r }

// Mem is an engine's region type (a pointer to a struct embedding Region).
type Mem interface {
	comparable
	Mem() *Region
}

// AddRefs adds d to the reference count of every region in ms.
func AddRefs[M Mem](ms []M, d int) {
	for _, m := range ms {
		m.Mem().Refs += d
	}
}

// Regions is the set of an agent's registered regions, which may not
// overlap one another: by ID, sorted by address, and as a nixl.SpanIndex.
type Regions[M Mem] struct {
	prefix Prefix
	byID   map[nixl.MemID]M
	sorted []M // by Addr
	spans  nixl.SpanIndex
}

// NewRegions returns an empty set whose errors carry prefix.
func NewRegions[M Mem](prefix Prefix) Regions[M] {
	return Regions[M]{prefix: prefix, byID: map[nixl.MemID]M{}}
}

// CheckOverlap returns ErrInvalidParam if [addr, addr+n) wraps or overlaps
// a registered region.
func (s *Regions[M]) CheckOverlap(addr, n uint64) error {
	if addr+n < addr {
		return s.prefix.Errorf(nixl.ErrInvalidParam, "region wraps")
	}
	for _, m := range s.sorted {
		r := m.Mem()
		if addr < r.Addr+r.Len && r.Addr < addr+n {
			return s.prefix.Errorf(nixl.ErrInvalidParam, "region [%#x,+%d) overlaps registered region %d", addr, n, r.ID)
		}
	}
	return nil
}

// Add inserts m, whose Region is filled in and passed CheckOverlap.
func (s *Regions[M]) Add(m M) {
	s.byID[m.Mem().ID] = m
	s.rebuild()
}

// Removable returns the region id names if it may be deregistered:
// ErrNotFound if there is none, ErrNotAllowed while it is referenced.
func (s *Regions[M]) Removable(id nixl.MemID) (M, error) {
	var zero M
	m, ok := s.byID[id]
	if !ok {
		return zero, s.prefix.Errorf(nixl.ErrNotFound, "memory %d", id)
	}
	if r := m.Mem(); r.Refs > 0 {
		return zero, s.prefix.Errorf(nixl.ErrNotAllowed, "memory %d is used by %d lists or transfers", id, r.Refs)
	}
	return m, nil
}

// Remove deletes the region id names.
func (s *Regions[M]) Remove(id nixl.MemID) {
	delete(s.byID, id)
	s.rebuild()
}

func (s *Regions[M]) rebuild() {
	s.sorted = s.sorted[:0]
	spans := make([]nixl.Span, 0, len(s.byID))
	for _, m := range s.byID {
		s.sorted = append(s.sorted, m)
		r := m.Mem()
		spans = append(spans, nixl.Span{Addr: r.Addr, Len: r.Len})
	}
	sort.Slice(s.sorted, func(i, j int) bool { return s.sorted[i].Mem().Addr < s.sorted[j].Mem().Addr })
	s.spans, _ = nixl.NewSpanIndex(spans) // regions are non-empty and do not wrap
}

// Sorted returns the regions sorted by address. The slice is the set's;
// it changes on Add and Remove.
func (s *Regions[M]) Sorted() []M { return s.sorted }

// Spans returns the regions as a SpanIndex.
func (s *Regions[M]) Spans() nixl.SpanIndex { return s.spans }

// Clear forgets every region.
func (s *Regions[M]) Clear() {
	clear(s.byID)
	s.sorted = nil
	s.spans = nixl.SpanIndex{}
}

// At returns the region containing [addr, addr+n), and false if there is
// none.
func (s *Regions[M]) At(addr, n uint64) (M, bool) {
	var zero M
	i := sort.Search(len(s.sorted), func(i int) bool { return s.sorted[i].Mem().Addr > addr }) - 1
	if i < 0 {
		return zero, false
	}
	m := s.sorted[i]
	r := m.Mem()
	if addr+n < addr || addr+n > r.Addr+r.Len {
		return zero, false
	}
	return m, true
}

// Covering returns the regions that descs use, each once, in order of
// first use. If a descriptor is empty or lies outside every region it
// returns nil and that descriptor's index; otherwise bad is -1.
func (s *Regions[M]) Covering(descs descriptors.List) (ms []M, bad int) {
	seen := map[M]bool{}
	for i, ds := range descs {
		m, ok := s.At(ds.Addr, ds.Len)
		if !ok || ds.Len == 0 {
			return nil, i
		}
		if !seen[m] {
			seen[m] = true
			ms = append(ms, m)
		}
	}
	return ms, -1
}
