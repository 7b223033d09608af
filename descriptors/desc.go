package descriptors

// Desc describes one contiguous piece of registered memory: Len bytes at
// Addr on device DevID (0 for host memory).
type Desc struct {
	Addr, Len, DevID uint64
}

// List is a descriptor list. In ecxfer, descriptor i covers block i.
type List []Desc

// BuildBlockDescs returns numBlocks descriptors of blockSize bytes each,
// laid end to end from base: descriptor i covers
// [base+i*blockSize, base+(i+1)*blockSize).
func BuildBlockDescs(base uint64, numBlocks int, blockSize, devID uint64) List {
	if numBlocks <= 0 {
		return List{}
	}
	l := make(List, numBlocks)
	for i := range l {
		l[i] = Desc{Addr: base + uint64(i)*blockSize, Len: blockSize, DevID: devID}
	}
	return l
}
