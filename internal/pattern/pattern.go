// Package pattern fills blocks with bytes a reader can recompute, so a
// process that READ blocks from another can verify every byte without
// having the producer's copy.
//
// Block i of seed s is a stream of 64-bit words: word k is a bijective
// mix (splitmix64's finalizer) of the block's key, a hash of (s, i), plus
// (k+1) times the golden ratio. Distinct blocks have distinct keys, so no
// block passes for another (nor for itself at another offset), and the
// words cost a few multiplies each: checking runs at several GB/s, not at
// the speed of one hash per word, so the harness's verification takes
// little of the machine it measures.
package pattern

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

const golden = 0x9e3779b97f4a7c15

// key is block i's key for seed.
func key(seed uint64, i int) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[0:], seed)
	binary.LittleEndian.PutUint64(b[8:], uint64(i))
	return xxhash.Sum64(b[:])
}

// word returns the k-th 8 bytes of the block whose key is key.
func word(key uint64, k int) uint64 {
	z := key + uint64(k+1)*golden
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// Fill writes block i's pattern into dst (one block).
func Fill(dst []byte, seed uint64, i int) {
	kk := key(seed, i)
	n := len(dst) / 8
	for k := range n {
		binary.LittleEndian.PutUint64(dst[8*k:], word(kk, k))
	}
	if len(dst) > 8*n {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], word(kk, n))
		copy(dst[8*n:], w[:])
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
	kk := key(seed, i)
	n := len(got) / 8
	for k := range n {
		if binary.LittleEndian.Uint64(got[8*k:]) != word(kk, k) {
			return false, 8*k + firstDiff(got[8*k:8*k+8], word(kk, k))
		}
	}
	if len(got) > 8*n {
		if off := firstDiff(got[8*n:], word(kk, n)); off >= 0 {
			return false, 8*n + off
		}
	}
	return true, -1
}

// firstDiff returns the first of b's (at most 8) bytes that differs from
// w's little-endian bytes, or -1.
func firstDiff(b []byte, w uint64) int {
	for j := range b {
		if b[j] != byte(w>>(8*j)) {
			return j
		}
	}
	return -1
}
