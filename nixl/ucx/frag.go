package ucx

import (
	"encoding/binary"
	"slices"
)

// Fragmented notifications (see ECX_AM_NOTIF_FRAG in ecx.h). Toward a
// same-host peer whose metadata has featFragNotifs, a notification whose
// sender name and payload exceed the endpoint's short path goes as
// fragments, each a fragHdr-byte header, the sender's token (u64), the
// fragment's offset (u32) and the total (u32) of the stream
//
//	name length (u16) | name | payload
//
// (little-endian), then the next bytes of the stream. The C handler
// queues fragments as they come and the reassembler puts them back
// together. A sender's fragments come in order (UCX keeps the order of
// short messages on one endpoint); one that does not continue its
// sender's notification ends that notification, dropped.
const (
	fragHdr     = 16   // ECX_FRAG_HDR
	fragMaxData = 8192 // ECX_FRAG_MAX_DATA

	// maxNotifPayload is the largest notification the C handler takes
	// whole (ECX_NOTIF_MAX_PAYLOAD), and maxFragStream the longest stream.
	maxNotifPayload = 1 << 20
	maxFragStream   = 2 + maxNameLen + maxNotifPayload
	// maxPartials and maxPartialBytes bound the notifications being put
	// back together, which a sender that died mid-notification leaves
	// behind: past either bound the oldest is dropped. The bytes are
	// those held, which grow with the bytes received, not with the total
	// a first fragment declares (a 17-byte fragment declaring a 1 MiB
	// stream would otherwise take 1 MiB, and eight would push every other
	// sender's notification out).
	maxPartials     = 64
	maxPartialBytes = 8 << 20
)

// featFragNotifs, in the feature bits of a peer's metadata: it
// reassembles fragmented notifications.
const featFragNotifs = 1

// featGather, in the feature bits of a peer's metadata: it answers
// gathered READs (ECX_AM_GATHER_REQ, see ecx.h).
const featGather = 2

// featBigSegments, in the feature bits of a peer's metadata: it runs with
// Config.LargeTCPSegments, receives tcp segments of 256 KiB and answers
// gather requests that name 252 KiB chunks (ecx.h). Its value follows
// featTCPAlone and featModeRule (peers.go).
const featBigSegments = 16

// partial is one notification being reassembled.
type partial struct {
	token uint64
	buf   []byte // the stream so far
	total int    // the stream's length, as its first fragment says
	seq   uint64 // when its first fragment came
}

// reassembler puts fragmented notifications back together. Not safe for
// concurrent use (the agent's thread).
type reassembler struct {
	parts   []*partial
	bytes   int // the capacity of every part's buf
	seq     uint64
	dropped uint64 // notifications given up on, and fragments that fit none
}

// add takes one fragment, header and bytes, which it does not keep, and
// returns the sender's name and the payload when it completes a
// notification.
func (r *reassembler) add(frag []byte) (name string, msg []byte, ok bool) {
	if len(frag) <= fragHdr || len(frag) > fragHdr+fragMaxData {
		r.dropped++
		return "", nil, false
	}
	token := binary.LittleEndian.Uint64(frag)
	off := int(binary.LittleEndian.Uint32(frag[8:]))
	total := int(binary.LittleEndian.Uint32(frag[12:]))
	data := frag[fragHdr:]
	i := slices.IndexFunc(r.parts, func(p *partial) bool { return p.token == token })
	if off == 0 && i >= 0 {
		// A new notification while the last one is incomplete: that one
		// cannot complete any more.
		r.drop(i)
		i = -1
	}
	switch {
	case total < 2 || total > maxFragStream || len(data) > total-off:
		r.dropped++
		if i >= 0 {
			r.drop(i)
		}
		return "", nil, false
	case i < 0 && off != 0:
		// The rest of a notification whose beginning was dropped.
		r.dropped++
		return "", nil, false
	case i >= 0 && (off != len(r.parts[i].buf) || total != r.parts[i].total):
		r.drop(i)
		r.dropped++
		return "", nil, false
	}
	if i < 0 {
		r.parts = append(r.parts, &partial{token: token, total: total, seq: r.seq})
		r.seq++
		i = len(r.parts) - 1
	}
	p := r.parts[i]
	held := cap(p.buf)
	if len(p.buf)+len(data) > held {
		// Room for what came, doubled, up to the total.
		p.buf = slices.Grow(p.buf, min(max(2*(len(p.buf)+len(data)), 4096), total)-len(p.buf))
	}
	p.buf = append(p.buf, data...)
	r.bytes += cap(p.buf) - held
	for len(r.parts) > maxPartials || r.bytes > maxPartialBytes {
		o := r.oldest()
		r.drop(o)
		if o == i {
			return "", nil, false
		}
		if o < i {
			i--
		}
	}
	if len(p.buf) < total {
		return "", nil, false
	}
	r.remove(i)
	nl := int(binary.LittleEndian.Uint16(p.buf))
	if nl > maxNameLen || 2+nl > len(p.buf) || len(p.buf)-2-nl > maxNotifPayload {
		r.dropped++
		return "", nil, false
	}
	return string(p.buf[2 : 2+nl]), p.buf[2+nl:], true
}

func (r *reassembler) oldest() int {
	o := 0
	for i, p := range r.parts {
		if p.seq < r.parts[o].seq {
			o = i
		}
	}
	return o
}

// drop gives up on partial i: one notification dropped.
func (r *reassembler) drop(i int) {
	r.dropped++
	r.remove(i)
}

func (r *reassembler) remove(i int) {
	r.bytes -= cap(r.parts[i].buf)
	r.parts = slices.Delete(r.parts, i, i+1)
}
