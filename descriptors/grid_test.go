package descriptors

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestGridOf(t *testing.T) {
	g, ok := GridOf(BuildBlockDescs(0x1000, 8, 0x100, 3))
	require.True(t, ok)
	assert.Equal(t, Grid{Base: 0x1000, Len: 0x100, DevID: 3, N: 8}, g)
	assert.Equal(t, uint64(0x1500), g.Addr(5))

	for name, l := range map[string]List{
		"empty":       {},
		"zero length": {{Addr: 0x1000, Len: 0}, {Addr: 0x1000, Len: 0}},
		"gap":         {{Addr: 0x1000, Len: 0x100}, {Addr: 0x1200, Len: 0x100}},
		"overlap":     {{Addr: 0x1000, Len: 0x100}, {Addr: 0x1080, Len: 0x100}},
		"other len":   {{Addr: 0x1000, Len: 0x100}, {Addr: 0x1100, Len: 0x80}},
		"other dev":   {{Addr: 0x1000, Len: 0x100}, {Addr: 0x1100, Len: 0x100, DevID: 1}},
		"wraps":       {{Addr: math.MaxUint64 - 0xff, Len: 0x100}, {Addr: 0, Len: 0x100}},
		"ends at top": {{Addr: math.MaxUint64 - 0x7f, Len: 0x100}},
	} {
		_, ok := GridOf(l)
		assert.False(t, ok, name)
	}
	g, ok = GridOf(List{{Addr: 0x1000, Len: 0x100}})
	require.True(t, ok, "one descriptor is a grid")
	assert.Equal(t, 1, g.N)
}

// ValidateGrid must answer exactly as ValidateIndices does on the lists the
// grids describe: the reactor takes one or the other by the lists' shape.
// TestValidateGridNegativeN: a hand-made Grid with a negative N is an
// empty List: every index is out of range, as ValidateIndices says for an
// empty List. It used to accept any index.
func TestValidateGridNegativeN(t *testing.T) {
	g := Grid{Base: 0x1000, Len: 0x100, N: -1}
	ok := Grid{Base: 0x9000, Len: 0x100, N: 16}
	for _, idx := range []int{0, 5, 1 << 40} {
		err := ValidateGrid(g, ok, []int{idx}, []int{0})
		require.ErrorIs(t, err, ErrIndexRange)
		require.Equal(t, ValidateIndices(nil, BuildBlockDescs(0x9000, 16, 0x100, 0), []int{idx}, []int{0}).Error(), err.Error())
		require.ErrorIs(t, ValidateGrid(ok, g, []int{0}, []int{idx}), ErrIndexRange)
	}
}

func TestValidateGridMatchesValidateIndices(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func(n int) int {
		switch rng.IntN(20) {
		case 0:
			return -1 - rng.IntN(3)
		case 1:
			return n + rng.IntN(3)
		}
		return rng.IntN(n)
	}
	for k := range 20000 {
		ln, rn := 1+rng.IntN(16), 1+rng.IntN(16)
		lsz, rsz := uint64(0x100), uint64(0x100)
		if k%7 == 0 {
			rsz = 0x80
		}
		local := BuildBlockDescs(0x10000, ln, lsz, 0)
		remote := BuildBlockDescs(0x900000, rn, rsz, 0)
		lg, ok1 := GridOf(local)
		rg, ok2 := GridOf(remote)
		require.True(t, ok1 && ok2)
		n := rng.IntN(6)
		li, ri := make([]int, n), make([]int, n)
		for i := range n {
			li[i], ri[i] = pick(ln), pick(rn)
		}
		if k%11 == 0 && n > 0 {
			ri = ri[:n-1]
		}
		want := ValidateIndices(local, remote, li, ri)
		got := ValidateGrid(lg, rg, li, ri)
		if want == nil {
			require.NoError(t, got, "li %v ri %v", li, ri)
			continue
		}
		require.Error(t, got, "li %v ri %v", li, ri)
		require.Equal(t, want.Error(), got.Error(), "li %v ri %v", li, ri)
		for _, e := range []error{ErrIndexMismatch, ErrIndexRange, ErrLenMismatch} {
			assert.Equal(t, errors.Is(want, e), errors.Is(got, e))
		}
	}
}

func BenchmarkValidate880Scattered(b *testing.B) {
	local := BuildBlockDescs(0x10000, 4096, 5120, 0)
	remote := BuildBlockDescs(0x9000000, 4096, 5120, 0)
	lg, _ := GridOf(local)
	rg, _ := GridOf(remote)
	// 880 of 4,096 blocks at random, as an image's blocks are in a
	// region that has been in use a while.
	rng := rand.New(rand.NewPCG(3, 4))
	li, ri := rng.Perm(4096)[:benchBlocks], rng.Perm(4096)[:benchBlocks]
	// Warm caches; on the path users take a READ of a 4.5 MB image has
	// just evicted both block lists, which is where the grid's saving is
	// (see bench-python's post column).
	b.Run("lists", func(b *testing.B) {
		for b.Loop() {
			if err := ValidateIndices(local, remote, li, ri); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("grids", func(b *testing.B) {
		for b.Loop() {
			if err := ValidateGrid(lg, rg, li, ri); err != nil {
				b.Fatal(err)
			}
		}
	})
}
