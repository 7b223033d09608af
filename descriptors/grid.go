package descriptors

import "fmt"

// Grid is a List laid out the way BuildBlockDescs lays one out: N
// descriptors of Len bytes each, end to end from Base, all on device DevID.
// A vLLM region's block list is one. Checking a READ's indices against two
// Grids, and finding a block's address, is arithmetic on the index: no
// descriptor is loaded per index, so a READ of 880 scattered blocks does
// not pay 1,760 cache misses into two block lists before it starts.
type Grid struct {
	Base, Len, DevID uint64
	N                int
}

// GridOf returns l as a Grid, and false when l is not laid out as one (or
// is empty, has zero-length descriptors, or ends past the top of the
// address space).
func GridOf(l List) (Grid, bool) {
	if len(l) == 0 || l[0].Len == 0 {
		return Grid{}, false
	}
	g := Grid{Base: l[0].Addr, Len: l[0].Len, DevID: l[0].DevID, N: len(l)}
	addr := g.Base
	for _, d := range l {
		if d.Addr != addr || d.Len != g.Len || d.DevID != g.DevID || addr+g.Len < addr {
			return Grid{}, false
		}
		addr += g.Len
	}
	return g, true
}

// Addr returns the address of block i, which must be in range.
func (g Grid) Addr(i int) uint64 { return g.Base + uint64(i)*g.Len }

// ValidateGrid is ValidateIndices for two lists that are Grids: it
// accepts and rejects exactly what ValidateIndices does for the Lists the
// Grids describe, with the same errors. The Grids are GridOf's: one built
// by hand with a negative N is taken for an empty List, and one that
// runs past the top of the address space describes no List at all.
func ValidateGrid(local, remote Grid, localIdx, remoteIdx []int) error {
	if len(localIdx) != len(remoteIdx) {
		return fmt.Errorf("%w: %d local, %d remote", ErrIndexMismatch, len(localIdx), len(remoteIdx))
	}
	// A Grid of no List (N < 0) is taken for an empty one.
	ln, rn := uint(max(local.N, 0)), uint(max(remote.N, 0))
	for i, li := range localIdx {
		if uint(li) >= ln || uint(remoteIdx[i]) >= rn {
			return gridRangeErr(local, remote, localIdx, remoteIdx, i)
		}
		if local.Len != remote.Len {
			// Every pair differs; ValidateIndices stops at the first
			// pair whose indices are in range.
			return fmt.Errorf("%w: position %d: local %d bytes, remote %d bytes", ErrLenMismatch, i, local.Len, remote.Len)
		}
	}
	return nil
}

func gridRangeErr(local, remote Grid, localIdx, remoteIdx []int, i int) error {
	ln, rn := max(local.N, 0), max(remote.N, 0)
	if li := localIdx[i]; uint(li) >= uint(ln) {
		return fmt.Errorf("%w: local index %d at position %d (list has %d)", ErrIndexRange, li, i, ln)
	}
	return fmt.Errorf("%w: remote index %d at position %d (list has %d)", ErrIndexRange, remoteIdx[i], i, rn)
}
