package reactor

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/shmview"
)

// Notifications between same-host peers on the direct path travel over a
// Unix datagram socket, not the engine.
//
// Why: UCX 1.13 resolves a peer's endpoint id (a wireup exchange) the
// first time a message misses its short path, which a notification as
// long as vLLM's "{session}:{mm_hash}" does, and so does any message sent
// while the peer's receive queue is full. Such an endpoint is destroyed
// only with the worker, and in the error mode shared memory needs there
// is no forced close: every restart of a producer that had been notified
// left its endpoint and about 4 MiB of its segments mapped in the
// consumer until Deregister. (The ucx engine now keeps its notifications
// to the short path, in fragments when long; the socket came first, and
// lets a caller send an inline READ's notification itself.) With
// notifications off the engine, an endpoint to a direct peer carries
// nothing and closes at once.
//
// The producer binds an abstract address (shmview.NotifyAddr: its pid and
// a random token it advertises) and the socket sits in its reactor's epoll
// set, so a parked reactor wakes for a notification; a spinning one reads
// the socket every notifRecvEvery, and so does every call of
// Reactor.Notifs (a caller polling for notifications sees one as soon as
// it has arrived, without waiting for the reactor to wake up). A datagram is the producer's key (below),
// the sender's agent name (a uint16 length, then the name) and one or more
// messages (each a uint32 length, then the bytes). The receiver applies its MaxNotif as for
// the engine's notifications. A send the receiver's queue cannot take
// (EAGAIN: Linux queues only net.unix.max_dgram_qlen datagrams, 10 by
// default, per receiving socket) waits, in order, in the sender's backlog,
// where notifications to the same peer are packed into shared datagrams,
// and is retried every loop turn (an idle reactor sleeps at most 1 ms
// while any wait): nothing is dropped while the producer lives. Order is
// kept per peer: a producer that does not read its socket holds back its
// own notifications, not those of other producers.
//
// The address is no secret: any local user can list abstract addresses in
// /proc/net/unix and send to them. A notification makes the producer free
// the blocks it names, so a forged one could have them reused while a
// consumer still reads them. Every datagram therefore starts with the
// producer's key (shmview.Advert.NotifyKey, random, carried only in its
// metadata), and the receiver drops, and reports, datagrams without it.
// Notifications longer than maxNotifDgram go through the engine.

// maxNotifDgram bounds the message a datagram carries; the kernel's
// default socket buffers (about 208 KiB) take several.
const maxNotifDgram = 64 << 10

// notifRecvEvery is how often a reactor that is not parked reads its
// socket.
const notifRecvEvery = 10_000 // ns

var (
	errNotifDgram = errors.New("reactor: malformed notification datagram")
	errNotifKey   = errors.New("reactor: notification datagram without this producer's key (dropped)")
)

// NotifySocket is a bound notification socket not yet handed to a
// reactor.
type NotifySocket struct {
	fd   int
	open bool // fd is ours: only ListenNotify sets it (a zero value holds no fd 0)
	// Token goes into the region's advertisement (shmview.Advert.Notify),
	// Key too (shmview.Advert.NotifyKey).
	Token uint64
	Key   [shmview.NotifyKeyLen]byte
}

// ListenNotify opens and binds this process's notification socket. It is
// handed to the reactor in DirectOptions, which owns it from then on; an
// owner that never hands it over closes it. lifeFD (-1: none) is the
// descriptor of the producer's lifeword and lifeID its holder's id
// (lifeword.Holder.ID), which the socket's token names
// (shmview.LifeToken, Advert.LifeID).
func ListenNotify(lifeFD int, lifeID uint32) (*NotifySocket, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	rnd := binary.LittleEndian.Uint64(b[:])
	if lifeFD >= 0 && lifeID != 0 {
		rnd = uint64(lifeID)<<32 | rnd&0xFFFF_FFFF // the token's upper half
	}
	token := shmview.LifeToken(rnd, lifeFD)
	var key [shmview.NotifyKeyLen]byte
	if _, err := rand.Read(key[:]); err != nil {
		return nil, err
	}
	key[0] |= 1 // never all zero: zero means none
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("notification socket: %w", err)
	}
	addr := &unix.SockaddrUnix{Name: shmview.NotifyAddr(uint32(unix.Getpid()), token)}
	if err := unix.Bind(fd, addr); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("notification socket: bind %s: %w", addr.Name, err)
	}
	return &NotifySocket{fd: fd, open: true, Token: token, Key: key}, nil
}

// take hands the descriptor over to a new owner: from then on s holds
// none. It returns -1 for a socket that is not open.
func (s *NotifySocket) take() int {
	if !s.open {
		return -1
	}
	fd := s.fd
	s.fd, s.open = -1, false
	return fd
}

// Close closes a socket that was not handed to a reactor.
func (s *NotifySocket) Close() {
	if s != nil && s.open {
		_ = unix.Close(s.fd)
		s.fd, s.open = -1, false
	}
}

// dgramMax is the longest datagram a sender builds and a receiver takes.
const dgramMax = shmview.NotifyKeyLen + 2 + maxSenderName + 4 + maxNotifDgram

// notifKey is a producer's notification key.
type notifKey = [shmview.NotifyKeyLen]byte

// appendNotifDgram appends the datagram carrying msg from sender to the
// producer whose key is key to b.
func appendNotifDgram(b []byte, key *notifKey, sender string, msg []byte) []byte {
	b = append(b, key[:]...)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(sender)))
	b = append(b, sender...)
	return appendNotifMsg(b, msg)
}

// appendNotifMsg appends one more message to a datagram.
func appendNotifMsg(b []byte, msg []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(msg)))
	return append(b, msg...)
}

// decodeNotifDgram checks a whole datagram, first that it carries key,
// and then hands each message, which aliases b, to deliver. It returns how
// many it delivered.
func decodeNotifDgram(b []byte, key *notifKey, deliver func(sender string, msg []byte)) (int, error) {
	if len(b) < len(key) || subtle.ConstantTimeCompare(b[:len(key)], key[:]) != 1 {
		return 0, errNotifKey
	}
	b = b[len(key):]
	if len(b) < 2 {
		return 0, errNotifDgram
	}
	n := int(binary.LittleEndian.Uint16(b))
	if n == 0 || n > len(b)-2 {
		return 0, errNotifDgram
	}
	body := b[2+n:]
	count := 0
	for rest := body; len(rest) > 0; count++ {
		if len(rest) < 4 || uint64(binary.LittleEndian.Uint32(rest)) > uint64(len(rest)-4) {
			return 0, errNotifDgram
		}
		rest = rest[4+binary.LittleEndian.Uint32(rest):]
	}
	if count == 0 {
		return 0, errNotifDgram
	}
	sender := string(b[2 : 2+n])
	if !ValidName(sender) {
		return 0, errNotifDgram // no agent has that name
	}
	for rest := body; len(rest) > 0; {
		m := binary.LittleEndian.Uint32(rest)
		deliver(sender, rest[4:4+m])
		rest = rest[4+m:]
	}
	return count, nil
}

// notifSock is a reactor's side of the channel. Loop only, but for the
// receiving side, which callers of Reactor.Notifs drain too: rfd, rbuf and
// delivery are under recvMu, so notifications from one sender are handed
// out in the order they were sent whoever reads them.
type notifSock struct {
	recvMu   sync.Mutex
	rfd, sfd int    // receiving (bound; -1: none) and sending sockets
	name     string // this agent's name, the sender of every datagram
	key      notifKey
	rbuf     []byte
	// badByCaller and keylessByCaller count malformed datagrams and ones
	// without our key that a caller's drain found, for the loop to report
	// as engine errors.
	badByCaller, keylessByCaller atomic.Int64
	// undelivered counts notifications taken out of the backlog unsent:
	// their producer exited, or the send failed for good.
	undelivered atomic.Uint64
	sbuf        []byte
	backlog     []pendingNotif // refused with EAGAIN, oldest first
	blocked     []*Peer        // flush's scratch: peers that refused an entry
	spare       [][]byte       // datagram buffers of sent backlog entries, for reuse
	lastRecv    int64
	// oversized holds the notifications a drain dropped for MaxNotif,
	// under recvMu, to be logged once recvMu is let go (takeOversized): a
	// log handler may call NewNotifs, which takes recvMu.
	oversized []oversizedNotif
}

type oversizedNotif struct {
	sender string
	n      int
}

// takeOversized returns what oversized held and empties it. The caller
// holds recvMu.
func (ns *notifSock) takeOversized() []oversizedNotif {
	o := ns.oversized
	ns.oversized = nil
	return o
}

// maxSpare bounds the buffers kept for the backlog's reuse.
const maxSpare = 16

type pendingNotif struct {
	peer  *Peer
	dgram []byte
	n     int64 // messages in dgram
}

// newNotifSock makes a reactor's side: rfd, when not -1, is its bound
// socket (ListenNotify), and key that socket's key.
func newNotifSock(rfd int, key notifKey, name string) (*notifSock, error) {
	sfd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("notification socket: %w", err)
	}
	return &notifSock{rfd: rfd, sfd: sfd, name: name, key: key, rbuf: make([]byte, dgramMax)}, nil
}

// maxSenderName is the longest agent name a datagram carries (names are
// checked to be at most 256 bytes long by their owners).
const maxSenderName = 1 << 10

// close closes the sockets. Notifications still in the backlog are
// dropped and counted undelivered (they were counted sent when queued).
func (ns *notifSock) close() {
	for i, e := range ns.backlog {
		ns.undelivered.Add(uint64(e.n))
		e.peer.backlogged--
		e.peer.backlogMsgs -= e.n
		e.peer.notifsHeld.Add(-e.n)
		ns.backlog[i] = pendingNotif{}
	}
	ns.backlog = ns.backlog[:0]
	ns.recvMu.Lock()
	if ns.rfd >= 0 {
		_ = unix.Close(ns.rfd)
		ns.rfd = -1
	}
	ns.recvMu.Unlock()
	if ns.sfd >= 0 {
		_ = unix.Close(ns.sfd)
		ns.sfd = -1
	}
}

// canSend reports whether msg to p goes over the socket.
func (ns *notifSock) canSend(p *Peer, msg []byte) bool {
	return p.direct != nil && p.direct.notify != nil && len(msg) <= maxNotifDgram
}

// maxBacklogMsgs bounds the notifications waiting in the backlog for one
// producer (one that stopped reading its socket but lives: a consumer
// reads its memory directly all the same), a few MiB at vLLM's 100
// bytes; past it one more is refused (errBacklogFull). Without a bound
// they piled up for as long as the producer stayed stopped.
const maxBacklogMsgs = 65536

// errBacklogFull: a notification refused, maxBacklogMsgs waiting already.
var errBacklogFull = errors.New("notification socket: the producer has taken none of 65,536 waiting notifications")

// send sends msg to p, or queues it behind p's entries in the backlog. An
// error means the peer's socket is gone (the producer exited): the
// notification has nobody to go to; or that p has maxBacklogMsgs waiting
// (errBacklogFull).
func (ns *notifSock) send(p *Peer, msg []byte) error {
	if p.backlogged > 0 {
		return ns.queue(p, msg)
	}
	ns.sbuf = appendNotifDgram(ns.sbuf[:0], &p.direct.notifyKey, ns.name, msg)
	err := unix.Sendto(ns.sfd, ns.sbuf, unix.MSG_DONTWAIT, p.direct.notify)
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.ENOBUFS) {
		return ns.queue(p, msg)
	}
	return err
}

// queue appends msg to p to the backlog: into the last datagram when that
// one goes to p and has room, else into a new one (a reused buffer when
// there is one); errBacklogFull when p has maxBacklogMsgs waiting.
func (ns *notifSock) queue(p *Peer, msg []byte) error {
	if p.backlogMsgs >= maxBacklogMsgs {
		return errBacklogFull
	}
	p.backlogMsgs++
	p.notifsHeld.Add(1)
	if k := len(ns.backlog) - 1; k >= 0 && ns.backlog[k].peer == p && len(ns.backlog[k].dgram)+4+len(msg) <= dgramMax {
		ns.backlog[k].dgram = appendNotifMsg(ns.backlog[k].dgram, msg)
		ns.backlog[k].n++
		return nil
	}
	var b []byte
	if n := len(ns.spare); n > 0 {
		b, ns.spare[n-1] = ns.spare[n-1][:0], nil
		ns.spare = ns.spare[:n-1]
	}
	ns.backlog = append(ns.backlog, pendingNotif{p, appendNotifDgram(b, &p.direct.notifyKey, ns.name, msg), 1})
	p.backlogged++
	return nil
}

// adopt hands p the backlog's entries for earlier peers with p's socket
// address: a producer removed and added again, or given a new block list,
// gets a new *Peer, and its notifications must still go after those
// waiting for the old one (order is kept per producer). Loop only.
func (ns *notifSock) adopt(p *Peer) {
	if p.direct == nil || p.direct.notify == nil {
		return
	}
	for i := range ns.backlog {
		e := &ns.backlog[i]
		if e.peer == p || e.peer.direct.notify == nil || e.peer.direct.notify.Name != p.direct.notify.Name {
			continue
		}
		e.peer.backlogged--
		e.peer.backlogMsgs -= e.n
		e.peer.notifsHeld.Add(-e.n)
		e.peer = p
		p.backlogged++
		p.backlogMsgs += e.n
		p.notifsHeld.Add(e.n)
	}
}

// flush retries the backlog in order. A peer whose socket refuses an entry
// keeps that entry and its later ones; other peers' entries go on. Entries
// for producers known to have exited are dropped. It reports whether it
// sent anything and the number of sends that failed for good.
func (ns *notifSock) flush() (sent bool, failed int) {
	blocked := ns.blocked[:0]
	kept := ns.backlog[:0]
	for _, e := range ns.backlog {
		switch {
		case e.peer.direct.exitSeen.Load():
			// The producer exited: nobody to tell.
			ns.undelivered.Add(uint64(e.n))
		case slices.Contains(blocked, e.peer):
			kept = append(kept, e)
			continue
		default:
			err := unix.Sendto(ns.sfd, e.dgram, unix.MSG_DONTWAIT, e.peer.direct.notify)
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.ENOBUFS) {
				blocked = append(blocked, e.peer)
				kept = append(kept, e)
				continue
			}
			if err != nil {
				failed++
				ns.undelivered.Add(uint64(e.n))
			} else {
				sent = true
			}
		}
		e.peer.backlogged--
		e.peer.backlogMsgs -= e.n
		e.peer.notifsHeld.Add(-e.n)
		if len(ns.spare) < maxSpare {
			ns.spare = append(ns.spare, e.dgram)
		}
	}
	clear(ns.backlog[len(kept):])
	ns.backlog = kept
	clear(blocked)
	ns.blocked = blocked[:0]
	return sent, failed
}

// maxRecvDgrams bounds the datagrams one recv reads: the socket's address
// is public, and a local process sending keyless datagrams as fast as it
// can would otherwise keep a NewNotifs caller (or the reactor's turn) in
// recv for as long as it kept sending. What is left is read next time.
const maxRecvDgrams = 1024

// recv reads the datagrams waiting, at most maxRecvDgrams, and hands each
// to deliver; malformed ones are counted in bad, ones without our key in
// keyless. The caller holds recvMu.
func (ns *notifSock) recv(deliver func(sender string, msg []byte)) (got, bad, keyless int) {
	if ns.rfd < 0 {
		return 0, 0, 0
	}
	for range maxRecvDgrams {
		// MSG_TRUNC: n is the datagram's real length, so one longer than
		// the buffer (no sender of ours writes one) is seen, not cut.
		// recvfrom without an address: unix.Recvfrom allocates one per call.
		r, _, errno := unix.Syscall6(unix.SYS_RECVFROM, uintptr(ns.rfd), uintptr(unsafe.Pointer(&ns.rbuf[0])),
			uintptr(len(ns.rbuf)), unix.MSG_DONTWAIT|unix.MSG_TRUNC, 0, 0)
		if errno != 0 {
			if errno == unix.EINTR {
				continue
			}
			return got, bad, keyless
		}
		n := int(r)
		if n > len(ns.rbuf) {
			bad++
			continue
		}
		k, err := decodeNotifDgram(ns.rbuf[:n], &ns.key, deliver)
		if errors.Is(err, errNotifKey) {
			keyless++
			continue
		}
		if err != nil {
			bad++
			continue
		}
		got += k
	}
	return got, bad, keyless
}
