package ucx

/*
#include "ecx.h"
*/
import "C"

import (
	"unsafe"

	"github.com/ecxfer/ecxfer/nixl"
)

// GatherCounts implements nixl.GatherCounter.
func (a *Agent) GatherCounts() nixl.GatherCounts {
	if a.c == nil {
		return a.gstats
	}
	return gatherCountsOf(&a.c.gstats)
}

func gatherCountsOf(s *C.ecx_gather_stats_t) nixl.GatherCounts {
	return nixl.GatherCounts{Served: uint64(s.served), Busy: uint64(s.busy), Refused: uint64(s.refused),
		Dropped: uint64(s.dropped), Late: uint64(s.late), Bad: uint64(s.bad), Retries: uint64(s.retries),
		ZeroCopy: uint64(s.zc_chunks), Copied: uint64(s.copy_chunks)}
}

// gbufCache is how many answer buffers of a full request's size an owner
// keeps for reuse (ECX_GBUF_CACHE).
const gbufCache = C.ECX_GBUF_CACHE

// gbufStats reports how many full-size answer buffers the owner allocated
// in its life and how many it keeps now (tests).
func (a *Agent) gbufStats() (allocs uint64, kept uint32) {
	return uint64(a.c.gbuf_allocs), uint32(a.c.ngfree)
}

// failSendsForTest makes a's gathered READs fail their endpoint inside
// their sends (the error handler runs there, as UCX runs it when a send
// finds the peer's connection gone).
func (a *Agent) failSendsForTest(on bool) {
	a.c.test_fail_sends = 0
	if on {
		a.c.test_fail_sends = 1
	}
}

// gatherChunkForTest makes every gathered READ posted from now on ask
// its answers in chunks of size bytes (0: as the two agents' segments
// say), whatever the peer takes (tests).
func (a *Agent) gatherChunkForTest(size uint32) { a.c.test_gather_chunk = C.uint32_t(size) }

// listFaults counts posts found already queued when put on the ready list
// or the completion queue again (tests: always 0).
func (a *Agent) listFaults() uint64 { return uint64(a.c.list_faults) }

// gatherCheck is the owner's check of a gather request (ecx_gather_check)
// whose ranges are n little-endian address and length pairs: 0, or the
// status the request is refused with. A request whose ranges do not fill
// exactly n pairs is refused as the handler refuses it.
func (a *Agent) gatherCheck(ranges []byte, n uint32, bytes uint64) int {
	if uint64(len(ranges)) != uint64(n)*16 || n == 0 {
		return int(C.UCS_ERR_INVALID_PARAM)
	}
	return int(C.ecx_gather_check(a.c, unsafe.Pointer(&ranges[0]), C.uint32_t(n), C.uint64_t(bytes)))
}

// gatherReqPlan is what the owner's handler makes of a request whose
// header and ranges arrive as given (ecx_gather_req_plan): dropped unread
// (a header of the wrong size), or its status (0 to serve it) and, when
// served, its answer chunks, the bytes it copies into the answers' buffer
// and the chunks it sends from registered memory.
func (a *Agent) gatherReqPlan(header, ranges []byte) (dropped bool, st int, nch uint32, copied uint64, zc uint32) {
	var h, r unsafe.Pointer
	if len(header) > 0 {
		h = unsafe.Pointer(&header[0])
	}
	if len(ranges) > 0 {
		r = unsafe.Pointer(&ranges[0])
	}
	var cn, cz C.uint32_t
	var cc C.uint64_t
	got := C.ecx_gather_req_plan(a.c, h, C.size_t(len(header)), r, C.size_t(len(ranges)), &cn, &cc, &cz)
	if got == C.ECX_GREQ_DROPPED {
		return true, 0, 0, 0, 0
	}
	return false, int(got), uint32(cn), uint64(cc), uint32(cz)
}

// gatherInject hands an answer to the consumer's handler as if it had
// arrived (tests and fuzzing: a hostile producer's answers).
func (a *Agent) gatherInject(header, data []byte) {
	var h, d unsafe.Pointer
	if len(header) > 0 {
		h = unsafe.Pointer(&header[0])
	}
	if len(data) > 0 {
		d = unsafe.Pointer(&data[0])
	}
	C.ecx_gather_inject(a.c, h, C.size_t(len(header)), d, C.size_t(len(data)))
}

// answerChunks reports how many gather answers the owner sent out of its
// registered memory and how many it copied into an answer buffer first
// (tests).
func (a *Agent) answerChunks() (zeroCopy, copied uint64) {
	return uint64(a.c.gstats.zc_chunks), uint64(a.c.gstats.copy_chunks)
}

// answersReading reports whether an answer sent out of registered memory
// still reads some of [addr, addr+n) (tests).
func (a *Agent) answersReading(addr, n uint64) bool {
	return C.ecx_region_busy(a.c, C.uint64_t(addr), C.uint64_t(n)) != 0
}
