package nixl

import (
	"errors"
	"math"
	"testing"

	"github.com/ecxfer/ecxfer/descriptors"
)

func TestNewSpanIndex(t *testing.T) {
	tests := []struct {
		name  string
		spans []Span
		ok    bool
	}{
		{"none", nil, true},
		{"one", []Span{{0x1000, 0x100}}, true},
		{"unsorted", []Span{{0x3000, 0x10}, {0x1000, 0x10}, {0x2000, 0x10}}, true},
		{"ends one below the top", []Span{{math.MaxUint64 - 10, 10}}, true},
		{"ends at 2^64 (end not representable)", []Span{{math.MaxUint64 - 9, 10}}, false},
		{"address zero", []Span{{0, 1}}, true},
		{"zero length", []Span{{0x1000, 0}}, false},
		{"wraps", []Span{{math.MaxUint64 - 9, 11}}, false},
		{"max length", []Span{{1, math.MaxUint64}}, false},
		{"one bad among good", []Span{{0x1000, 0x10}, {0x2000, 0}}, false},
	}
	for _, tc := range tests {
		_, err := NewSpanIndex(tc.spans)
		if tc.ok && err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if !tc.ok && !errors.Is(err, ErrInvalidParam) {
			t.Errorf("%s: %v, want ErrInvalidParam", tc.name, err)
		}
	}
}

func TestSpanIndexContains(t *testing.T) {
	in := []Span{{0x3000, 0x100}, {0x1000, 0x100}, {0x1100, 0x100}, {math.MaxUint64 - 0x100, 0x100}}
	x, err := NewSpanIndex(in)
	if err != nil {
		t.Fatal(err)
	}
	in[0].Len = 1 // the index holds its own copy
	tests := []struct {
		name    string
		addr, n uint64
		want    bool
	}{
		{"first byte", 0x1000, 1, true},
		{"whole span", 0x1000, 0x100, true},
		{"last byte", 0x10ff, 1, true},
		{"one past end", 0x1100 - 1, 2, false}, // crosses into the adjacent span
		{"adjacent span whole", 0x1100, 0x100, true},
		{"across adjacent spans", 0x1000, 0x200, false},
		{"before first", 0xfff, 1, false},
		{"straddles start", 0xfff, 2, false},
		{"gap", 0x2000, 1, false},
		{"third span (sorted from unsorted input)", 0x3000, 0x100, true},
		{"past third", 0x3100, 1, false},
		{"zero length inside", 0x1010, 0, true},
		{"zero length at end", 0x1200, 0, true}, // empty range at the end of a span
		{"zero length in gap", 0x2000, 0, false},
		{"address zero", 0, 1, false},
		{"overflow", 0x1000, math.MaxUint64, false},
		{"overflow by one", math.MaxUint64, 2, false},
		{"top span whole", math.MaxUint64 - 0x100, 0x100, true},
		{"top span last byte", math.MaxUint64 - 1, 1, true},
		{"past top span", math.MaxUint64 - 0x100, 0x101, false},
		{"last address", math.MaxUint64, 1, false},
	}
	for _, tc := range tests {
		if got := x.Contains(tc.addr, tc.n); got != tc.want {
			t.Errorf("%s: Contains(%#x, %d) = %v, want %v", tc.name, tc.addr, tc.n, got, tc.want)
		}
	}
	var empty SpanIndex
	if empty.Contains(0, 0) || empty.Contains(0x1000, 1) {
		t.Error("empty index contains something")
	}
}

// TestSpanIndexOverlapping: a range inside one of two overlapping spans
// is contained, whichever of them starts later; it used to be refused
// when the span starting nearest below it was the shorter one.
func TestSpanIndexOverlapping(t *testing.T) {
	x, err := NewSpanIndex([]Span{{0, 1000}, {500, 10}, {2000, 100}, {2000, 50}})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		addr, n uint64
		want    bool
	}{
		{500, 10, true},   // inside both
		{500, 11, true},   // past the short one, inside the long one
		{600, 100, true},  // past the short one's start and end
		{990, 10, true},   // the long one's last bytes
		{990, 11, false},  // past both
		{1000, 1, false},  // the gap
		{2000, 100, true}, // the longer of two at the same address
		{2040, 60, true},
		{2050, 51, false},
	}
	for _, tc := range tests {
		if got := x.Contains(tc.addr, tc.n); got != tc.want {
			t.Errorf("Contains(%d, %d) = %v, want %v", tc.addr, tc.n, got, tc.want)
		}
	}
}

func TestSpanIndexCheckList(t *testing.T) {
	x, err := NewSpanIndex([]Span{{0x1000, 0x1000}})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		l    descriptors.List
		ok   bool
	}{
		{"empty list", nil, true},
		{"blocks", descriptors.BuildBlockDescs(0x1000, 16, 0x100, 0), true},
		{"one block too many", descriptors.BuildBlockDescs(0x1000, 17, 0x100, 0), false},
		{"zero length", descriptors.List{{Addr: 0x1000, Len: 0}}, false},
		{"wraps", descriptors.List{{Addr: 0x1000, Len: math.MaxUint64}}, false},
		{"outside", descriptors.List{{Addr: 0x1000, Len: 1}, {Addr: 0x5000, Len: 1}}, false},
	}
	for _, tc := range tests {
		err := x.CheckList(tc.l)
		if tc.ok && err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if !tc.ok {
			var e *Error
			if !errors.Is(err, ErrInvalidParam) || !errors.As(err, &e) {
				t.Errorf("%s: %v, want ErrInvalidParam", tc.name, err)
			}
		}
	}
	// The error names the first offender.
	err = x.CheckList(descriptors.List{{Addr: 0x1000, Len: 1}, {Addr: 0x9000, Len: 1}, {Addr: 0, Len: 0}})
	if err == nil || !containsAll(err.Error(), "descriptor 1", "0x9000") {
		t.Errorf("error %v does not name descriptor 1", err)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		found := false
		for i := 0; i+len(sub) <= len(s); i++ {
			if s[i:i+len(sub)] == sub {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}
