package reactor

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// testKey is the notification key of the decoding tests.
var testKey = notifKey{0x5e, 0xc2, 0xe7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}

func FuzzNotifDgram(f *testing.F) {
	f.Add(appendNotifDgram(nil, &testKey, "prefill-0", []byte("sess:hash")))
	f.Add([]byte{})
	f.Add(append(testKey[:len(testKey):len(testKey)], 0, 0))
	f.Add(append(testKey[:len(testKey):len(testKey)], 5, 0, 'a'))
	f.Add(appendNotifDgram(nil, &notifKey{}, "prefill-0", []byte("sess:hash")))
	f.Add(appendNotifMsg(appendNotifDgram(nil, &testKey, "c", []byte("one")), []byte("two")))
	f.Fuzz(func(t *testing.T, b []byte) {
		var re []byte
		n, err := decodeNotifDgram(b, &testKey, func(sender string, msg []byte) {
			if !ValidName(sender) {
				t.Fatalf("decoded sender %q, a name no agent can have", sender)
			}
			if re == nil {
				re = appendNotifDgram(nil, &testKey, sender, msg)
			} else {
				re = appendNotifMsg(re, msg)
			}
		})
		if err != nil {
			if re != nil {
				t.Fatal("a malformed datagram delivered messages")
			}
			return
		}
		if n == 0 || !bytes.Equal(re, b) {
			t.Fatalf("%d messages; re-encoding %q gave %q", n, b, re)
		}
	})
}

func TestNotifDgramRejects(t *testing.T) {
	none := func(string, []byte) { t.Fatal("delivered from a malformed datagram") }
	good := appendNotifMsg(appendNotifDgram(nil, &testKey, "c", []byte("one")), []byte("two"))
	keyed := func(b ...byte) []byte { return append(testKey[:len(testKey):len(testKey)], b...) }
	for _, b := range [][]byte{keyed(), keyed(1), keyed(0, 0, 'x'), keyed(3, 0, 'a', 'b'), keyed(1, 0, 'a'),
		good[:len(good)-1], append(append([]byte(nil), good...), 1),
		// Senders no agent can be: the datagram is refused whole.
		appendNotifDgram(nil, &testKey, "a b", []byte("one")), appendNotifDgram(nil, &testKey, "a\x00", []byte("one")),
		appendNotifDgram(nil, &testKey, "caf\xc3\xa9", []byte("one")), appendNotifDgram(nil, &testKey, strings.Repeat("x", 257), []byte("one"))} {
		if _, err := decodeNotifDgram(b, &testKey, none); !errors.Is(err, errNotifDgram) {
			t.Errorf("%q: %v", b, err)
		}
	}
	// Well-formed datagrams without the receiver's key, whole or cut.
	other := testKey
	other[len(other)-1] ^= 0x80
	for _, b := range [][]byte{nil, {1}, testKey[:len(testKey)-1],
		appendNotifDgram(nil, &other, "c", []byte("one")), appendNotifDgram(nil, &notifKey{}, "c", []byte("one")),
		good[len(testKey):]} {
		if _, err := decodeNotifDgram(b, &testKey, none); !errors.Is(err, errNotifKey) {
			t.Errorf("%q: %v, want the key refused", b, err)
		}
	}
	var got []string
	n, err := decodeNotifDgram(appendNotifMsg(good, nil), &testKey, func(s string, m []byte) { got = append(got, s+"/"+string(m)) })
	if err != nil || n != 3 || fmt.Sprint(got) != "[c/one c/two c/]" {
		t.Fatalf("%d %q %v", n, got, err)
	}
}

// socketPeer is a direct peer whose notification socket is ns.
func socketPeer(t *testing.T, ns *NotifySocket) *Peer {
	t.Helper()
	d := &Direct{notify: &unix.SockaddrUnix{Name: shmview.NotifyAddr(uint32(unix.Getpid()), ns.Token)},
		notifyKey: ns.Key}
	return &Peer{Name: "producer", direct: d}
}

// A receiver that does not read fills its socket; the sender keeps the
// rest in its backlog, in order, and delivers every notification exactly
// once when the receiver reads again. Once the receiver's socket is gone,
// a send fails (the producer exited).
func TestNotifSockBacklog(t *testing.T) {
	rx, err := ListenNotify(-1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptInt(rx.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096); err != nil {
		t.Fatal(err)
	}
	recv, err := newNotifSock(rx.take(), rx.Key, "producer")
	if err != nil {
		t.Fatal(err)
	}
	send, err := newNotifSock(-1, notifKey{}, "consumer-1")
	if err != nil {
		t.Fatal(err)
	}
	defer send.close()
	p := socketPeer(t, &NotifySocket{Token: rx.Token, Key: rx.Key})

	const n = 2000
	for i := range n {
		msg := []byte(fmt.Sprintf("sess-%d:%064x", i, i))
		if !send.canSend(p, msg) {
			t.Fatal("a direct peer with a socket cannot be sent to")
		}
		if err := send.send(p, msg); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	if len(send.backlog) == 0 {
		t.Fatal("a receiver that reads nothing took 2,000 notifications: the backlog is untested")
	}
	// The peer counts what it holds back, so callers queue behind it.
	var held int64
	for _, e := range send.backlog {
		held += e.n
	}
	if got := p.notifsHeld.Load(); got != held {
		t.Fatalf("the peer holds %d notifications by its count, the backlog %d", got, held)
	}
	// A copy from the producer's region faulted (it truncated its file):
	// its READs fail from now on, but the process lives, and the
	// notifications of READs that were DONE still reach it.
	p.direct.dead.Store(true)
	var got []string
	for rounds := 0; len(got) < n; rounds++ {
		if rounds > 100000 {
			t.Fatalf("%d of %d delivered, %d in the backlog", len(got), n, len(send.backlog))
		}
		_, bad, keyless := recv.recv(func(sender string, msg []byte) {
			if sender != "consumer-1" {
				t.Fatalf("sender %q", sender)
			}
			got = append(got, string(msg))
		})
		if bad != 0 || keyless != 0 {
			t.Fatalf("%d malformed datagrams, %d without the key", bad, keyless)
		}
		if _, failed := send.flush(); failed != 0 {
			t.Fatalf("%d sends failed", failed)
		}
	}
	for i, m := range got {
		if want := fmt.Sprintf("sess-%d:%064x", i, i); m != want {
			t.Fatalf("notification %d is %q, want %q", i, m, want)
		}
	}
	if len(send.backlog) != 0 {
		t.Fatalf("%d left in the backlog", len(send.backlog))
	}
	if got := p.notifsHeld.Load(); got != 0 {
		t.Fatalf("the peer still counts %d held notifications", got)
	}

	recv.close()
	if err := send.send(p, []byte("late")); err == nil {
		t.Fatal("a send to a closed socket succeeded")
	}
	long := make([]byte, maxNotifDgram+1)
	if send.canSend(p, long) {
		t.Fatal("a notification longer than a datagram takes would go over the socket")
	}
	if send.canSend(&Peer{Name: "engine-peer"}, []byte("x")) {
		t.Fatal("a peer without a direct view would get a datagram")
	}
}

// notifSockPair is a producer's notification socket (rx, read through
// recv) and a plain datagram socket fd to send to it at address to; all
// closed at the test's end.
func notifSockPair(t *testing.T) (rx *NotifySocket, recv *notifSock, fd int, to *unix.SockaddrUnix) {
	t.Helper()
	rx, err := ListenNotify(-1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if recv, err = newNotifSock(rx.take(), rx.Key, "producer"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(recv.close)
	if fd, err = unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return rx, recv, fd, &unix.SockaddrUnix{Name: shmview.NotifyAddr(uint32(unix.Getpid()), rx.Token)}
}

// A datagram longer than the receive buffer is counted as malformed, not
// delivered cut short.
func TestNotifSockTruncated(t *testing.T) {
	rx, recv, fd, to := notifSockPair(t)
	recv.rbuf = recv.rbuf[:64]
	// (a datagram longer than the buffer)
	if err := unix.Sendto(fd, appendNotifDgram(nil, &rx.Key, "c", make([]byte, 100)), 0, to); err != nil {
		t.Fatal(err)
	}
	if err := unix.Sendto(fd, appendNotifDgram(nil, &rx.Key, "c", []byte("ok")), 0, to); err != nil {
		t.Fatal(err)
	}
	var got []string
	_, bad, keyless := recv.recv(func(_ string, msg []byte) { got = append(got, string(msg)) })
	if bad != 1 || keyless != 0 || len(got) != 1 || got[0] != "ok" {
		t.Fatalf("bad %d, keyless %d, delivered %q", bad, keyless, got)
	}
}

// recv stops after maxRecvDgrams datagrams, however fast they keep coming
// (here each delivery sends the next), and leaves the rest for next time.
func TestNotifSockRecvBounded(t *testing.T) {
	rx, recv, fd, to := notifSockPair(t)
	dgram := appendNotifDgram(nil, &rx.Key, "c", []byte("again"))
	if err := unix.Sendto(fd, dgram, 0, to); err != nil {
		t.Fatal(err)
	}
	delivered := 0
	again := func(string, []byte) {
		delivered++
		if err := unix.Sendto(fd, dgram, 0, to); err != nil {
			t.Fatal(err)
		}
	}
	got, bad, keyless := recv.recv(again)
	if got != maxRecvDgrams || delivered != maxRecvDgrams || bad != 0 || keyless != 0 {
		t.Fatalf("got %d, delivered %d, bad %d, keyless %d; want %d delivered", got, delivered, bad, keyless, maxRecvDgrams)
	}
	if got, _, _ := recv.recv(func(string, []byte) {}); got != 1 {
		t.Fatalf("the datagram left behind: got %d, want 1", got)
	}
}

// One producer that stops reading its socket holds back its own
// notifications only: another producer gets each of its notifications at
// the first send, while the stalled one's wait in order, and arrive, in
// order, once it reads again. An exited producer's are dropped.
func TestNotifSockStalledPeerBlocksOnlyItself(t *testing.T) {
	listen := func() (*notifSock, *Peer) {
		rx, err := ListenNotify(-1, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.SetsockoptInt(rx.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096); err != nil {
			t.Fatal(err)
		}
		p := socketPeer(t, rx)
		ns, err := newNotifSock(rx.take(), rx.Key, "producer")
		if err != nil {
			t.Fatal(err)
		}
		return ns, p
	}
	stalled, ps := listen()
	live, pl := listen()
	defer live.close()
	send, err := newNotifSock(-1, notifKey{}, "consumer-1")
	if err != nil {
		t.Fatal(err)
	}
	defer send.close()

	const n = 500
	var got []string
	collect := func(ns *notifSock) {
		// (each producer has a key of its own: a datagram sealed with
		// the other's would count as keyless)
		if _, bad, keyless := ns.recv(func(_ string, msg []byte) { got = append(got, string(msg)) }); bad != 0 || keyless != 0 {
			t.Fatalf("%d malformed datagrams, %d without the key", bad, keyless)
		}
	}
	for i := range n {
		if err := send.send(ps, fmt.Appendf(nil, "stalled-%d", i)); err != nil {
			t.Fatal(err)
		}
		if err := send.send(pl, fmt.Appendf(nil, "live-%d", i)); err != nil {
			t.Fatal(err)
		}
		if _, failed := send.flush(); failed != 0 {
			t.Fatalf("%d sends failed", failed)
		}
		got = got[:0]
		collect(live)
		if len(got) != 1 || got[0] != fmt.Sprintf("live-%d", i) {
			t.Fatalf("send %d: the live producer got %q at once (backlog %d entries, %d of the stalled producer's)",
				i, got, len(send.backlog), ps.backlogged)
		}
	}
	if ps.backlogged == 0 || pl.backlogged != 0 {
		t.Fatalf("backlogged: stalled %d, live %d", ps.backlogged, pl.backlogged)
	}
	got = got[:0]
	for rounds := 0; len(got) < n; rounds++ {
		if rounds > 100000 {
			t.Fatalf("%d of %d delivered", len(got), n)
		}
		collect(stalled)
		send.flush()
	}
	for i, m := range got {
		if want := fmt.Sprintf("stalled-%d", i); m != want {
			t.Fatalf("notification %d is %q, want %q", i, m, want)
		}
	}
	if len(send.backlog) != 0 || ps.backlogged != 0 {
		t.Fatalf("%d entries left in the backlog (%d counted)", len(send.backlog), ps.backlogged)
	}

	// Stalled again, then exited: its entries are dropped, not retried.
	for i := range n {
		_ = send.send(ps, fmt.Appendf(nil, "late-%d", i))
	}
	if ps.backlogged == 0 {
		t.Fatal("nothing backlogged for the stalled producer")
	}
	stalled.close()
	ps.direct.exitSeen.Store(true)
	ps.direct.dead.Store(true)
	before, held := send.undelivered.Load(), ps.notifsHeld.Load()
	send.flush()
	if len(send.backlog) != 0 || ps.backlogged != 0 {
		t.Fatalf("an exited producer's entries kept: %d (%d counted)", len(send.backlog), ps.backlogged)
	}
	// Each dropped notification is counted, not each datagram.
	if dropped := send.undelivered.Load() - before; held == 0 || dropped != uint64(held) || ps.notifsHeld.Load() != 0 {
		t.Fatalf("%d held, %d counted undelivered, %d still held", held, dropped, ps.notifsHeld.Load())
	}
}

// A NotifySocket not made by ListenNotify holds no descriptor: its zero
// value's fd field is 0, which is standard input. SetDirect refuses it and
// Close leaves fd 0 alone (before, both took fd 0 for the socket: the
// reactor put it in its epoll set and closed it at the end).
func TestNotifySocketZeroValue(t *testing.T) {
	leakcheck.Check(t)
	// fd 0 stands for a descriptor that is not ours: a pipe, so that an
	// epoll set would take it.
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	defer pr.Close()
	defer pw.Close()
	saved, err := unix.FcntlInt(0, unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	defer func() {
		_ = unix.Dup2(saved, 0)
		_ = unix.Close(saved)
	}()
	require.NoError(t, unix.Dup2(int(pr.Fd()), 0))
	var want unix.Stat_t
	require.NoError(t, unix.Fstat(0, &want))

	la, err := loopback.New("zero-notify")
	require.NoError(t, err)
	r, err := Start(la, Options{}, noSetup)
	require.NoError(t, err)
	region := make([]byte, 4096)
	err = r.SetDirect(DirectOptions{Region: region, Notify: &NotifySocket{}, Name: "zero-notify"})
	require.ErrorContains(t, err, "ListenNotify")
	(&NotifySocket{}).Close()
	require.NoError(t, r.Close())

	var got unix.Stat_t
	require.NoError(t, unix.Fstat(0, &got), "fd 0 was closed")
	require.Equal(t, [2]uint64{want.Dev, want.Ino}, [2]uint64{got.Dev, got.Ino}, "fd 0 is not the pipe any more")
}

// Notifications left in the backlog when the socket closes (Deregister,
// after its flush ran out of time) are counted undelivered: they were
// counted sent when queued. They used to vanish from the counts.
func TestNotifSockCloseCountsBacklog(t *testing.T) {
	recv, send, ns := smallNotifPair(t)
	defer recv.close()
	p := socketPeer(t, ns)
	for i := range 500 {
		if err := send.send(p, fmt.Appendf(nil, "sess-%d:%064x", i, i)); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	held := p.notifsHeld.Load()
	if held == 0 {
		t.Fatal("a receiver that reads nothing took 500 notifications: nothing in the backlog")
	}
	send.close()
	if got := send.undelivered.Load(); got != uint64(held) {
		t.Fatalf("%d undelivered after close, %d were in the backlog", got, held)
	}
	if len(send.backlog) != 0 || p.notifsHeld.Load() != 0 || p.backlogged != 0 {
		t.Fatalf("backlog %d entries, peer holds %d in %d", len(send.backlog), p.notifsHeld.Load(), p.backlogged)
	}
}

// A producer removed and added again (or given a new block list) gets a
// new *Peer with the same socket. Notifications waiting in the backlog for
// the old one used to be overtaken by the new one's, which went out as
// soon as the socket had room; the new peer now takes over the old one's
// entries, and everything arrives in the order it was sent.
func TestNotifSockOrderAcrossPeerReplacement(t *testing.T) {
	recv, send, ns := smallNotifPair(t)
	defer recv.close()
	defer send.close()
	oldPeer := socketPeer(t, ns)
	const n = 300
	for i := range n {
		if err := send.send(oldPeer, fmt.Appendf(nil, "n-%04d", i)); err != nil {
			t.Fatal(err)
		}
	}
	if len(send.backlog) == 0 {
		t.Fatal("nothing in the backlog: the test tests nothing")
	}
	newPeer := socketPeer(t, ns)
	send.adopt(newPeer)
	var got []string
	deliver := func(_ string, msg []byte) { got = append(got, string(msg)) }
	recv.recv(deliver) // room in the socket again
	for i := n; i < n+100; i++ {
		if err := send.send(newPeer, fmt.Appendf(nil, "n-%04d", i)); err != nil {
			t.Fatal(err)
		}
	}
	for rounds := 0; len(got) < n+100; rounds++ {
		if rounds > 100000 {
			t.Fatalf("%d of %d delivered", len(got), n+100)
		}
		send.flush()
		recv.recv(deliver)
	}
	for i, m := range got {
		if want := fmt.Sprintf("n-%04d", i); m != want {
			t.Fatalf("notification %d is %q, want %q", i, m, want)
		}
	}
	if oldPeer.notifsHeld.Load() != 0 || newPeer.notifsHeld.Load() != 0 || oldPeer.backlogged != 0 || newPeer.backlogged != 0 {
		t.Fatalf("held: old %d (%d entries), new %d (%d entries)", oldPeer.notifsHeld.Load(), oldPeer.backlogged,
			newPeer.notifsHeld.Load(), newPeer.backlogged)
	}
}

// smallNotifPair is a producer's socket with a small receive buffer (it
// fills after a few datagrams) and a consumer's sender; the caller closes
// both. ns carries the producer's token and key, for socketPeer.
func smallNotifPair(t *testing.T) (recv, send *notifSock, ns *NotifySocket) {
	t.Helper()
	rx, err := ListenNotify(-1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptInt(rx.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096); err != nil {
		t.Fatal(err)
	}
	ns = &NotifySocket{Token: rx.Token, Key: rx.Key}
	if recv, err = newNotifSock(rx.take(), rx.Key, "producer"); err != nil {
		t.Fatal(err)
	}
	if send, err = newNotifSock(-1, notifKey{}, "consumer-1"); err != nil {
		recv.close()
		t.Fatal(err)
	}
	return recv, send, ns
}

// A producer that takes nothing from its socket gets at most
// maxBacklogMsgs notifications queued for it; one more is refused
// (errBacklogFull), and once it reads again every accepted one arrives,
// in order. They used to pile up for as long as it stayed stopped.
func TestNotifSockBacklogBounded(t *testing.T) {
	rx, err := ListenNotify(-1, 0)
	if err != nil {
		t.Fatal(err)
	}
	p := socketPeer(t, rx)
	prod, err := newNotifSock(rx.take(), rx.Key, "producer")
	if err != nil {
		t.Fatal(err)
	}
	defer prod.close()
	send, err := newNotifSock(-1, notifKey{}, "consumer")
	if err != nil {
		t.Fatal(err)
	}
	defer send.close()
	accepted := 0
	var refused error
	for i := range maxBacklogMsgs + 1000 {
		if err := send.send(p, fmt.Appendf(nil, "n-%d", i)); err != nil {
			refused = err
			break
		}
		accepted++
	}
	if !errors.Is(refused, errBacklogFull) {
		t.Fatalf("after %d accepted: %v, want errBacklogFull", accepted, refused)
	}
	if p.backlogMsgs != maxBacklogMsgs || p.notifsHeld.Load() != maxBacklogMsgs {
		t.Fatalf("backlog %d messages, %d held; want %d", p.backlogMsgs, p.notifsHeld.Load(), maxBacklogMsgs)
	}
	var got []string
	for rounds := 0; len(got) < accepted; rounds++ {
		if rounds > 1000000 {
			t.Fatalf("%d of %d delivered", len(got), accepted)
		}
		prod.recv(func(_ string, msg []byte) { got = append(got, string(msg)) })
		send.flush()
	}
	for i, m := range got {
		if want := fmt.Sprintf("n-%d", i); m != want {
			t.Fatalf("notification %d is %q, want %q", i, m, want)
		}
	}
	if p.backlogMsgs != 0 || p.backlogged != 0 || p.notifsHeld.Load() != 0 {
		t.Fatalf("left: %d messages in %d entries, %d held", p.backlogMsgs, p.backlogged, p.notifsHeld.Load())
	}
	if err := send.send(p, []byte("after")); err != nil {
		t.Fatal(err)
	}
}
