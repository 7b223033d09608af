package ucx

/*
#include "ecx.h"
*/
import "C"

import (
	"bufio"
	"errors"
	"io"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
)

// Bounds from the truth, not from the metadata. The metadata checksum is
// no secret: a blob can claim a region larger than the memory behind it,
// and PrepDlist only checks descriptors against what the blob claims. For a
// peer on this host a READ outside the real region would touch memory of
// this process (a shared-memory segment is mapped here and read with a
// plain copy: past its end lies whatever is mapped next, or nothing, and
// the copy faults), so each advertised region is checked, once, against
// the mappings that really back it:
//
//   - a region whose rkey maps it here (ucp_rkey_ptr: UCX-allocated memory
//     over sysv or posix) must lie inside one mapping of this process, the
//     segment UCX attached;
//   - any other region (caller memory, read with cma or emulated gets)
//     must lie inside one mapping of the peer process (/proc/<pid>/maps;
//     its pid was just checked through its pidfd and start time).
//
// A region that fails, or whose mappings cannot be read, refuses the peer
// (ErrInvalidParam). For a peer on another host the data owner executes
// every get against its own memory, so a lie cannot make this process
// touch anything but the local blocks it named: such regions are not
// checked.
//
// Caller memory is told apart from UCX segments by the peer's own mappings
// (the path of the mapping a region lies in), before any rkey is unpacked:
// its rkeys are unpacked only when the first transfer needs them (see
// unpackDeferred).

// span is one mapping of a /proc/<pid>/maps file, [start, end), and the
// path it maps ("" for anonymous memory).
type span struct {
	start, end uint64
	name       string
}

// parseMaps parses a maps file's text.
func parseMaps(r io.Reader) ([]span, error) {
	var out []span
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		// start-end perms offset dev inode [path]
		f := strings.Fields(sc.Text())
		if len(f) < 5 {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		s, err1 := strconv.ParseUint(lo, 16, 64)
		e, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || e <= s {
			continue
		}
		var name string
		if len(f) > 5 {
			name = f[5]
		}
		out = append(out, span{s, e, name})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].start < out[j].start })
	return out, nil
}

// procMaps finds the mappings of one process. Where the kernel has the
// PROCMAP_QUERY ioctl (Linux 6.11), each lookup asks it for the one
// mapping at an address; otherwise the whole maps text is read and parsed,
// once. The text grows with every peer (each maps UCX's segments here), so
// reading it for each new peer made adding n peers cost O(n^2): at 256
// same-host peers, most of AddRemotePeer's time.
type procMaps struct {
	f     *os.File
	query bool   // PROCMAP_QUERY answers
	spans []span // the parsed text, once query is off
	name  []byte // the kernel writes a mapping's path here
}

func openMaps(who string) (*procMaps, error) {
	f, err := os.Open("/proc/" + who + "/maps")
	if err != nil {
		return nil, err
	}
	return &procMaps{f: f, query: true}, nil
}

func (m *procMaps) close() {
	if m != nil {
		_ = m.f.Close()
	}
}

// within returns the mapping [addr, addr+n) lies inside, or nil.
func (m *procMaps) within(addr, n uint64) (*span, error) {
	if m.query {
		sp, err := m.lookup(addr)
		switch {
		case err == nil:
			if sp == nil || addr+n < addr || addr+n > sp.end {
				return nil, nil
			}
			return sp, nil
		case errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL):
			m.query = false // a kernel without PROCMAP_QUERY: read the text
		default:
			return nil, err
		}
	}
	if m.spans == nil {
		spans, err := parseMaps(m.f)
		if err != nil {
			return nil, err
		}
		m.spans = spans
	}
	return within(m.spans, addr, n), nil
}

// procmapQuery is the kernel's struct procmap_query (linux/fs.h).
type procmapQuery struct {
	size, queryFlags, queryAddr                  uint64
	vmaStart, vmaEnd, vmaFlags, vmaPageSize      uint64
	vmaOffset, inode                             uint64
	devMajor, devMinor, vmaNameSize, buildIDSize uint32
	vmaNameAddr, buildIDAddr                     uint64
}

// procmapQueryIoctl is PROCMAP_QUERY: _IOWR('f', 17, struct procmap_query).
const procmapQueryIoctl = 3<<30 | uint(unsafe.Sizeof(procmapQuery{}))<<16 | 'f'<<8 | 17

// lookup asks the kernel for the mapping that covers addr: nil when none
// does.
func (m *procMaps) lookup(addr uint64) (*span, error) {
	if m.name == nil {
		m.name = make([]byte, unix.PathMax)
	}
	q := procmapQuery{size: uint64(unsafe.Sizeof(procmapQuery{})), queryAddr: addr,
		vmaNameSize: uint32(len(m.name)), vmaNameAddr: uint64(uintptr(unsafe.Pointer(&m.name[0])))}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, m.f.Fd(), uintptr(procmapQueryIoctl), uintptr(unsafe.Pointer(&q)))
	runtime.KeepAlive(m.name)
	switch errno {
	case 0:
	case unix.ENOENT:
		return nil, nil
	default:
		return nil, errno
	}
	sp := &span{start: q.vmaStart, end: q.vmaEnd}
	if k := int(q.vmaNameSize); k > 0 && k <= len(m.name) {
		// NUL-terminated; the text shows the path up to its first blank
		// (" (deleted)" follows a removed file's).
		name := string(m.name[:k-1])
		if i := strings.IndexByte(name, ' '); i >= 0 {
			name = name[:i]
		}
		sp.name = name
	}
	return sp, nil
}

// within returns the mapping [addr, addr+n) lies inside, or nil.
func within(maps []span, addr, n uint64) *span {
	end := addr + n
	if end < addr {
		return nil
	}
	i := sort.Search(len(maps), func(i int) bool { return maps[i].start > addr }) - 1
	if i >= 0 && end <= maps[i].end {
		return &maps[i]
	}
	return nil
}

// ucxSegment reports whether a mapping's path names a segment UCX
// allocates: System V (/SYSV<key>) or its POSIX shared-memory files.
func ucxSegment(name string) bool {
	return strings.HasPrefix(name, "/SYSV") || strings.HasPrefix(name, "/dev/shm/ucx_shm_posix_")
}

// callerRegions reads the mappings of m's process and reports, by region,
// which regions are caller memory: inside one mapping that is not a UCX
// segment. Those regions are checked here; a region inside no single
// mapping refuses the peer.
func callerRegions(m *metadata) ([]bool, error) {
	theirs, err := openMaps(strconv.FormatUint(m.Pid, 10))
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
	}
	defer theirs.close()
	caller := make([]bool, len(m.Region))
	for i, r := range m.Region {
		sp, err := theirs.within(r.Addr, r.Len)
		if err != nil {
			return nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
		}
		if sp == nil {
			return nil, truthErr(m, i, r, "it is not mapped in the peer process")
		}
		caller[i] = !ucxSegment(sp.name)
	}
	return caller, nil
}

// checkTruth checks the regions of m, a peer on this host whose rkeys are
// unpacked in rk, against the mappings behind them; regions marked in
// caller were checked by callerRegions (their rkeys are not unpacked yet).
func checkTruth(m *metadata, rk []C.ucp_rkey_h, caller []bool) error {
	var self, theirs *procMaps
	defer func() { self.close(); theirs.close() }()
	for i, r := range m.Region {
		if caller != nil && caller[i] {
			continue
		}
		var ptr unsafe.Pointer
		if C.ecx_rkey_ptr(rk[i], C.uint64_t(r.Addr), &ptr) == C.UCS_OK {
			if self == nil {
				var err error
				if self, err = openMaps("self"); err != nil {
					return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q: cannot check its regions: %v", m.Name, err)
				}
			}
			sp, err := self.within(uint64(uintptr(ptr)), r.Len)
			if err != nil {
				return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q: cannot check its regions: %v", m.Name, err)
			}
			if sp == nil {
				return truthErr(m, i, r, "the shared-memory segment behind it is smaller")
			}
			continue
		}
		if theirs == nil {
			var err error
			if theirs, err = openMaps(strconv.FormatUint(m.Pid, 10)); err != nil {
				return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
			}
		}
		sp, err := theirs.within(r.Addr, r.Len)
		if err != nil {
			return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
		}
		if sp == nil {
			return truthErr(m, i, r, "it is not mapped in the peer process")
		}
	}
	return nil
}

func truthErr(m *metadata, i int, r region, why string) error {
	return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q region %d [%#x,+%d): %s",
		m.Name, i, r.Addr, r.Len, why)
}
