package descriptors

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestValidateIndices(t *testing.T) {
	local := BuildBlockDescs(0x1000, 8, 0x100, 0)
	remote := BuildBlockDescs(0x900000, 4, 0x100, 0)
	remote = append(remote, Desc{Addr: 0xa00000, Len: 0x200})
	for _, tc := range []struct {
		name     string
		li, ri   []int
		want     error
		fragment string
	}{
		{"empty", nil, nil, nil, ""},
		{"empty non-nil", []int{}, []int{}, nil, ""},
		{"valid", []int{0, 7, 3}, []int{3, 0, 1}, nil, ""},
		{"more local", []int{0, 1}, []int{0}, ErrIndexMismatch, "2 local, 1 remote"},
		{"more remote", nil, []int{0}, ErrIndexMismatch, "0 local, 1 remote"},
		{"local negative", []int{0, -1}, []int{0, 1}, ErrIndexRange, "local index -1 at position 1 (list has 8)"},
		{"local too large", []int{8}, []int{0}, ErrIndexRange, "local index 8 at position 0 (list has 8)"},
		{"local min int", []int{math.MinInt}, []int{0}, ErrIndexRange, "local index"},
		{"remote negative", []int{0}, []int{-3}, ErrIndexRange, "remote index -3 at position 0 (list has 5)"},
		{"remote too large", []int{0, 1}, []int{1, 5}, ErrIndexRange, "remote index 5 at position 1 (list has 5)"},
		{"remote max int", []int{0}, []int{math.MaxInt}, ErrIndexRange, "remote index"},
		{"length mismatch", []int{0, 1}, []int{0, 4}, ErrLenMismatch, "position 1: local 256 bytes, remote 512 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateIndices(local, remote, tc.li, tc.ri)
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tc.want)
			assert.Contains(t, err.Error(), tc.fragment)
			for _, other := range []error{ErrIndexMismatch, ErrIndexRange, ErrLenMismatch} {
				if other != tc.want {
					assert.NotErrorIs(t, err, other)
				}
			}
			_, mergeErr := MergeRuns(nil, local, remote, tc.li, tc.ri)
			assert.ErrorIs(t, mergeErr, tc.want, "MergeRuns validates like ValidateIndices")
		})
	}
}

func TestValidateIndicesEmptyLists(t *testing.T) {
	require.NoError(t, ValidateIndices(nil, nil, nil, nil))
	require.ErrorIs(t, ValidateIndices(nil, BuildBlockDescs(0, 1, 1, 0), []int{0}, []int{0}), ErrIndexRange)
}

func TestMergeRuns(t *testing.T) {
	const bs = 0x100
	local := BuildBlockDescs(0x1000, 16, bs, 0)
	remote := BuildBlockDescs(0x900000, 16, bs, 0)
	// Blocks of different sizes laid end to end on both sides.
	uneven := List{{Addr: 0x10, Len: 0x10}, {Addr: 0x20, Len: 0x30}, {Addr: 0x50, Len: 0x8}}
	unevenRemote := List{{Addr: 0x7000, Len: 0x10}, {Addr: 0x7010, Len: 0x30}, {Addr: 0x7040, Len: 0x8}}
	// Contiguous addresses on two devices.
	twoDevs := List{{Addr: 0x1000, Len: bs, DevID: 0}, {Addr: 0x1100, Len: bs, DevID: 1}, {Addr: 0x1200, Len: bs, DevID: 1}}
	// The first block ends at the very top of the address space; the second
	// starts at 0. The end address wraps to 0 but the blocks are not
	// adjacent.
	wrap := List{{Addr: math.MaxUint64 - bs + 1, Len: bs}, {Addr: 0, Len: bs}}

	r := func(l, rm, n uint64) Range { return Range{Local: l, Remote: rm, Len: n} }
	for _, tc := range []struct {
		name          string
		local, remote List
		li, ri        []int
		want          []Range
	}{
		{"empty", local, remote, nil, nil, []Range{}},
		{"single", local, remote, []int{5}, []int{9}, []Range{r(0x1500, 0x900900, bs)}},
		{"contiguous", local, remote, []int{0, 1, 2, 3}, []int{4, 5, 6, 7},
			[]Range{r(0x1000, 0x900400, 4*bs)}},
		{"all 16", local, remote, seq(0, 16), seq(0, 16), []Range{r(0x1000, 0x900000, 16*bs)}},
		{"scattered", local, remote, []int{0, 2, 4}, []int{1, 3, 5},
			[]Range{r(0x1000, 0x900100, bs), r(0x1200, 0x900300, bs), r(0x1400, 0x900500, bs)}},
		{"reversed", local, remote, []int{3, 2, 1, 0}, []int{3, 2, 1, 0},
			[]Range{r(0x1300, 0x900300, bs), r(0x1200, 0x900200, bs), r(0x1100, 0x900100, bs), r(0x1000, 0x900000, bs)}},
		{"partially contiguous", local, remote, []int{0, 1, 2, 5, 6, 9}, []int{0, 1, 2, 7, 8, 3},
			[]Range{r(0x1000, 0x900000, 3*bs), r(0x1500, 0x900700, 2*bs), r(0x1900, 0x900300, bs)}},
		{"local contiguous only", local, remote, []int{0, 1, 2}, []int{0, 2, 3},
			[]Range{r(0x1000, 0x900000, bs), r(0x1100, 0x900200, 2*bs)}},
		{"remote contiguous only", local, remote, []int{4, 6}, []int{1, 2},
			[]Range{r(0x1400, 0x900100, bs), r(0x1600, 0x900200, bs)}},
		{"repeated index", local, remote, []int{0, 0}, []int{0, 0},
			[]Range{r(0x1000, 0x900000, bs), r(0x1000, 0x900000, bs)}},
		{"uneven sizes", uneven, unevenRemote, []int{0, 1, 2}, []int{0, 1, 2},
			[]Range{r(0x10, 0x7000, 0x48)}},
		{"device change on local side", twoDevs, remote, []int{0, 1, 2}, []int{0, 1, 2},
			[]Range{r(0x1000, 0x900000, bs), r(0x1100, 0x900100, 2*bs)}},
		{"device change on remote side", local, twoDevs, []int{0, 1, 2}, []int{0, 1, 2},
			[]Range{r(0x1000, 0x1000, bs), r(0x1100, 0x1100, 2*bs)}},
		{"address wrap", wrap, remote, []int{0, 1}, []int{0, 1},
			[]Range{r(math.MaxUint64-bs+1, 0x900000, bs), r(0, 0x900100, bs)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MergeRuns(nil, tc.local, tc.remote, tc.li, tc.ri)
			require.NoError(t, err)
			require.Equal(t, tc.want, append([]Range{}, got...))

			var total, want uint64
			for _, g := range got {
				total += g.Len
			}
			for _, i := range tc.li {
				want += tc.local[i].Len
			}
			assert.Equal(t, want, total, "ranges cover every byte once")

			// Reusing a dst with stale contents gives the same answer.
			dst := make([]Range, 3, 64)
			for i := range dst {
				dst[i] = r(1, 2, 3)
			}
			again, err := MergeRuns(dst, tc.local, tc.remote, tc.li, tc.ri)
			require.NoError(t, err)
			require.Equal(t, tc.want, append([]Range{}, again...))
		})
	}
}

func TestMergeRunsErrorResetsDst(t *testing.T) {
	local := BuildBlockDescs(0, 4, 8, 0)
	dst := []Range{{1, 2, 3}}
	got, err := MergeRuns(dst, local, local, []int{0}, []int{4})
	require.True(t, errors.Is(err, ErrIndexRange))
	require.Empty(t, got)
	require.Equal(t, cap(dst), cap(got), "dst is reused, not replaced")
}

func seq(from, to int) []int {
	s := make([]int, 0, to-from)
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

// scatteredIdx returns n indices of which no two neighbours are adjacent
// blocks: 0, 2, 4, ... wrapping to the odd ones.
func scatteredIdx(n int) []int {
	s := make([]int, 0, n)
	for i := 0; i < n; i += 2 {
		s = append(s, i)
	}
	for i := 1; i < n; i += 2 {
		s = append(s, i)
	}
	return s
}

func TestMergeRunsNoAllocs(t *testing.T) {
	const n = 880
	local := BuildBlockDescs(0x100000, n, 5120, 0)
	remote := BuildBlockDescs(blockBase, n, 5120, 0)
	dst := make([]Range, 0, n)
	for _, tc := range []struct {
		name   string
		li, ri []int
		ranges int
	}{
		{"contiguous", seq(0, n), seq(0, n), 1},
		{"scattered", scatteredIdx(n), scatteredIdx(n), n},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []Range
			allocs := testing.AllocsPerRun(100, func() {
				var err error
				got, err = MergeRuns(dst, local, remote, tc.li, tc.ri)
				if err != nil {
					t.Fatal(err)
				}
			})
			assert.Zero(t, allocs)
			assert.Len(t, got, tc.ranges)
		})
	}
}
