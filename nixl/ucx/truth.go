package ucx

/*
#include "ecx.h"
*/
import "C"

import (
	"strconv"
	"strings"
	"unsafe"

	"github.com/ecxfer/ecxfer/internal/procmaps"
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

// ucxSegment reports whether a mapping's path names a segment UCX
// allocates: System V (/SYSV<key>) or its POSIX shared-memory files.
func ucxSegment(name string) bool {
	return strings.HasPrefix(name, "/SYSV") || strings.HasPrefix(name, "/dev/shm/ucx_shm_posix_")
}

// callerRegions reads the mappings of m's process and reports, by region,
// which regions are caller memory: inside one mapping that is not a UCX
// segment. Those regions are checked here; a region inside no single
// mapping refuses the peer.
func callerRegions(m *metadata) ([]bool, []procmaps.Span, error) {
	theirs, err := procmaps.Open(strconv.FormatUint(m.Pid, 10))
	if err != nil {
		return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
	}
	defer theirs.Close()
	caller := make([]bool, len(m.Region))
	spans := make([]procmaps.Span, len(m.Region))
	for i, r := range m.Region {
		sp, err := theirs.Within(r.Addr, r.Len)
		if err != nil {
			return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
		}
		if sp == nil {
			return nil, nil, truthErr(m, i, r, "it is not mapped in the peer process")
		}
		caller[i] = !ucxSegment(sp.Name)
		spans[i] = *sp
	}
	return caller, spans, nil
}

// checkTruth checks the regions of m, a peer on this host whose rkeys are
// unpacked in rk, against the mappings behind them; regions marked in
// caller were checked by callerRegions (their rkeys are not unpacked yet),
// which found the peer's mapping of each region (theirs). A shared-memory
// rkey must attach here the very segment the peer maps at the region's
// address, at the same offset: the key is the peer's word too, and one
// naming another process's segment (System V ids are listed in
// /proc/sysvipc/shm) would make READs of the peer's region return that
// process's memory.
func checkTruth(m *metadata, rk []C.ucp_rkey_h, caller []bool, theirSpans []procmaps.Span) error {
	var self, theirs *procmaps.Maps
	defer func() { self.Close(); theirs.Close() }()
	for i, r := range m.Region {
		if caller != nil && caller[i] {
			continue
		}
		var ptr unsafe.Pointer
		if C.ecx_rkey_ptr(rk[i], C.uint64_t(r.Addr), &ptr) == C.UCS_OK {
			if self == nil {
				var err error
				if self, err = procmaps.Open("self"); err != nil {
					return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q: cannot check its regions: %v", m.Name, err)
				}
			}
			sp, err := self.Within(uint64(uintptr(ptr)), r.Len)
			if err != nil {
				return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q: cannot check its regions: %v", m.Name, err)
			}
			if sp == nil {
				return truthErr(m, i, r, "the shared-memory segment behind it is smaller")
			}
			if ts := theirSpans[i]; sp.Dev != ts.Dev || sp.Ino != ts.Ino ||
				uint64(uintptr(ptr))-sp.Start+sp.Offset != r.Addr-ts.Start+ts.Offset {
				return truthErr(m, i, r, "its key attaches another shared-memory segment than the one the peer maps there")
			}
			continue
		}
		if theirs == nil {
			var err error
			if theirs, err = procmaps.Open(strconv.FormatUint(m.Pid, 10)); err != nil {
				return nixl.Errorf(nixl.ErrInvalidParam, "ucx: peer %q (pid %d): cannot check its regions: %v", m.Name, m.Pid, err)
			}
		}
		sp, err := theirs.Within(r.Addr, r.Len)
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
