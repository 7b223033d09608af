package ucx

/*
#include <stdlib.h>
#include "ecx.h"
*/
import "C"

import (
	"unsafe"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ----------------------------------------------------------- notifications

// The C handler's limit is MaxNotif's (both differences must be >= 0).
var (
	_ [C.ECX_NOTIF_MAX_PAYLOAD - enginekit.MaxNotifLimit]struct{}
	_ [enginekit.MaxNotifLimit - C.ECX_NOTIF_MAX_PAYLOAD]struct{}
)

// SendNotif implements nixl.Agent.
func (a *Agent) SendNotif(peerName string, msg []byte) error {
	if a.closed {
		return errClosed
	}
	p, err := enginekit.LivePeer(kit, a.peers, peerName)
	if err != nil {
		return err
	}
	if !a.cfg.oversizeNotifs {
		if err := kit.CheckNotif(len(msg), a.cfg.MaxNotif); err != nil {
			return err
		}
	}
	var buf unsafe.Pointer
	if len(msg) > 0 {
		buf = C.CBytes(msg)
	}
	st := C.ecx_send_notif(a.c, p.ep, buf, C.uint32_t(len(msg)), &p.notifTo)
	C.free(buf)
	return ucsErr(st, "ucx: send notification")
}

// GetNotifs implements nixl.Agent.
func (a *Agent) GetNotifs(dst map[string][][]byte) int {
	a.pidPolled = false // a new round (PostXfer)
	if a.closed || a.c.notif_head == nil {
		return 0
	}
	list := C.ecx_notif_take(a.c)
	n := 0
	for e := list; e != nil; e = e.next {
		data := unsafe.Add(unsafe.Pointer(e), C.ECX_NOTIF_DATA_OFF)
		if e.frag != 0 {
			name, msg, ok := a.frags.add(unsafe.Slice((*byte)(data), int(e.hlen+e.plen)))
			if ok {
				dst[name] = append(dst[name], msg)
				n++
			}
			continue
		}
		name := C.GoStringN((*C.char)(data), C.int(e.hlen))
		msg := C.GoBytes(unsafe.Add(data, e.hlen), C.int(e.plen))
		dst[name] = append(dst[name], msg)
		n++
	}
	C.ecx_notif_free(list)
	return n
}

// DroppedNotifs implements nixl.NotifDropper: notifications that reached
// this worker and were not queued for GetNotifs. The handler drops a
// message that arrives by rendezvous (this package's senders force eager;
// such a message comes from another sender or exceeded what the transport
// sends eagerly), one whose payload exceeds 1 MiB (MaxNotif's limit) or
// whose sender name exceeds 256 bytes, and one it could not allocate
// memory for; of fragmented notifications (frag.go), a fragment not
// shaped as one and a notification given up on before all its fragments
// came (its sender died, or more than 64 were incomplete at once).
func (a *Agent) DroppedNotifs() uint64 {
	if a.c == nil {
		return a.dropped + a.frags.dropped
	}
	return uint64(a.c.notif_dropped) + a.frags.dropped
}

var _ nixl.NotifDropper = (*Agent)(nil)

// UndeliveredNotifs implements nixl.NotifUndeliverer: notifications to a
// same-host peer that waited for room in its receive queue (see
// ECX_AM_NOTIF_FRAG in ecx.h) and were dropped unsent, because the peer
// died, or was dropped and did not take them within ECX_DRAIN_NS, or this
// agent closed first.
func (a *Agent) UndeliveredNotifs() uint64 {
	if a.c == nil {
		return a.undelivered
	}
	return uint64(a.c.notif_undelivered)
}

var _ nixl.NotifUndeliverer = (*Agent)(nil)
