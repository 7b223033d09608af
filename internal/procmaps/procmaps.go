// Package procmaps finds the mappings of a process. Where the kernel has
// the PROCMAP_QUERY ioctl (Linux 6.11), each lookup asks it for the one
// mapping at an address; otherwise the whole /proc/<pid>/maps text is read
// and parsed, once. The text grows with every same-host peer (each maps
// UCX's segments here), so reading it for each new peer made adding n
// peers cost O(n^2).
package procmaps

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Span is one mapping, [Start, End), and what backs it: a file (Dev as
// unix.Mkdev makes it, Ino, and the file offset of Start) or nothing
// (Dev and Ino 0). Name is the path the kernel shows ("" for anonymous
// memory), cut at its first blank (" (deleted)" follows a removed file's).
type Span struct {
	Start, End uint64
	Offset     uint64
	Dev, Ino   uint64
	Name       string
	Writable   bool // mapped with PROT_WRITE
}

// Maps reads one process's mappings.
type Maps struct {
	f     *os.File
	query bool   // PROCMAP_QUERY answers
	spans []Span // the parsed text, once query is off
	name  []byte // the kernel writes a mapping's path here
}

// Open opens the mappings of process who ("self" or a pid). Reading
// another process's needs ptrace read access to it.
func Open(who string) (*Maps, error) {
	f, err := os.Open("/proc/" + who + "/maps")
	if err != nil {
		return nil, err
	}
	return &Maps{f: f, query: true}, nil
}

// Close releases the maps file; a nil Maps is fine.
func (m *Maps) Close() {
	if m != nil {
		_ = m.f.Close()
	}
}

// Within returns the mapping [addr, addr+n) lies inside, or nil.
func (m *Maps) Within(addr, n uint64) (*Span, error) {
	sp, err := m.At(addr)
	if err != nil || sp == nil || addr+n < addr || addr+n > sp.End {
		return nil, err
	}
	return sp, nil
}

// At returns the mapping that covers addr, or nil.
func (m *Maps) At(addr uint64) (*Span, error) {
	if m.query {
		sp, err := m.lookup(addr)
		switch {
		case err == nil:
			return sp, nil
		case errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL):
			m.query = false // a kernel without PROCMAP_QUERY: read the text
		default:
			return nil, err
		}
	}
	if m.spans == nil {
		spans, err := parse(m.f)
		if err != nil {
			return nil, err
		}
		m.spans = spans
	}
	i := sort.Search(len(m.spans), func(i int) bool { return m.spans[i].Start > addr }) - 1
	if i >= 0 && addr < m.spans[i].End {
		sp := m.spans[i]
		return &sp, nil
	}
	return nil, nil
}

// parse parses a maps file's text:
// start-end perms offset major:minor inode [path].
func parse(r io.Reader) ([]Span, error) {
	var out []Span
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 5 {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		maj, mnr, ok2 := strings.Cut(f[3], ":")
		if !ok || !ok2 {
			continue
		}
		s, err1 := strconv.ParseUint(lo, 16, 64)
		e, err2 := strconv.ParseUint(hi, 16, 64)
		off, err3 := strconv.ParseUint(f[2], 16, 64)
		dmaj, err4 := strconv.ParseUint(maj, 16, 32)
		dmin, err5 := strconv.ParseUint(mnr, 16, 32)
		ino, err6 := strconv.ParseUint(f[4], 10, 64)
		if err := errors.Join(err1, err2, err3, err4, err5, err6); err != nil || e <= s {
			continue
		}
		sp := Span{Start: s, End: e, Offset: off, Ino: ino, Writable: len(f[1]) > 1 && f[1][1] == 'w'}
		if ino != 0 {
			sp.Dev = unix.Mkdev(uint32(dmaj), uint32(dmin))
		}
		if len(f) > 5 {
			sp.Name = f[5]
		}
		out = append(out, sp)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("procmaps: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Start < out[j].Start })
	return out, nil
}

// query is the kernel's struct procmap_query (linux/fs.h).
type query struct {
	size, queryFlags, queryAddr                  uint64
	vmaStart, vmaEnd, vmaFlags, vmaPageSize      uint64
	vmaOffset, inode                             uint64
	devMajor, devMinor, vmaNameSize, buildIDSize uint32
	vmaNameAddr, buildIDAddr                     uint64
}

// vmaWritable is PROCMAP_QUERY_VMA_WRITABLE, a bit of vmaFlags.
const vmaWritable = 0x02

// Writable reports whether every byte of [addr, addr+n) is mapped
// writable; if not, it also returns the first address that is not.
func (m *Maps) Writable(addr, n uint64) (bool, uint64, error) {
	end := addr + n
	if end < addr {
		return false, addr, nil
	}
	for at := addr; at < end; {
		sp, err := m.At(at)
		if err != nil {
			return false, at, err
		}
		if sp == nil || !sp.Writable {
			return false, at, nil
		}
		at = sp.End
	}
	return true, 0, nil
}

// queryIoctl is PROCMAP_QUERY: _IOWR('f', 17, struct procmap_query).
const queryIoctl = 3<<30 | uint(unsafe.Sizeof(query{}))<<16 | 'f'<<8 | 17

// lookup asks the kernel for the mapping that covers addr: nil when none
// does.
func (m *Maps) lookup(addr uint64) (*Span, error) {
	if m.name == nil {
		m.name = make([]byte, unix.PathMax)
	}
	q := query{size: uint64(unsafe.Sizeof(query{})), queryAddr: addr,
		vmaNameSize: uint32(len(m.name)), vmaNameAddr: uint64(uintptr(unsafe.Pointer(&m.name[0])))}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, m.f.Fd(), uintptr(queryIoctl), uintptr(unsafe.Pointer(&q)))
	runtime.KeepAlive(m.name)
	switch errno {
	case 0:
	case unix.ENOENT:
		return nil, nil
	default:
		return nil, errno
	}
	sp := &Span{Start: q.vmaStart, End: q.vmaEnd, Offset: q.vmaOffset, Ino: q.inode, Writable: q.vmaFlags&vmaWritable != 0}
	if q.inode != 0 {
		sp.Dev = unix.Mkdev(q.devMajor, q.devMinor)
	}
	if k := int(q.vmaNameSize); k > 0 && k <= len(m.name) {
		// NUL-terminated; the text shows the path up to its first blank.
		name := string(m.name[:k-1])
		if i := strings.IndexByte(name, ' '); i >= 0 {
			name = name[:i]
		}
		sp.Name = name
	}
	return sp, nil
}
