package ucx

/*
#include <stdlib.h>
#include "ecx.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ---------------------------------------------------------------- memory

// RegisterMem registers caller memory (outside the Go heap) with
// ucp_mem_map. Regions may not overlap one another.
func (a *Agent) RegisterMem(buf []byte, mem nixl.MemType, devID uint64) (nixl.MemID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckRegister(buf, mem); err != nil {
		return 0, err
	}
	addr := nixl.Addr(buf)
	if err := a.mems.CheckOverlap(addr, uint64(len(buf))); err != nil {
		return 0, err
	}
	var memh C.ucp_mem_h
	var out unsafe.Pointer
	st := C.ecx_mem_map(a.c, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), 0, &memh, &out)
	if st != 0 {
		return 0, ucsErr(st, "ucx: mem_map")
	}
	return a.addMem(memh, addr, uint64(len(buf)))
}

// AllocMem allocates memory through UCX (UCP_MEM_MAP_ALLOCATE), which on
// shared-memory transports lets peers read it without this agent
// progressing. The pages are touched before it returns.
func (a *Agent) AllocMem(length int, mem nixl.MemType, devID uint64) (nixl.MemID, []byte, error) {
	if a.closed {
		return 0, nil, errClosed
	}
	if err := kit.CheckAlloc(length, mem); err != nil {
		return 0, nil, err
	}
	var memh C.ucp_mem_h
	var out unsafe.Pointer
	st := C.ecx_mem_map(a.c, nil, C.size_t(length), 1, &memh, &out)
	if st != 0 {
		return 0, nil, ucsErr(st, "ucx: mem_map(allocate)")
	}
	addr := uint64(uintptr(out))
	if err := a.mems.CheckOverlap(addr, uint64(length)); err != nil {
		C.ecx_mem_unmap(a.c, memh)
		return 0, nil, err
	}
	id, err := a.addMem(memh, addr, uint64(length))
	if err != nil {
		return 0, nil, err
	}
	return id, unsafe.Slice((*byte)(out), length), nil
}

func (a *Agent) addMem(memh C.ucp_mem_h, addr, n uint64) (nixl.MemID, error) {
	buf := C.malloc(maxRkeyLen)
	rl := C.ecx_rkey_pack(a.c, memh, buf, maxRkeyLen)
	if rl <= 0 {
		C.free(buf)
		C.ecx_mem_unmap(a.c, memh)
		return 0, ucsErr(C.int(rl), "ucx: rkey_pack")
	}
	m := &memRegion{Region: enginekit.Region{ID: nixl.MemID(a.ids.Next()), Addr: addr, Len: n}, memh: memh,
		rkey: C.GoBytes(buf, C.int(rl))}
	C.free(buf)
	if st := C.ecx_region_add(a.c, C.uint64_t(addr), C.uint64_t(n)); st != 0 {
		C.ecx_mem_unmap(a.c, memh)
		return 0, ucsErr(st, "ucx: region")
	}
	a.mems.Add(m)
	return m.ID, nil
}

// DeregisterMem implements nixl.Agent.
func (a *Agent) DeregisterMem(id nixl.MemID) error {
	if a.closed {
		return errClosed
	}
	m, err := a.mems.Removable(id)
	if err != nil {
		return err
	}
	// Gather requests read it no more from here on (they are answered
	// inside the engine's progress, on this goroutine). Answers already
	// sent out of it may still be read by their sends: the engine is
	// driven until they have called back, for closeWait at most; after
	// that the region stays registered and the call fails (a reader that
	// stopped taking its answers holds them).
	C.ecx_region_del(a.c, C.uint64_t(m.Addr))
	if !a.answersDone(m.Addr, m.Len) {
		if st := C.ecx_region_add(a.c, C.uint64_t(m.Addr), C.uint64_t(m.Len)); st != 0 {
			return ucsErr(st, "ucx: region")
		}
		return fmt.Errorf("%w: answers to a reader's gathered READ still being sent out of region %d",
			nixl.ErrNotAllowed, id)
	}
	a.mems.Remove(id)
	if st := C.ecx_mem_unmap(a.c, m.memh); st != 0 {
		return ucsErr(st, "ucx: mem_unmap")
	}
	return nil
}

// answersDone drives the engine until no gather answer sent out of
// registered memory reads [addr, addr+n), within closeWait; whether none
// does.
func (a *Agent) answersDone(addr, n uint64) bool {
	deadline := time.Now().Add(closeWait)
	for C.ecx_region_busy(a.c, C.uint64_t(addr), C.uint64_t(n)) != 0 {
		if !time.Now().Before(deadline) {
			return false
		}
		if _, err := a.Progress(); err != nil {
			return false
		}
	}
	return true
}
