package pattern

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestFillCheck(t *testing.T) {
	const bs = 5123 // not a multiple of 8
	region := make([]byte, 4*bs)
	FillRegion(region, 7, bs)
	for i := 0; i < 4; i++ {
		ok, off := Check(region[i*bs:(i+1)*bs], 7, i)
		require.True(t, ok, "block %d differs at %d", i, off)
	}
	ok, _ := Check(region[bs:2*bs], 7, 2)
	require.False(t, ok, "blocks must differ from each other")
	ok, _ = Check(region[:bs], 8, 0)
	require.False(t, ok, "seeds must differ")
	region[3*bs+100] ^= 1
	ok, off := Check(region[3*bs:], 7, 3)
	require.False(t, ok)
	require.Equal(t, 100, off)
}

// No block passes for another at any of its first few word offsets: a
// READ that landed the wrong block, or the right one shifted, fails.
func TestBlocksDistinct(t *testing.T) {
	const bs = 256
	region := make([]byte, 64*bs)
	FillRegion(region, 3, bs)
	for i := range 64 {
		for j := range 64 {
			for shift := 0; shift < 4; shift++ {
				if i == j && shift == 0 {
					continue
				}
				ok, _ := Check(region[i*bs+8*shift:(i+1)*bs], 3, j)
				require.False(t, ok, "block %d at word %d passes for block %d", i, shift, j)
			}
		}
	}
}

func BenchmarkCheck(b *testing.B) {
	const bs = 32 << 10
	blk := make([]byte, bs)
	Fill(blk, 9, 5)
	b.SetBytes(bs)
	for b.Loop() {
		if ok, _ := Check(blk, 9, 5); !ok {
			b.Fatal("mismatch")
		}
	}
}
