package descriptors

import (
	"errors"
	"fmt"
)

// Errors returned by the index helpers. They work with errors.Is.
var (
	// ErrIndexMismatch: the local and remote index lists differ in length.
	ErrIndexMismatch = errors.New("descriptors: local and remote index lists differ in length")
	// ErrIndexRange: an index is negative or past the end of its list.
	ErrIndexRange = errors.New("descriptors: index out of range")
	// ErrLenMismatch: a local and a remote descriptor paired by the index
	// lists have different lengths.
	ErrLenMismatch = errors.New("descriptors: paired descriptors differ in length")
)

// Range is one contiguous piece of a transfer: Len bytes between Local and
// Remote, produced by merging runs of paired descriptors.
type Range struct {
	Local, Remote, Len uint64
}

// ValidateIndices checks two index lists against two descriptor lists:
// equal length, every index in range, paired descriptors of equal length.
// It allocates only for the error it returns.
func ValidateIndices(local, remote List, localIdx, remoteIdx []int) error {
	if len(localIdx) != len(remoteIdx) {
		return fmt.Errorf("%w: %d local, %d remote", ErrIndexMismatch, len(localIdx), len(remoteIdx))
	}
	for i, li := range localIdx {
		ri := remoteIdx[i]
		if uint(li) >= uint(len(local)) {
			return fmt.Errorf("%w: local index %d at position %d (list has %d)", ErrIndexRange, li, i, len(local))
		}
		if uint(ri) >= uint(len(remote)) {
			return fmt.Errorf("%w: remote index %d at position %d (list has %d)", ErrIndexRange, ri, i, len(remote))
		}
		if local[li].Len != remote[ri].Len {
			return fmt.Errorf("%w: position %d: local %d bytes, remote %d bytes", ErrLenMismatch, i, local[li].Len, remote[ri].Len)
		}
	}
	return nil
}

// MergeRuns validates the index lists (as ValidateIndices) and appends to
// dst[:0] one Range per maximal run in which both the local and the remote
// descriptors are contiguous in memory: pair i+1 extends the current range
// when its local address starts where the range's local end is, its remote
// address starts where the range's remote end is, both descriptors are on
// the same device as the previous pair's, and neither end nor the merged
// length wraps around uint64. Given a dst with enough capacity it allocates
// nothing on success.
func MergeRuns(dst []Range, local, remote List, localIdx, remoteIdx []int) ([]Range, error) {
	if err := ValidateIndices(local, remote, localIdx, remoteIdx); err != nil {
		return dst[:0], err
	}
	dst = dst[:0]
	var prevLocalDev, prevRemoteDev uint64
	for i, li := range localIdx {
		l, r := local[li], remote[remoteIdx[i]]
		if n := len(dst); n > 0 && l.DevID == prevLocalDev && r.DevID == prevRemoteDev {
			last := &dst[n-1]
			localEnd, remoteEnd := last.Local+last.Len, last.Remote+last.Len
			if localEnd == l.Addr && remoteEnd == r.Addr &&
				localEnd >= last.Local && remoteEnd >= last.Remote &&
				last.Len+l.Len >= last.Len {
				last.Len += l.Len
				continue
			}
		}
		dst = append(dst, Range{Local: l.Addr, Remote: r.Addr, Len: l.Len})
		prevLocalDev, prevRemoteDev = l.DevID, r.DevID
	}
	return dst, nil
}
