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
	spans []Span // sorted by Addr
}

// NewSpanIndex builds an index over spans (copied). Zero-length or
// overflowing spans are rejected with ErrInvalidParam.
func NewSpanIndex(spans []Span) (SpanIndex, error) {
	s := append([]Span(nil), spans...)
	for _, sp := range s {
		if _, ok := sp.end(); !ok || sp.Len == 0 {
			return SpanIndex{}, Errorf(ErrInvalidParam, "region [%#x,+%d) is empty or wraps", sp.Addr, sp.Len)
		}
	}
	sort.Slice(s, func(i, j int) bool { return s[i].Addr < s[j].Addr })
	return SpanIndex{spans: s}, nil
}

// Contains reports whether [addr, addr+n) lies inside one span.
func (x SpanIndex) Contains(addr, n uint64) bool {
	end := addr + n
	if end < addr {
		return false
	}
	// Last span starting at or before addr.
	i := sort.Search(len(x.spans), func(i int) bool { return x.spans[i].Addr > addr }) - 1
	if i < 0 {
		return false
	}
	se, _ := x.spans[i].end()
	return end <= se
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
