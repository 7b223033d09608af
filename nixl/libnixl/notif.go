package libnixl

/*
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/internal/enginekit"
)

// ----------------------------------------------------------- notifications

// SendNotif implements nixl.Agent.
func (a *Agent) SendNotif(peerName string, msg []byte) error {
	if a.closed {
		return errClosed
	}
	if _, err := enginekit.LivePeer(kit, a.peers, peerName); err != nil {
		return err
	}
	if err := kit.CheckNotif(len(msg), a.cfg.MaxNotif); err != nil {
		return err
	}
	cname := C.CString(peerName)
	defer C.free(unsafe.Pointer(cname))
	var m unsafe.Pointer
	if len(msg) > 0 {
		m = unsafe.Pointer(&msg[0])
	}
	st := C.ecx_dl_send_notif(a.lib.c, a.c, cname, C.size_t(len(peerName)), m, C.size_t(len(msg)))
	if st == 0 {
		a.lastNotif = time.Now()
	}
	return codeErr(int32(st), "sending a notification to %q", peerName)
}

// shimMaxNotif is the longest message the shim queues (longer ones it
// drops and counts, DroppedNotifs): MaxNotif's upper limit, as the ucx
// engine drops in its handler. The reactor applies the agent's own
// MaxNotif to the rest. A variable so that tests can lower it.
var shimMaxNotif = enginekit.MaxNotifLimit

// maxRecord is the largest record the shim can hand over: a sender's name
// of maxNameLen bytes and a message of shimMaxNotif, with its header and
// padding.
var maxRecord = int(recordSize(maxNameLen, uint64(enginekit.MaxNotifLimit)))

// maxNotifPasses bounds the shim calls of one GetNotifs. Each call polls
// NIXL again, so peers that never stop sending would otherwise keep
// GetNotifs (and the reactor's turn) from ever returning; what is left
// stays queued in the shim for the next call.
const maxNotifPasses = 8

// GetNotifs implements nixl.Agent. Each call progresses NIXL (its UCX
// worker), which is also what serves peers' reads of this agent's memory.
func (a *Agent) GetNotifs(dst map[string][][]byte) int {
	if a.closed {
		return 0
	}
	return a.getNotifs(dst)
}

// getNotifs is GetNotifs without the closed check (Close drives the
// worker with it).
func (a *Agent) getNotifs(dst map[string][][]byte) int {
	// A buffer grown for one long record goes back to its first size once
	// the record is out: a peer's single 100 MB notification would
	// otherwise keep 100 MB of C memory for the agent's life.
	defer a.shrinkNotifBuf()
	total := 0
	for range maxNotifPasses {
		var used, count C.size_t
		var shimDropped C.uint64_t
		st := C.ecx_dl_notifs(a.lib.c, a.c, a.nbuf, C.size_t(a.ncap), C.size_t(shimMaxNotif), C.size_t(maxNameLen),
			&used, &count, &shimDropped)
		a.shimDropped = uint64(shimDropped)
		if nixl.Status(st) == nixl.ErrInvalidParam && count == 0 && int(used) > a.ncap {
			if int(used) > maxRecord {
				// The shim queues nothing this long (shimMaxNotif): it
				// disagrees with this package, and its records cannot be
				// trusted. Growing would let it size this allocation.
				a.dropped++
				return total
			}
			C.free(a.nbuf)
			a.ncap = int(used)
			a.nbuf = C.malloc(C.size_t(a.ncap))
			continue
		}
		if count == 0 {
			return total
		}
		if int(used) > a.ncap {
			// The shim wrote past the buffer it was given, or says so:
			// nothing in it can be trusted, and asking again at once
			// could meet the same fault.
			a.dropped += uint64(count)
			return total
		}
		buf := unsafe.Slice((*byte)(a.nbuf), int(used))
		n, _ := parseNotifs(buf, int(count), dst)
		a.dropped += uint64(int(count) - n)
		total += n
	}
	return total
}

// shrinkNotifBuf puts a notification buffer larger than firstBuf back to
// firstBuf (GetNotifs grows it again for a record that needs more).
func (a *Agent) shrinkNotifBuf() {
	if a.ncap <= firstBuf {
		return
	}
	C.free(a.nbuf)
	a.ncap = firstBuf
	a.nbuf = C.malloc(C.size_t(a.ncap))
}

// DroppedNotifs implements nixl.NotifDropper: notifications the shim
// dropped as NIXL handed them over (a message longer than MaxNotif's
// limit, 1 MiB, or a sender's name longer than 256 bytes, never copied;
// or no memory to queue one), and those it handed over in records that
// did not match their layout (see parseNotifs), lost rather than misread.
func (a *Agent) DroppedNotifs() uint64 { return a.dropped + a.shimDropped }

var _ nixl.NotifDropper = (*Agent)(nil)
