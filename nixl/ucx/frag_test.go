package ucx

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
)

// fragments cuts a notification into the fragments a sender with token
// and data bytes per fragment sends (the layout ecx.c builds).
func fragments(token uint64, name string, msg []byte, data int) [][]byte {
	stream := binary.LittleEndian.AppendUint16(nil, uint16(len(name)))
	stream = append(append(stream, name...), msg...)
	var out [][]byte
	for off := 0; off < len(stream); off += data {
		end := min(off+data, len(stream))
		f := binary.LittleEndian.AppendUint64(nil, token)
		f = binary.LittleEndian.AppendUint32(f, uint32(off))
		f = binary.LittleEndian.AppendUint32(f, uint32(len(stream)))
		out = append(out, append(f, stream[off:end]...))
	}
	return out
}

type notifOut struct {
	name string
	msg  []byte
}

func feed(r *reassembler, frags [][]byte) []notifOut {
	var out []notifOut
	for _, f := range frags {
		if name, msg, ok := r.add(f); ok {
			out = append(out, notifOut{name, msg})
		}
	}
	return out
}

// Senders' fragments interleaved at random reassemble into every
// notification, each sender's in order, whatever the fragment size.
func TestReassemblerInterleaved(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	type sender struct {
		token uint64
		name  string
		data  int
		queue [][]byte
		want  [][]byte
	}
	senders := []*sender{
		{token: 1, name: "a", data: 16},
		{token: 2, name: strings.Repeat("n", maxNameLen), data: 76},
		{token: 3, name: "prefill-7", data: fragMaxData},
	}
	for _, s := range senders {
		for _, n := range []int{0, 1, 75, 76, 77, 1000, 70000} {
			msg := make([]byte, n)
			rng.Read(msg)
			s.queue = append(s.queue, fragments(s.token, s.name, msg, s.data)...)
			s.want = append(s.want, msg)
		}
	}
	var r reassembler
	got := map[string][][]byte{}
	for {
		var live []*sender
		for _, s := range senders {
			if len(s.queue) > 0 {
				live = append(live, s)
			}
		}
		if len(live) == 0 {
			break
		}
		s := live[rng.Intn(len(live))]
		if name, msg, ok := r.add(s.queue[0]); ok {
			got[name] = append(got[name], msg)
		}
		s.queue = s.queue[1:]
	}
	for _, s := range senders {
		require.Equal(t, s.want, got[s.name], "sender %q", s.name)
	}
	require.Zero(t, r.dropped)
	require.Empty(t, r.parts)
	require.Zero(t, r.bytes)
}

// What cannot be reassembled is dropped and counted, and does not stop
// the notifications after it.
func TestReassemblerDrops(t *testing.T) {
	msg := bytes.Repeat([]byte("x"), 300)
	good := fragments(9, "later", []byte("fine"), 64)
	three := fragments(5, "s", msg, 100) // four fragments
	withTotal := func(f []byte, total uint32) []byte {
		f = bytes.Clone(f)
		binary.LittleEndian.PutUint32(f[12:], total)
		return f
	}
	longName := fragments(6, strings.Repeat("n", maxNameLen+1), nil, 100)
	cases := map[string]struct {
		frags   [][]byte
		dropped uint64
	}{
		"missing middle":    {[][]byte{three[0], three[2], three[3]}, 3},
		"restarted":         {[][]byte{three[0], three[1], three[0]}, 1},
		"rest without head": {[][]byte{three[1], three[2]}, 2},
		"header only":       {[][]byte{three[0][:fragHdr]}, 1},
		"too large":         {[][]byte{append(bytes.Clone(three[0][:fragHdr]), make([]byte, fragMaxData+1)...)}, 1},
		"total too small":   {[][]byte{withTotal(three[0], 1)}, 1},
		"total too large":   {[][]byte{withTotal(three[0], maxFragStream+1)}, 1},
		"past the total":    {[][]byte{withTotal(three[0], 50)}, 1},
		"total changes":     {[][]byte{three[0], withTotal(three[1], 1000)}, 2},
		"name too long":     {longName, 1},
		"payload too large": {fragments(7, "s", make([]byte, maxNotifPayload+1), fragMaxData), 1},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			var r reassembler
			require.Empty(t, feed(&r, tc.frags))
			require.Equal(t, tc.dropped, r.dropped)
			require.Equal(t, []notifOut{{"later", []byte("fine")}}, feed(&r, good))
			require.Equal(t, tc.dropped, r.dropped)
			for i := range r.parts {
				require.NotEqual(t, uint64(9), r.parts[i].token)
			}
		})
	}
}

// Senders that died mid-notification leave partial ones: past maxPartials
// or maxPartialBytes the oldest go, counted, and a new notification still
// gets through.
func TestReassemblerBounds(t *testing.T) {
	var r reassembler
	for i := range maxPartials + 10 {
		f := fragments(uint64(100+i), "dead", make([]byte, 500), 100)
		require.Empty(t, feed(&r, f[:1]))
	}
	require.Len(t, r.parts, maxPartials)
	require.Equal(t, uint64(10), r.dropped)
	require.Equal(t, uint64(110), r.parts[0].token, "the oldest went first")

	// Ten senders died a fragment short of 1 MiB notifications: the
	// bytes they left are bounded, the oldest went.
	r = reassembler{}
	big := make([]byte, 1<<20)
	for i := range 10 {
		f := fragments(uint64(200+i), "dead", big, fragMaxData)
		require.Empty(t, feed(&r, f[:len(f)-1]))
		require.LessOrEqual(t, r.bytes, maxPartialBytes)
	}
	require.Less(t, len(r.parts), 10)
	require.Equal(t, uint64(10-len(r.parts)), r.dropped)
	require.Equal(t, uint64(209), r.parts[len(r.parts)-1].token, "the newest stays")
	require.Equal(t, []notifOut{{"alive", []byte("x")}}, feed(&r, fragments(1, "alive", []byte("x"), 64)))
}

// A first fragment holds what it carries, not the total it declares: 63
// senders each declaring a 1 MiB notification in a two-byte fragment hold
// kilobytes, and the notifications of others still being put back
// together are not pushed out by them.
func TestReassemblerHoldsWhatCame(t *testing.T) {
	var r reassembler
	long := bytes.Repeat([]byte{9}, 3*fragMaxData)
	honest := fragments(7, "honest", long, fragMaxData)
	require.Empty(t, feed(&r, honest[:1]))
	for i := range maxPartials - 1 {
		f := binary.LittleEndian.AppendUint64(nil, uint64(1000+i))
		f = binary.LittleEndian.AppendUint32(f, 0)
		f = binary.LittleEndian.AppendUint32(f, 2+4+1<<20)
		f = append(f, 4, 0) // the name's length: "liar" follows, in fragments never sent
		require.Empty(t, feed(&r, [][]byte{f}))
	}
	require.LessOrEqual(t, r.bytes, maxPartials*4096+2*fragMaxData, "bytes held for streams that barely began")
	require.Zero(t, r.dropped)
	require.Equal(t, []notifOut{{"honest", long}}, feed(&r, honest[1:]))
}

// FuzzReassemble feeds arbitrary fragments: the reassembler never panics,
// keeps within its bounds, hands out only names and payloads within the
// limits, and a well-formed notification of a new sender after the
// garbage still arrives intact.
func FuzzReassemble(f *testing.F) {
	for _, frags := range [][][]byte{
		fragments(1, "a", []byte("hello"), 16),
		fragments(2, "b", bytes.Repeat([]byte{7}, 500), 76),
		append(fragments(3, "c", make([]byte, 200), 50)[1:], fragments(3, "c", nil, 50)...),
	} {
		var in []byte
		for _, fr := range frags {
			in = binary.LittleEndian.AppendUint16(in, uint16(len(fr)))
			in = append(in, fr...)
		}
		f.Add(in)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var r reassembler
		for len(in) >= 2 {
			n := int(binary.LittleEndian.Uint16(in))
			in = in[2:]
			n = min(n, len(in))
			name, msg, ok := r.add(in[:n])
			in = in[n:]
			if ok {
				require.LessOrEqual(t, len(name), maxNameLen)
				require.LessOrEqual(t, len(msg), maxNotifPayload)
			}
			require.LessOrEqual(t, len(r.parts), maxPartials)
			require.LessOrEqual(t, r.bytes, maxPartialBytes)
			sum := 0
			for _, p := range r.parts {
				sum += cap(p.buf)
				require.LessOrEqual(t, len(p.buf), p.total)
			}
			require.Equal(t, sum, r.bytes)
		}
		want := []byte("after the garbage")
		require.Equal(t, []notifOut{{"fresh", want}}, feed(&r, fragments(1<<63, "fresh", want, 16)))
	})
}

// Between two agents over shared memory, notifications of every length
// around the endpoint's short path and far beyond it, from a sender with
// a one-byte name and one with the longest, interleaved, by SendNotif and
// with READs: each arrives once, intact, in its sender's order, nothing
// dropped. The long ones went in fragments.
func TestFragmentedNotifsRoundTrip(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t) // notifications on the short path of a NONE endpoint
	p := newPair(t, true)
	long := newTestAgent(t, Config{Name: strings.Repeat("L", maxNameLen)})
	md, err := p.prod.LocalMetadata()
	require.NoError(t, err)
	_, err = long.LoadRemoteMetadata(md)
	require.NoError(t, err)
	sp := p.cons.peers[p.peer]
	require.Positive(t, int(sp.notifTo.short_max), "the endpoint's short path was not found")
	require.Equal(t, 1, int(sp.notifTo.frag))
	limit := int(sp.notifTo.short_max)

	rng := rand.New(rand.NewSource(3))
	whole := limit - len("consumer") // the longest that goes whole
	sizes := []int{0, 1, whole - 1, whole, whole + 1, limit, 2 * limit, 1000, 60000}
	for i := range sizes {
		sizes[i] = min(sizes[i], 60000) // MaxNotif (64 KiB), with room for the long sender's prefix
	}
	want := map[string][][]byte{}
	sent := 0
	for i, n := range sizes {
		msg := make([]byte, n)
		rng.Read(msg)
		if i%2 == 0 {
			require.NoError(t, p.cons.SendNotif(p.peer, msg))
		} else {
			idx := []int{i}
			id, err := p.cons.MakeXfer(nixl.Read, p.local, idx, p.remote, idx, msg)
			require.NoError(t, err)
			require.NoError(t, p.cons.PostXfer(id))
			require.NoError(t, waitXfer(t, p.cons, id, 10*time.Second, p.prod))
			require.NoError(t, p.cons.ReleaseXfer(id))
		}
		want["consumer"] = append(want["consumer"], msg)
		lmsg := append([]byte(fmt.Sprintf("long %d:", i)), msg...)
		require.NoError(t, long.SendNotif(p.peer, lmsg))
		want[long.name] = append(want[long.name], lmsg)
		sent += 2
	}
	got := collectNotifs(t, p.prod, sent, 20*time.Second, p.cons, long)
	for name := range want {
		require.Equal(t, len(want[name]), len(got[name]), name)
		for i := range want[name] {
			require.True(t, bytes.Equal(want[name][i], got[name][i]), "%s: notification %d (%d bytes)", name[:1], i, len(want[name][i]))
		}
	}
	require.Zero(t, p.prod.DroppedNotifs())
	require.Empty(t, p.prod.frags.parts)
}

// A burst larger than the receiver's queue, short notifications and long
// ones, while the receiver does not progress: the sender keeps what the
// queue cannot take and sends it from Progress, in order.
func TestNotifBurstPastFullQueue(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t) // notifications on the short path of a NONE endpoint
	p := newPair(t, true)
	want := sendBurst(t, p, 400, 50)
	got := collectNotifs(t, p.prod, len(want), 20*time.Second, p.cons)
	require.Equal(t, want, got["consumer"])
	require.Nil(t, p.cons.c.sending)
	require.Zero(t, p.prod.DroppedNotifs())
}

// sendBurst sends n notifications from p's consumer to its producer, which
// does not read them meanwhile, every long-th of them long enough to go in
// fragments, and returns them; the producer's queue must have filled.
func sendBurst(t *testing.T, p *pair, n, long int) [][]byte {
	t.Helper()
	var sent [][]byte
	for i := range n {
		msg := []byte(fmt.Sprintf("n%d", i))
		if i%long == 0 {
			msg = bytes.Repeat(msg, 200)
		}
		require.NoError(t, p.cons.SendNotif(p.peer, msg))
		sent = append(sent, msg)
	}
	require.NotNil(t, p.cons.c.sending, "the queue never filled: this tests nothing")
	return sent
}

// A peer that stopped reading its queue holds back only its own
// notifications: another peer's, sent after, arrive at once, and the
// stopped ones get every one of their own, in order, once they read
// again. Also with more stopped peers than the retry loop keeps a record
// of (16).
func TestStoppedPeerHoldsBackOnlyItsOwn(t *testing.T) {
	withSharedMemory(t) // notifications on the short path of a NONE endpoint
	for _, nstopped := range []int{1, 17} {
		t.Run(fmt.Sprint(nstopped), func(t *testing.T) {
			leakcheck.Check(t)
			cons := newTestAgent(t, Config{Name: "consumer"})
			live := newTestAgent(t, Config{Name: "live"})
			stopped := make([]*Agent, nstopped)
			for i := range stopped {
				stopped[i] = newTestAgent(t, Config{Name: fmt.Sprintf("stopped-%d", i)})
			}
			for _, prod := range append([]*Agent{live}, stopped...) {
				md, err := prod.LocalMetadata()
				require.NoError(t, err)
				_, err = cons.LoadRemoteMetadata(md)
				require.NoError(t, err)
			}
			toStopped := make([][][]byte, nstopped)
			for k, prod := range stopped {
				full := false
				for i := 0; !full && i < 10000; i++ {
					msg := []byte(fmt.Sprintf("s%d", i))
					require.NoError(t, cons.SendNotif(prod.name, msg))
					toStopped[k] = append(toStopped[k], msg)
					full = cons.waitingNotifs(prod.name) > 0
				}
				require.True(t, full, "the queue of %s never filled", prod.name)
				msg := bytes.Repeat([]byte("after"), 40) // in fragments
				require.NoError(t, cons.SendNotif(prod.name, msg))
				toStopped[k] = append(toStopped[k], msg)
			}
			var toLive [][]byte
			for i := range 100 {
				msg := []byte(fmt.Sprintf("l%d", i))
				if i%10 == 0 {
					msg = bytes.Repeat(msg, 50) // in fragments
				}
				require.NoError(t, cons.SendNotif("live", msg))
				toLive = append(toLive, msg)
			}
			got := collectNotifs(t, live, len(toLive), 10*time.Second, cons)
			require.Equal(t, toLive, got["consumer"])
			require.NotNil(t, cons.c.sending, "the stopped peers' notifications went while they read nothing")
			for k, prod := range stopped {
				got = collectNotifs(t, prod, len(toStopped[k]), 10*time.Second, cons)
				require.Equal(t, toStopped[k], got["consumer"], prod.name)
			}
			require.Nil(t, cons.c.sending)
		})
	}
}

// A peer whose metadata does not say it reassembles (an older build) gets
// long notifications whole, as before.
func TestLongNotifsToOldPeerWhole(t *testing.T) {
	leakcheck.Check(t)
	recv := newTestAgent(t, Config{Name: "receiver"})
	send := newTestAgent(t, Config{Name: "sender"})
	md, err := recv.LocalMetadata()
	require.NoError(t, err)
	m, err := decodeMetadata(md)
	require.NoError(t, err)
	m.UCX = m.ucxMajor()<<16 | m.ucxMinor()
	old, err := encodeMetadata(m)
	require.NoError(t, err)
	_, err = send.LoadRemoteMetadata(old)
	require.NoError(t, err)
	require.Zero(t, int(send.peers["receiver"].notifTo.frag))

	msg := bytes.Repeat([]byte("w"), 2000)
	require.NoError(t, send.SendNotif("receiver", msg))
	require.Equal(t, map[string][][]byte{"sender": {msg}}, collectNotifs(t, recv, 1, 5*time.Second, send))
	require.Empty(t, recv.frags.parts)
}

// The metadata's ucx field carries the feature bits beside the version,
// and a peer of another UCX major is still refused, its version named.
func TestMetadataFeatures(t *testing.T) {
	a := newTestAgent(t, Config{Name: "a"})
	md, err := a.LocalMetadata()
	require.NoError(t, err)
	m, err := decodeMetadata(md)
	require.NoError(t, err)
	want := uint64(featFragNotifs | featGather | featModeRule)
	if a.tcpAlone() {
		want |= featTCPAlone
	}
	require.Equal(t, want, m.ucxFeatures())
	require.Equal(t, uint64(1), m.ucxMajor())
	require.Equal(t, ucxFeatures(m.ucxMajor(), m.ucxMinor(), want), m.UCX)
	b := newTestAgent(t, Config{Name: "b", NoGather: true})
	md, err = b.LocalMetadata()
	require.NoError(t, err)
	mb, err := decodeMetadata(md)
	require.NoError(t, err)
	require.Zero(t, mb.ucxFeatures()&featGather, "an agent with NoGather advertises no gathers")
	m.UCX = ucxFeatures(9, 3, 0)
	m.Name = "other"
	other, err := encodeMetadata(m)
	require.NoError(t, err)
	_, err = a.LoadRemoteMetadata(other)
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.Contains(t, err.Error(), "runs UCX 9.3")
}

// A same-host producer that got long notifications and was then killed:
// once the consumer has dropped it, nothing of it stays mapped. UCX 1.13
// keeps an endpoint that sent an active message off its short path until
// the worker goes, with the dead peer's shared-memory segments (three
// mappings, about 4 MiB, per producer restart).
func TestLongNotifsLeaveNoEndpoint(t *testing.T) {
	leakcheck.Check(t)
	c := newConsumer(t, Config{Name: "consumer-of-a-long-name"}, 16, testBlock)
	base := sharedMaps(t)
	for _, n := range []int{100, 5000, 64 << 10} {
		ch := startChild(t, childOpts{name: "prod", seed: 4, blocks: 16, alloc: true})
		c.connect(t, ch)
		msg := make([]byte, n)
		rand.New(rand.NewSource(int64(n))).Read(msg)
		require.NoError(t, c.read(t, []int{0, 1}, []int{2, 3}, msg))
		c.verify(t, 4, []int{0, 1}, []int{2, 3})
		name, got := ch.nextNotif(c.a, 10*time.Second)
		require.Equal(t, "consumer-of-a-long-name", name)
		require.True(t, bytes.Equal(msg, got), "%d-byte notification differs", n)
		// A burst past the producer's queue, which it reads while the
		// consumer keeps some back.
		for i := range 200 {
			require.NoError(t, c.a.SendNotif(c.peer, []byte(fmt.Sprintf("burst %d", i))))
		}
		for i := range 200 {
			_, got := ch.nextNotif(c.a, 10*time.Second)
			require.Equal(t, fmt.Sprintf("burst %d", i), string(got))
		}
		ch.kill()
		deadline := time.Now().Add(5 * time.Second)
		for c.a.peers[c.peer].Dead == nil && time.Now().Before(deadline) {
			_, _ = c.a.Progress()
		}
		require.NotNil(t, c.a.peers[c.peer].Dead)
		require.NoError(t, c.a.ReleaseDlist(c.remote))
		require.NoError(t, c.a.InvalidateRemoteMetadata(c.peer))
		for range 100 {
			_, _ = c.a.Progress()
		}
		require.Zero(t, c.a.closingEndpoints())
		require.Equal(t, base, sharedMaps(t), "after a %d-byte notification the dead producer stays mapped", n)
	}
}

// Notifications still waiting for room in the queue of a peer that
// stopped reading it are dropped when the peer dies, and nothing more is
// sent to it. (Its endpoint's close cannot complete: UCX flushes an
// endpoint only once the peer's queue has room, and a dead peer's never
// will. It stays until Close, as README's "Failure behaviour" says.)
func TestQueuedNotifsToDeadPeerDropped(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t) // a receiver's full shared-memory queue is what they fill
	c := newConsumer(t, Config{Name: "consumer"}, 16, testBlock)
	ch := startChild(t, childOpts{name: "prod", seed: 4, blocks: 16, alloc: true})
	c.connect(t, ch)
	ch.command('S', nil, c.a)
	for i := 0; c.a.c.sending == nil && i < 100000; i++ {
		require.NoError(t, c.a.SendNotif(c.peer, []byte(fmt.Sprintf("never %d", i))))
	}
	if c.a.c.sending == nil {
		t.Skip("the transport took 100,000 notifications without refusing one (UCX_TLS=tcp): nothing waits")
	}
	waiting := c.a.waitingNotifs(c.peer)
	require.Zero(t, c.a.UndeliveredNotifs())
	ch.kill()
	deadline := time.Now().Add(5 * time.Second)
	for c.a.peers[c.peer].Dead == nil && time.Now().Before(deadline) {
		_, _ = c.a.Progress()
	}
	require.NotNil(t, c.a.peers[c.peer].Dead)
	require.Nil(t, c.a.c.sending, "notifications to the dead producer still waiting")
	require.Equal(t, uint64(waiting), c.a.UndeliveredNotifs())
	require.ErrorIs(t, c.a.SendNotif(c.peer, []byte("late")), nixl.ErrRemoteDisconnect)
	require.Nil(t, c.a.c.sending)
	require.NoError(t, c.a.ReleaseDlist(c.remote))
	require.NoError(t, c.a.InvalidateRemoteMetadata(c.peer))
}

// Notifications still waiting for room in a live peer's queue when the
// peer is dropped reach it before its endpoint closes, and before those
// sent once it is loaded again.
func TestQueuedNotifsSentBeforeClose(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t) // a receiver's full shared-memory queue is what they fill
	p := newPair(t, true)
	want := sendBurst(t, p, 300, 100)
	require.NoError(t, p.cons.ReleaseDlist(p.remote))
	require.NoError(t, p.cons.InvalidateRemoteMetadata(p.peer))
	require.Positive(t, p.cons.closingEndpoints(), "the close did not wait")
	// Loaded again, its notifications take a new endpoint to the same
	// queue: they wait behind the old endpoint's (fragments of two never
	// interleave, none overtakes another).
	md, err := p.prod.LocalMetadata()
	require.NoError(t, err)
	_, err = p.cons.LoadRemoteMetadata(md)
	require.NoError(t, err)
	for i := range 20 {
		msg := bytes.Repeat([]byte(fmt.Sprintf("again %d,", i)), 30)
		require.NoError(t, p.cons.SendNotif(p.peer, msg))
		want = append(want, msg)
	}
	got := collectNotifs(t, p.prod, len(want), 20*time.Second, p.cons)
	require.Equal(t, want, got["consumer"])
	deadline := time.Now().Add(5 * time.Second)
	for p.cons.closingEndpoints() > 0 && time.Now().Before(deadline) {
		_, err := p.cons.Progress()
		require.NoError(t, err)
	}
	require.Zero(t, p.cons.closingEndpoints())
	require.Zero(t, p.prod.DroppedNotifs())
	require.Zero(t, p.cons.UndeliveredNotifs())
}

// Notifications still waiting for a peer that reads nothing when the
// agent closes are counted undelivered, after Close too.
func TestUndeliveredAtClose(t *testing.T) {
	leakcheck.Check(t)
	withSharedMemory(t) // a receiver's full shared-memory queue is what they fill
	p := newPair(t, true)
	sendBurst(t, p, 300, 100)
	waiting := p.cons.waitingNotifs(p.peer)
	require.Positive(t, waiting)
	require.NoError(t, p.cons.Close())
	require.Equal(t, uint64(waiting), p.cons.UndeliveredNotifs())
}

// sharedMaps counts this process's shared mappings.
func sharedMaps(t *testing.T) int {
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && strings.HasSuffix(f[1], "s") {
			n++
		}
	}
	return n
}

// Over tcp between two processes on one host in error mode NONE (where
// notifications go on the short path only: ErrModeNone here, or a peer of
// a build before the tcp-alone rule), the short path takes about
// 64 KiB, so only notifications near MaxNotif go in fragments: those,
// short ones between them and ones sent with READs each arrive once,
// intact and in order, also at a producer that sleeps whenever it has
// nothing to do.
func TestFragmentedNotifsOverTCP(t *testing.T) {
	leakcheck.Check(t)
	t.Setenv("UCX_TLS", "tcp")
	ch := startChild(t, childOpts{name: "prod", seed: 5, blocks: 64, alloc: true, tls: "tcp", park: true, errMode: ErrModeNone})
	name := strings.Repeat("c", 40) // a longer name: more lengths go in fragments
	c := newConsumer(t, Config{Name: name, ErrMode: ErrModeNone}, 64, testBlock)
	c.connect(t, ch)
	to := c.a.peers[c.peer]
	require.False(t, to.peerMode, "mode NONE")
	require.Equal(t, 1, int(to.notifTo.frag), "the producer does not take fragments")
	shortMax := int(to.notifTo.short_max)
	require.Positive(t, shortMax, "the endpoint's short path was not found")
	const lengths = 48
	long := nixl.DefaultMaxNotif - lengths + 1 // the longest 48 lengths up to MaxNotif
	require.Greater(t, len(name)+long, shortMax, "these notifications would go whole: this tests nothing")
	rng := rand.New(rand.NewSource(5))
	var want [][]byte
	for i := range 300 {
		var msg []byte
		if i%3 == 0 {
			msg = []byte(fmt.Sprintf("short %d", i))
		} else {
			msg = make([]byte, long+i%lengths)
			rng.Read(msg)
		}
		if i%10 == 1 {
			idx := []int{i % 64}
			require.NoError(t, c.read(t, idx, idx, msg))
			c.verify(t, 5, idx, idx)
		} else {
			require.NoError(t, c.a.SendNotif(c.peer, msg))
			_, _ = c.a.Progress()
		}
		want = append(want, msg)
	}
	for i := range want {
		from, got := ch.nextNotif(c.a, 10*time.Second)
		require.Equal(t, name, from)
		require.True(t, bytes.Equal(want[i], got), "notification %d: %d bytes, want %d", i, len(got), len(want[i]))
	}
	require.Nil(t, c.a.c.sending, "notifications still waiting to go")
}

// Notifications waiting for a stopped peer's queue are bounded: past the
// bound (ECX_NOTIF_WAIT_MAX, lowered here) SendNotif refuses more to that
// peer with an error, sends to other peers go on, and once the peer reads
// again it gets every notification that was accepted, in order. They used
// to pile up without end, each progress call walking them all.
func TestWaitingNotifsBounded(t *testing.T) {
	withSharedMemory(t) // notifications on the short path of a NONE endpoint
	leakcheck.Check(t)
	cons := newTestAgent(t, Config{Name: "consumer"})
	live := newTestAgent(t, Config{Name: "live"})
	stopped := newTestAgent(t, Config{Name: "stopped"})
	for _, prod := range []*Agent{live, stopped} {
		md, err := prod.LocalMetadata()
		require.NoError(t, err)
		_, err = cons.LoadRemoteMetadata(md)
		require.NoError(t, err)
	}
	const bound = 32
	cons.c.notif_wait_max = bound
	var accepted [][]byte
	var refused error
	for i := 0; i < 100000; i++ {
		msg := []byte(fmt.Sprintf("s%d", i))
		if err := cons.SendNotif("stopped", msg); err != nil {
			refused = err
			break
		}
		accepted = append(accepted, msg)
	}
	require.Error(t, refused, "no notification was ever refused")
	require.ErrorIs(t, refused, nixl.ErrBackend)
	require.Equal(t, bound, cons.waitingNotifs("stopped"))
	require.Error(t, cons.SendNotif("stopped", []byte("again")), "refused again while the peer reads nothing")

	require.NoError(t, cons.SendNotif("live", []byte("to the live one")))
	got := collectNotifs(t, live, 1, 10*time.Second, cons)
	require.Equal(t, [][]byte{[]byte("to the live one")}, got["consumer"])

	got = collectNotifs(t, stopped, len(accepted), 10*time.Second, cons)
	require.Equal(t, accepted, got["consumer"], "the accepted ones, in order")
	require.Nil(t, cons.c.sending)
	require.NoError(t, cons.SendNotif("stopped", []byte("after")))
	got = collectNotifs(t, stopped, 1, 10*time.Second, cons)
	require.Equal(t, [][]byte{[]byte("after")}, got["consumer"])
}
