package nixl

import (
	"sort"

	"github.com/ecxfer/ecxfer/descriptors"
)

// Span is an address range [Addr, Addr+Len) that a peer advertised or that
// was registered locally.
type Span struct {
	Addr, Len uint64
}

// end returns the first address past s, and false if it overflows.
func (s Span) end() (uint64, bool) {
	e := s.Addr + s.Len
	return e, e >= s.Addr
}

// SpanIndex of the spans an agent may touch, sorted for lookups.
type SpanIndex struct {
	spans []Span   // sorted by Addr
	reach []uint64 // reach[i]: the furthest end of spans[0..i]
}

// NewSpanIndex builds an index over spans (copied). Zero-length or
// overflowing spans are rejected with ErrInvalidParam. Spans may overlap
// (an agent's own registrations of one buffer twice); a range inside any
// one of them is contained.
func NewSpanIndex(spans []Span) (SpanIndex, error) {
	s := append([]Span(nil), spans...)
	for _, sp := range s {
		if _, ok := sp.end(); !ok || sp.Len == 0 {
			return SpanIndex{}, Errorf(ErrInvalidParam, "region [%#x,+%d) is empty or wraps", sp.Addr, sp.Len)
		}
	}
	sort.Slice(s, func(i, j int) bool { return s[i].Addr < s[j].Addr })
	reach := make([]uint64, len(s))
	for i, sp := range s {
		e, _ := sp.end()
		reach[i] = e
		if i > 0 {
			reach[i] = max(e, reach[i-1])
		}
	}
	return SpanIndex{spans: s, reach: reach}, nil
}

// Contains reports whether [addr, addr+n) lies inside one span.
func (x SpanIndex) Contains(addr, n uint64) bool {
	end := addr + n
	if end < addr {
		return false
	}
	// Every span up to the last one starting at or before addr starts
	// at or before it: one of them holds the range if the furthest of
	// their ends is at or past its end.
	i := sort.Search(len(x.spans), func(i int) bool { return x.spans[i].Addr > addr }) - 1
	if i < 0 {
		return false
	}
	return end <= x.reach[i]
}

// CheckList returns ErrInvalidParam, naming the first offender, unless every
// descriptor of l lies inside one span.
func (x SpanIndex) CheckList(l descriptors.List) error {
	for i, d := range l {
		if d.Len == 0 {
			return Errorf(ErrInvalidParam, "descriptor %d has zero length", i)
		}
		if !x.Contains(d.Addr, d.Len) {
			return Errorf(ErrInvalidParam, "descriptor %d [%#x,+%d) lies outside the registered regions", i, d.Addr, d.Len)
		}
	}
	return nil
}
