package shmview

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"

	"github.com/ecxfer/ecxfer/nixl"
	"golang.org/x/sys/unix"
)

// Region is memory this process allocated as a memfd so that same-host
// peers can map it: Mem is a read-write MAP_SHARED mapping of the file.
type Region struct {
	Mem []byte

	fd       int
	dev, ino uint64
	once     sync.Once
}

// Alloc creates a memfd of size bytes named name (for /proc listings only)
// and maps it read-write.
func Alloc(name string, size int) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shmview: alloc of %d bytes", size)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("shmview: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("shmview: ftruncate(%d): %w", size, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("shmview: fstat: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("shmview: mmap(%d): %w", size, err)
	}
	return &Region{Mem: mem, fd: fd, dev: st.Dev, ino: st.Ino}, nil
}

// Advert describes the region for peers: they open it through this
// process's /proc/<pid>/fd entry. The host and process fields are filled
// in.
func (r *Region) Advert() (Advert, error) {
	a := Advert{
		Kind: KindFile,
		Base: nixl.Addr(r.Mem),
		Size: uint64(len(r.Mem)),
		Path: "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(r.fd),
		Dev:  r.dev,
		Ino:  r.ino,
	}
	if err := Self(&a); err != nil {
		return Advert{}, err
	}
	return a, a.Validate()
}

// FD returns the memfd (for tests that shrink it).
func (r *Region) FD() int { return r.fd }

// Close unmaps the region and closes the memfd. Peers that mapped it keep
// their mappings (the pages live until the last one goes). Idempotent.
func (r *Region) Close() error {
	var err error
	r.once.Do(func() {
		err = unix.Munmap(r.Mem)
		if cerr := unix.Close(r.fd); err == nil {
			err = cerr
		}
		r.Mem = nil
	})
	return err
}

// FileAdvert describes a caller region backed by a file (see Find).
func FileAdvert(region []byte) (Advert, error) {
	b, err := Find(region)
	if err != nil {
		return Advert{}, err
	}
	if b.SysV {
		return Advert{}, fmt.Errorf("%w: System V segment, not a file", ErrNoFile)
	}
	a := Advert{Kind: KindFile, Base: nixl.Addr(region), Size: uint64(len(region)),
		Path: b.Path, Offset: b.Offset, Dev: b.Dev, Ino: b.Ino}
	if err := Self(&a); err != nil {
		return Advert{}, err
	}
	return a, a.Validate()
}

// Describe advertises a region the best way it can be reached: its backing
// file, its System V segment, or else a kernel copy of this process's
// memory.
func Describe(region []byte) (Advert, error) {
	b, err := Find(region)
	if errors.Is(err, ErrNoFile) {
		return ProcAdvert(region)
	}
	if err != nil {
		return Advert{}, err
	}
	a := Advert{Kind: KindFile, Base: nixl.Addr(region), Size: uint64(len(region)),
		Path: b.Path, Offset: b.Offset, Dev: b.Dev, Ino: b.Ino}
	if b.SysV {
		a.Kind, a.Path, a.Dev = KindSysV, "", 0
	}
	if err := Self(&a); err != nil {
		return Advert{}, err
	}
	return a, a.Validate()
}

// ProcAdvert describes a region to be read with a kernel copy.
func ProcAdvert(region []byte) (Advert, error) {
	a := Advert{Kind: KindProc, Base: nixl.Addr(region), Size: uint64(len(region))}
	if err := Self(&a); err != nil {
		return Advert{}, err
	}
	return a, a.Validate()
}

// MapNewFile creates (or truncates) the file at path, sizes it and maps it
// shared and writable: a region like vLLM's, a MAP_SHARED mapping of a
// /dev/shm file. Tests and tools make producers with it.
func MapNewFile(path string, size int) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		return nil, err
	}
	return unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}
