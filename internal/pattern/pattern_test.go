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
