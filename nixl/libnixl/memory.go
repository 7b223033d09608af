package libnixl

/*
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ---------------------------------------------------------------- memory

// RegisterMem implements nixl.Agent: the region is registered with NIXL's
// UCX backend. Regions may not overlap one another.
func (a *Agent) RegisterMem(buf []byte, mem nixl.MemType, devID uint64) (nixl.MemID, error) {
	if a.closed {
		return 0, errClosed
	}
	if err := kit.CheckRegister(buf, mem); err != nil {
		return 0, err
	}
	return a.register(buf, devID, nil)
}

func (a *Agent) register(buf []byte, devID uint64, mapped []byte) (nixl.MemID, error) {
	addr := nixl.Addr(buf)
	n := uint64(len(buf))
	if err := a.mems.CheckOverlap(addr, n); err != nil {
		return 0, err
	}
	st := C.ecx_dl_mem_register(a.lib.c, a.c, C.uint64_t(addr), C.uint64_t(n), C.uint64_t(devID))
	if err := codeErr(int32(st), "registering %d bytes", n); err != nil {
		return 0, err
	}
	m := &region{Region: enginekit.Region{ID: nixl.MemID(a.ids.Next()), Addr: addr, Len: n}, dev: devID, mapped: mapped}
	a.mems.Add(m)
	return m.ID, nil
}

// AllocMem implements nixl.Agent. NIXL does not allocate memory, so the
// region is an anonymous mapping, populated up front (a first touch of a
// page during a transfer costs a fault), then registered.
func (a *Agent) AllocMem(length int, mem nixl.MemType, devID uint64) (nixl.MemID, []byte, error) {
	if a.closed {
		return 0, nil, errClosed
	}
	if err := kit.CheckAlloc(length, mem); err != nil {
		return 0, nil, err
	}
	buf, err := unix.Mmap(-1, 0, length, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return 0, nil, nixl.Errorf(nixl.ErrBackend, "libnixl: mmap %d bytes: %v", length, err)
	}
	id, err := a.register(buf, devID, buf)
	if err != nil {
		_ = unix.Munmap(buf)
		return 0, nil, err
	}
	return id, buf, nil
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
	a.mems.Remove(id)
	return a.unregister(m)
}

func (a *Agent) unregister(m *region) error {
	st := C.ecx_dl_mem_deregister(a.lib.c, a.c, C.uint64_t(m.Addr), C.uint64_t(m.Len), C.uint64_t(m.dev))
	err := codeErr(int32(st), "deregistering memory %d", m.ID)
	if m.mapped != nil {
		_ = unix.Munmap(m.mapped)
		m.mapped = nil
	}
	return err
}
