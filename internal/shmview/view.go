package shmview

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/procmaps"
)

// ErrIdentity reports a file that is not the one advertised, or too small
// for the advertised window.
var ErrIdentity = errors.New("shmview: advertised file does not match")

// View is a read-only mapping of a peer's region. It is reference counted:
// the opener holds one reference, each copy that Acquires it another, and
// the mapping goes away when the last is released.
type View struct {
	sysv bool // mem is a System V attachment, not an mmap
	adv  Advert
	mem  []byte // the whole mapping, page aligned
	data []byte // the region: data[0] is the byte at adv.Base
	skew uint64 // data[0] is mem[skew]
	refs atomic.Int64
	shut atomic.Bool
}

// mapped counts the views currently mapped in this process (leak checks).
var mapped atomic.Int64

// Mapped returns how many views are mapped right now.
func Mapped() int64 { return mapped.Load() }

// Open maps an advertised file region read-only. The opened file must have
// the advertised identity and hold the whole window, and the advertised
// process must map that window at the advertised address.
func Open(a *Advert) (*View, error) {
	if err := a.Validate(); err != nil {
		return nil, err
	}
	if uint64(int(a.Size)) != a.Size || int(a.Size) < 0 {
		return nil, fmt.Errorf("%w: region of %d bytes", ErrBadAdvert, a.Size)
	}
	switch a.Kind {
	case KindSysV:
		return openSysV(a)
	case KindFile:
	default:
		return nil, fmt.Errorf("%w: %s advertisement has no file", ErrNoFile, a.Kind)
	}
	// The path is the peer's word: look at what it names through an
	// O_PATH descriptor, which opens nothing (a FIFO would block a plain
	// open, a device could act on it), and open the file for reading only
	// once it is known to be the advertised regular file.
	pfd, err := unix.Open(a.Path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shmview: open %s: %w", a.Path, err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return nil, fmt.Errorf("shmview: fstat %s: %w", a.Path, err)
	}
	switch {
	case st.Dev != a.Dev || st.Ino != a.Ino:
		return nil, fmt.Errorf("%w: %s is (%#x, %d), advertised (%#x, %d)", ErrIdentity, a.Path, st.Dev, st.Ino, a.Dev, a.Ino)
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrIdentity, a.Path)
	case st.Size < 0 || uint64(st.Size) < a.Offset+a.Size:
		return nil, fmt.Errorf("%w: %s has %d bytes, window ends at %d", ErrIdentity, a.Path, st.Size, a.Offset+a.Size)
	}
	if err := a.mappedBy(); err != nil {
		return nil, err
	}
	// Reopened through the O_PATH descriptor: the same inode, whatever
	// the path names by now. O_NONBLOCK: a lease the producer holds on
	// its file fails the open at once (EWOULDBLOCK) instead of holding it
	// for the kernel's lease-break time (45 s by default).
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", pfd), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("shmview: open %s: %w", a.Path, err)
	}
	defer unix.Close(fd)
	page := uint64(os.Getpagesize())
	skew := a.Offset % page
	mem, err := unix.Mmap(fd, int64(a.Offset-skew), int(a.Size+skew), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shmview: mmap %s: %w", a.Path, err)
	}
	v := &View{adv: *a, mem: mem, data: mem[skew : skew+a.Size : skew+a.Size], skew: skew}
	v.refs.Store(1)
	mapped.Add(1)
	return v, nil
}

// Advert returns the advertisement the view was opened from.
func (v *View) Advert() Advert { return v.adv }

// Bytes returns the whole mapped region. It is valid while the caller
// holds a reference.
func (v *View) Bytes() []byte { return v.data }

// Slice returns the n bytes at producer address addr, or false when they
// are not all inside the advertised region.
func (v *View) Slice(addr, n uint64) ([]byte, bool) {
	off := addr - v.adv.Base
	if addr < v.adv.Base || off > v.adv.Size || n > v.adv.Size-off {
		return nil, false
	}
	return v.data[off : off+n : off+n], true
}

// Contains reports whether [addr, addr+n) is inside the advertised region.
func (a *Advert) Contains(addr, n uint64) bool {
	off := addr - a.Base
	return addr >= a.Base && off <= a.Size && n <= a.Size-off
}

// Acquire takes a reference for a copy. It fails once Close has been
// called: a closed view accepts no new copies.
func (v *View) Acquire() bool {
	for {
		n := v.refs.Load()
		if n <= 0 || v.shut.Load() {
			return false
		}
		if v.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Release drops a reference taken by Acquire.
func (v *View) Release() {
	switch n := v.refs.Add(-1); {
	case n == 0:
		if v.sysv {
			_ = unix.SysvShmDetach(v.mem)
		} else {
			_ = unix.Munmap(v.mem)
		}
		mapped.Add(-1)
	case n < 0:
		panic("shmview: View released more often than acquired")
	}
}

// Close drops the opener's reference: no new copies may start, and the
// mapping goes once the running ones end. Idempotent.
func (v *View) Close() {
	if !v.shut.Swap(true) {
		v.Release()
	}
}

// openSysV attaches a System V segment read-only, after checking that the
// segment was created by the advertised process (a shmid is reused once a
// segment is gone) and holds the whole window, and that the advertised
// process maps it at Base: a segment outlives its creator, whose pid may
// name another process by now, and a creator's pid alone would let any
// process advertise a segment it cannot read itself.
func openSysV(a *Advert) (*View, error) {
	id := int(a.Ino)
	var ds unix.SysvShmDesc
	if _, err := unix.SysvShmCtl(id, unix.IPC_STAT, &ds); err != nil {
		return nil, fmt.Errorf("shmview: shmctl(%d, IPC_STAT): %w", id, err)
	}
	switch {
	case uint32(ds.Cpid) != a.PID:
		return nil, fmt.Errorf("%w: segment %d was created by pid %d, advertised %d", ErrIdentity, id, ds.Cpid, a.PID)
	case ds.Segsz < a.Offset+a.Size:
		return nil, fmt.Errorf("%w: segment %d has %d bytes, window ends at %d", ErrIdentity, id, ds.Segsz, a.Offset+a.Size)
	}
	mem, err := unix.SysvShmAttach(id, 0, unix.SHM_RDONLY)
	if err != nil {
		return nil, fmt.Errorf("shmview: shmat(%d): %w", id, err)
	}
	if uint64(len(mem)) < a.Offset+a.Size {
		_ = unix.SysvShmDetach(mem)
		return nil, fmt.Errorf("%w: segment %d shrank", ErrIdentity, id)
	}
	if err := a.mapsSegment(mem); err != nil {
		_ = unix.SysvShmDetach(mem)
		return nil, err
	}
	v := &View{sysv: true, adv: *a, mem: mem, data: mem[a.Offset : a.Offset+a.Size : a.Offset+a.Size], skew: a.Offset}
	v.refs.Store(1)
	mapped.Add(1)
	return v, nil
}

// Populate maps now the pages that hold the given blocks of the region
// (MADV_POPULATE_READ, Linux 5.14), so READs do not pay a page fault on
// the first touch of each page; where the kernel cannot, they fault in as
// they are read. Only those pages: a peer may advertise a region far
// larger than the blocks its list names. Blocks outside the region are
// skipped. Only pages the region's file already holds are mapped: a page
// the producer never wrote (a hole of a sparse /dev/shm file, as vLLM's
// region is until its blocks are filled) is left alone, since faulting it
// in would allocate it in the producer's file, charged to this process's
// memory cgroup; a READ of such a block still faults it in. It returns how
// many bytes it asked the kernel to map.
func (v *View) Populate(descs descriptors.List) uint64 {
	page := uint64(os.Getpagesize())
	spans := make([][2]uint64, 0, 1)
	sorted := true
	for _, d := range descs {
		if d.Len == 0 || !v.adv.Contains(d.Addr, d.Len) {
			continue
		}
		off := v.skew + d.Addr - v.adv.Base
		s := [2]uint64{off &^ (page - 1), min((off+d.Len+page-1)&^(page-1), uint64(len(v.mem)))}
		if n := len(spans); n > 0 {
			last := &spans[n-1]
			if s[0] >= last[0] && s[0] <= last[1] {
				last[1] = max(last[1], s[1])
				continue
			}
			sorted = sorted && s[0] > last[1]
		}
		spans = append(spans, s)
	}
	if !sorted {
		slices.SortFunc(spans, func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
		out := spans[:0]
		for _, s := range spans {
			if n := len(out); n > 0 && s[0] <= out[n-1][1] {
				out[n-1][1] = max(out[n-1][1], s[1])
				continue
			}
			out = append(out, s)
		}
		spans = out
	}
	var total uint64
	vec := make([]byte, (min(populateChunk, uint64(len(v.mem)))+page-1)/page)
	for _, s := range spans {
		for at := s[0]; at < s[1]; {
			end := min(at+populateChunk, s[1])
			total += populateResident(v.mem[at:end], vec, page)
			at = end
		}
	}
	return total
}

// populateChunk bounds the span populateResident looks at in one mincore
// call (its vector: one byte per page).
const populateChunk = 64 << 20

// populateResident maps the runs of pages of mem (page aligned) that are in
// the page cache, as mincore(2) reports them, and returns their bytes.
// Where mincore fails, nothing is mapped: READs fault pages in.
func populateResident(mem, vec []byte, page uint64) uint64 {
	n := (uint64(len(mem)) + page - 1) / page
	vec = vec[:n]
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)),
		uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return 0
	}
	var total uint64
	for i := uint64(0); i < n; {
		if vec[i]&1 == 0 {
			i++
			continue
		}
		j := i + 1
		for j < n && vec[j]&1 != 0 {
			j++
		}
		lo, hi := i*page, min(j*page, uint64(len(mem)))
		_ = unix.Madvise(mem[lo:hi], unix.MADV_POPULATE_READ)
		total += hi - lo
		i = j
	}
	return total
}

// mapsSegment checks, for a System V advertisement, that the advertised
// process maps at Base the segment this process attached at mem: the same
// device and inode (the shmid) as this process's own mapping shows, at the
// advertised offset (mappedBy).
func (a *Advert) mapsSegment(mem []byte) error {
	self, err := procmaps.Open("self")
	if err != nil {
		return fmt.Errorf("%w: cannot read this process's mappings: %v", ErrIdentity, err)
	}
	defer self.Close()
	sp, err := self.At(uint64(uintptr(unsafe.Pointer(&mem[0]))))
	if err != nil || sp == nil || sp.Ino != a.Ino {
		return fmt.Errorf("%w: cannot find this process's attachment of segment %d (%v)", ErrIdentity, a.Ino, err)
	}
	b := *a
	b.Dev = sp.Dev
	return b.mappedBy()
}

// mappedBy checks that the advertised process maps the advertised file
// window at Base: every mapping of [Base, Base+Size) in it is of that file
// (device and inode) at the matching offset. Otherwise the advertisement
// could point this process at any file it may read (another tenant's
// region, a file of its own) and READs would hand that out as the
// producer's blocks. A process whose mappings cannot be read is refused.
func (a *Advert) mappedBy() error {
	m, err := procmaps.Open(strconv.FormatUint(uint64(a.PID), 10))
	if err != nil {
		return fmt.Errorf("%w: cannot read the mappings of process %d: %v", ErrIdentity, a.PID, err)
	}
	defer m.Close()
	// The pid may have been reused since the caller checked it: what is
	// open now are the mappings of the process that has the pid now,
	// which must still be the advertised one.
	if !a.Alive() {
		return fmt.Errorf("%w: process %d (start %d) is gone", ErrIdentity, a.PID, a.Start)
	}
	for addr, end := a.Base, a.Base+a.Size; addr < end; {
		sp, err := m.At(addr)
		if err != nil {
			return fmt.Errorf("%w: cannot read the mappings of process %d: %v", ErrIdentity, a.PID, err)
		}
		if sp == nil {
			return fmt.Errorf("%w: process %d maps nothing at %#x, inside its advertised region", ErrIdentity, a.PID, addr)
		}
		if sp.Dev != a.Dev || sp.Ino != a.Ino || sp.Offset+(addr-sp.Start) != a.Offset+(addr-a.Base) {
			return fmt.Errorf("%w: process %d maps (%#x, %d) at offset %d at %#x, advertised %s (%#x, %d) at offset %d",
				ErrIdentity, a.PID, sp.Dev, sp.Ino, sp.Offset+(addr-sp.Start), addr, a.Path, a.Dev, a.Ino, a.Offset+(addr-a.Base))
		}
		addr = sp.End
	}
	return nil
}
