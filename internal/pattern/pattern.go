// Package pattern fills blocks with bytes a reader can recompute, so a
// process that READ blocks from another can verify every byte without
// having the producer's copy.
package pattern

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// word returns the 8 bytes at offset 8*k of block i for seed.
func word(seed uint64, i, k int) uint64 {
	var b [24]byte
	binary.LittleEndian.PutUint64(b[0:], seed)
	binary.LittleEndian.PutUint64(b[8:], uint64(i))
	binary.LittleEndian.PutUint64(b[16:], uint64(k))
	return xxhash.Sum64(b[:])
}

// Fill writes block i's pattern into dst (one block).
func Fill(dst []byte, seed uint64, i int) {
	var w [8]byte
	for k := 0; 8*k < len(dst); k++ {
		binary.LittleEndian.PutUint64(w[:], word(seed, i, k))
		copy(dst[8*k:], w[:])
	}
}

// FillRegion fills every block of region.
func FillRegion(region []byte, seed uint64, blockSize int) {
	for i := 0; (i+1)*blockSize <= len(region); i++ {
		Fill(region[i*blockSize:(i+1)*blockSize], seed, i)
	}
}

// Check reports whether got holds block i's pattern, and the first
// differing offset when it does not.
func Check(got []byte, seed uint64, i int) (bool, int) {
	var w [8]byte
	for k := 0; 8*k < len(got); k++ {
		binary.LittleEndian.PutUint64(w[:], word(seed, i, k))
		chunk := got[8*k:]
		for j := 0; j < 8 && j < len(chunk); j++ {
			if chunk[j] != w[j] {
				return false, 8*k + j
			}
		}
	}
	return true, -1
}
