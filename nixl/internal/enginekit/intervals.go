package enginekit

import "slices"

// Interval is the address range [Lo, Hi).
type Interval struct{ Lo, Hi uint64 }

// MergeIntervals sorts m and merges overlapping and touching intervals,
// in place; it returns the merged intervals, sorted.
func MergeIntervals(m []Interval) []Interval {
	slices.SortFunc(m, func(x, y Interval) int {
		switch {
		case x.Lo < y.Lo:
			return -1
		case x.Lo > y.Lo:
			return 1
		}
		return 0
	})
	out := m[:0]
	for _, s := range m {
		if k := len(out); k > 0 && s.Lo <= out[k-1].Hi {
			out[k-1].Hi = max(out[k-1].Hi, s.Hi)
			continue
		}
		out = append(out, s)
	}
	return out
}

// Overlaps reports whether [lo, hi) overlaps one of the sorted, merged
// intervals m.
func Overlaps(m []Interval, lo, hi uint64) bool {
	// The first merged interval that ends after lo; it overlaps when it starts
	// before hi.
	i, _ := slices.BinarySearchFunc(m, lo, func(s Interval, v uint64) int {
		if s.Hi <= v {
			return -1
		}
		return 1
	})
	return i < len(m) && m[i].Lo < hi
}
