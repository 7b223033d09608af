package ecxfer

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
	"github.com/ecxfer/ecxfer/reactor"
)

// Fuzz targets over hostile input and hostile call sequences, all on the
// loopback engine: fuzzed bytes never reach UCX, whose parsers trust their
// input (the ucx metadata decoder, pure Go, has its own target in
// nixl/ucx).

// sentinels are the errors the transport documents.
var sentinels = []error{ErrUnknownPeer, ErrIndexMismatch, ErrIndexRange, ErrBadHandle,
	ErrBadMetadata, ErrBadDescriptor, ErrBadNotif, ErrClosed, ErrBusy,
	ErrRemoteDisconnect, ErrTimeout, ErrCanceled, ErrEngine}

func isSentinel(err error) bool {
	for _, s := range sentinels {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// fuzzPair is a loopback producer and consumer that live for a whole fuzz
// run.
func fuzzPair(f *testing.F, bs, nb int) (prod, cons *Transport) {
	mk := func(prefix string) *Transport {
		tr, err := New(Config{AgentName: uniqueName(prefix), Backend: "loopback", BlockSize: bs, NumBlocks: nb,
			XferTimeout: 2 * time.Second})
		if err != nil {
			f.Fatal(err)
		}
		f.Cleanup(func() { _ = tr.Deregister() })
		return tr
	}
	prod, cons = mk("fz-prod"), mk("fz-cons")
	for i := range prod.Region() {
		prod.Region()[i] = byte(i*7 + i>>12)
	}
	return prod, cons
}

// checkAccepted checks what an AddRemotePeer accepted: a valid name, and a
// descriptor list that lies inside the producer's region when the peer is
// the producer; then a READ of it ends in DONE with the right bytes or in
// ERR with a sentinel, and the peer is removed again.
func checkAccepted(t *testing.T, prod, cons *Transport, name string, desc []byte) {
	if err := ValidAgentName(name); err != nil {
		t.Fatalf("accepted peer name %q: %v", name, err)
	}
	descs, err := descriptors.Decode(desc)
	if err != nil {
		t.Fatalf("accepted a descriptor list that does not decode: %v", err)
	}
	region := prod.Region()
	base, size := uint64(addrOf(region)), uint64(len(region))
	if name == prod.cfg.AgentName {
		for i, d := range descs {
			if d.Addr < base || d.Len > size || d.Addr-base > size-d.Len {
				t.Fatalf("descriptor %d [%#x,+%d) outside the producer's region [%#x,+%d) accepted", i, d.Addr, d.Len, base, size)
			}
		}
	}
	bs := uint64(cons.cfg.BlockSize)
	for i, d := range descs {
		if d.Len != bs {
			continue
		}
		h, err := cons.PostRead([]int{1}, name, []int{i}, []byte("fz"))
		if err != nil {
			if !isSentinel(err) {
				t.Fatalf("PostRead: %v is not a documented error", err)
			}
			break
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		werr := cons.Wait(ctx, h)
		cancel()
		st, serr := cons.CheckXferState(h)
		switch {
		case st == StateDone:
			got := cons.Region()[bs : 2*bs]
			want := region[d.Addr-base : d.Addr-base+bs]
			if string(got) != string(want) {
				t.Fatalf("READ of descriptor %d returned other bytes", i)
			}
		case st == StateErr && isSentinel(serr):
		default:
			t.Fatalf("READ ended in %v, %v (Wait: %v)", st, serr, werr)
		}
		if err := cons.ReleaseXferHandle(h); err != nil {
			t.Fatal(err)
		}
		break
	}
	_ = prod.NewNotifs()
	if err := cons.RemoveRemotePeer(name); err != nil {
		t.Fatalf("RemoveRemotePeer(%q): %v", name, err)
	}
}

// FuzzAddRemotePeerMetadata: arbitrary agent metadata through
// AddRemotePeer, with the producer's genuine descriptor list.
func FuzzAddRemotePeerMetadata(f *testing.F) {
	prod, cons := fuzzPair(f, 1024, 8)
	md, desc := prod.AgentMetadata(), prod.MemDescriptor()
	f.Add(md)
	f.Add([]byte{})
	f.Add(md[:len(md)-1])
	f.Add(append(append([]byte(nil), md...), 0))
	for _, i := range []int{0, 1, 5, 17, 20, len(md) - 2} {
		m := append([]byte(nil), md...)
		m[i%len(m)] ^= 0x41
		f.Add(m)
	}
	f.Add(renameMeta(f, "loopback", md, "a b"))
	f.Add(renameMeta(f, "loopback", md, "x"))
	lm := decodeLoopbackMeta(f, md)
	lm.regions = append(lm.regions, [2]uint64{0x1000, 1 << 40})
	f.Add(lm.encode(f))
	lm.regions = [][2]uint64{{1 << 63, 1 << 63}}
	f.Add(lm.encode(f))
	f.Fuzz(func(t *testing.T, md []byte) {
		name, err := cons.AddRemotePeer(md, desc)
		if err != nil {
			if !errors.Is(err, ErrBadMetadata) && !errors.Is(err, ErrBadDescriptor) {
				t.Fatalf("AddRemotePeer: %v is not ErrBadMetadata or ErrBadDescriptor", err)
			}
			if name != "" {
				t.Fatalf("AddRemotePeer failed but named %q", name)
			}
			return
		}
		checkAccepted(t, prod, cons, name, desc)
	})
}

// FuzzAddRemotePeerDescriptor: arbitrary memory descriptor lists through
// AddRemotePeer, with the producer's genuine metadata. Whatever is
// accepted lies inside the producer's region.
func FuzzAddRemotePeerDescriptor(f *testing.F) {
	prod, cons := fuzzPair(f, 1024, 8)
	md, desc := prod.AgentMetadata(), prod.MemDescriptor()
	base := uint64(addrOf(prod.Region()))
	enc := func(l descriptors.List) []byte {
		b, err := descriptors.Encode(l)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	f.Add(desc)
	f.Add([]byte{0x90})
	f.Add([]byte{})
	f.Add(desc[:len(desc)-1])
	f.Add(enc(descriptors.List{{Addr: base + 8*1024 - 1024, Len: 1024}}))
	f.Add(enc(descriptors.List{{Addr: base + 8*1024 - 1023, Len: 1024}}))
	f.Add(enc(descriptors.List{{Addr: base - 1, Len: 1024}}))
	f.Add(enc(descriptors.List{{Addr: base + 1, Len: 1024}, {Addr: base, Len: 8 * 1024}}))
	f.Add(enc(descriptors.List{{Addr: base, Len: 1 << 62}}))
	f.Add(enc(descriptors.List{{Addr: 0, Len: 1}}))
	f.Add([]byte{0x91, 0x93, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0, 0x20, 0x00})
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, desc []byte) {
		name, err := cons.AddRemotePeer(md, desc)
		if err != nil {
			if !errors.Is(err, ErrBadDescriptor) && !errors.Is(err, ErrBadMetadata) {
				t.Fatalf("AddRemotePeer: %v is not ErrBadDescriptor", err)
			}
			return
		}
		checkAccepted(t, prod, cons, name, desc)
	})
}

// opReader decodes fuzz bytes into operations; past the end it reads
// zeros.
type opReader struct {
	b []byte
}

func (r *opReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *opReader) u64() uint64 {
	var w [8]byte
	n := copy(w[:], r.b)
	r.b = r.b[n:]
	return binary.LittleEndian.Uint64(w[:])
}

// index returns a block index, now and then out of range.
func (r *opReader) index(nb int) int {
	c := r.byte()
	switch {
	case c < 200:
		return int(c) % nb
	case c < 220:
		return nb + int(c-200)
	case c < 240:
		return -1 - int(c-220)
	}
	return int(int64(r.u64()))
}

// FuzzTransportOps drives a loopback producer/consumer pair with arbitrary
// operation sequences: posts (indices in and out of range), releases (of
// READs in flight too), checks, waits with short contexts, peer removal
// and re-adding, producer restarts, bogus handles and injected engine
// faults. Invariants: no panic; every error is a documented sentinel;
// every accepted READ ends in DONE or ERR unless released, and its bytes
// are right when DONE; at the end nothing is live and nothing leaked.
func FuzzTransportOps(f *testing.F) {
	f.Add([]byte{0, 1, 0, 1, 2, 3, 4, 5, 6, 7})
	f.Add([]byte{0, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 0, 1, 0})
	f.Add([]byte{9, 3, 0, 2, 1, 2, 3, 4, 4, 0, 2, 7, 7, 5, 0, 1, 9, 9, 9})
	f.Add([]byte{8, 2, 0, 3, 1, 1, 1, 1, 1, 1, 3, 0, 10, 0, 2, 5, 5, 11, 0, 1, 0})
	f.Add([]byte{7, 1, 0, 0, 2, 8, 8, 8, 8, 1, 0, 6, 1, 2, 3, 4, 5, 6, 7, 8, 12, 0, 3, 0, 0})
	f.Add([]byte{0, 3, 250, 1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 13, 0, 2, 1, 1, 3, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 512 {
			data = data[:512]
		}
		runOps(t, data)
	})
}

func runOps(t *testing.T, data []byte) {
	const bs, nb = 256, 16
	base := leakcheck.Take()
	newT := func(name string, o reactor.Options) *Transport {
		tr, err := New(Config{AgentName: name, Backend: "loopback", BlockSize: bs, NumBlocks: nb,
			XferTimeout: time.Second, Reactor: o})
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	pname := uniqueName("fo-prod")
	gen := byte(1)
	fill := func(tr *Transport, g byte) {
		for i := range tr.Region() {
			tr.Region()[i] = byte(i/bs)*16 + g
		}
	}
	prod := newT(pname, reactor.Options{})
	fill(prod, gen)
	cons := newT(uniqueName("fo-cons"), reactor.Options{Handles: 256, SubmitRing: 16})
	eng := cons.agent.(*loopback.Agent)
	defer func() {
		_ = cons.Deregister()
		_ = prod.Deregister()
		if err := base.Wait(5 * time.Second); err != nil {
			t.Errorf("leak: %v", err)
		}
	}()
	check := func(what string, err error) {
		if err != nil && !isSentinel(err) {
			t.Fatalf("%s: %v is not a documented error", what, err)
		}
	}
	type read struct {
		h             Handle
		local, remote []int
		gen           byte
		genuine       bool // posted while the producer's own list was loaded
	}
	var reads []read
	var last Handle           // the most recently accepted READ
	localUse := map[int]int{} // how many accepted READs wrote each local block
	known := true             // the consumer has the producer's name loaded
	genuine := true           // ... with the producer's own metadata and list
	add := func() {
		name, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		check("AddRemotePeer", err)
		if err != nil {
			t.Fatalf("re-adding the producer: %v", err)
		}
		if name != pname {
			t.Fatalf("AddRemotePeer named %q, want %q", name, pname)
		}
		known, genuine = true, true
	}
	add()
	pick := func(r *opReader) int {
		if len(reads) == 0 {
			return -1
		}
		return int(r.byte()) % len(reads)
	}
	r := &opReader{b: data}
	for len(r.b) > 0 {
		switch op := r.byte() % 14; op {
		case 0, 1: // post
			n := int(r.byte()%5) + int(op) // 0..5 blocks, op 1 adds one
			local, remote := make([]int, n), make([]int, n)
			for i := range local {
				local[i], remote[i] = r.index(nb), r.index(nb)
			}
			if r.byte()%8 == 0 && n > 0 {
				remote = remote[:n-1]
			}
			var notif []byte
			if c := r.byte(); c%4 == 0 {
				notif = make([]byte, int(c)*300) // now and then too large
			}
			h, err := cons.PostRead(local, pname, remote, notif)
			check("PostRead", err)
			if err == nil {
				if h == 0 {
					t.Fatal("PostRead returned handle 0 without an error")
				}
				reads = append(reads, read{h, local, remote, gen, genuine})
				last = h
				for _, li := range local {
					localUse[li]++
				}
			} else if h != 0 {
				t.Fatalf("PostRead failed (%v) and returned handle %#x", err, h)
			}
		case 2: // release, maybe in flight
			if i := pick(r); i >= 0 {
				check("ReleaseXferHandle", cons.ReleaseXferHandle(reads[i].h))
				if err := cons.ReleaseXferHandle(reads[i].h); !errors.Is(err, ErrBadHandle) {
					t.Fatalf("second release: %v, want ErrBadHandle", err)
				}
				reads = append(reads[:i], reads[i+1:]...)
			}
		case 3: // check
			if i := pick(r); i >= 0 {
				st, err := cons.CheckXferState(reads[i].h)
				check("CheckXferState", err)
				if (st == StateErr) != (err != nil) {
					t.Fatalf("state %v with error %v", st, err)
				}
			}
		case 4: // wait with a short context
			if i := pick(r); i >= 0 {
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r.byte()%4)*time.Millisecond)
				err := cons.Wait(ctx, reads[i].h)
				cancel()
				if !errors.Is(err, context.DeadlineExceeded) {
					check("Wait", err)
				}
			}
		case 5: // remove the peer
			err := cons.RemoveRemotePeer(pname)
			check("RemoveRemotePeer", err)
			if known != (err == nil) {
				t.Fatalf("RemoveRemotePeer = %v with the peer loaded = %v", err, known)
			}
			known = false
		case 6: // (re-)add the peer
			add()
		case 7: // bogus handles
			h := Handle(r.u64())
			st, err := cons.CheckXferState(h)
			check("CheckXferState(bogus)", err)
			if st == StateErr && err == nil {
				t.Fatal("ERR without an error")
			}
			mine := false
			for _, rd := range reads {
				mine = mine || rd.h == h
			}
			if !mine {
				if err := cons.ReleaseXferHandle(h); !errors.Is(err, ErrBadHandle) {
					t.Fatalf("release of bogus handle %#x: %v", h, err)
				}
			}
		case 8: // engine faults
			statuses := []nixl.Status{nixl.ErrBackend, nixl.ErrRemoteDisconnect, nixl.ErrCanceled, nixl.ErrNotAllowed, nixl.ErrUnknown}
			eng.FailNext(int(r.byte()%4), statuses[int(r.byte())%len(statuses)])
		case 9: // completion delays
			eng.SetDelay(time.Duration(r.byte()%4) * time.Millisecond)
		case 10: // cut and mend the link
			if r.byte()%2 == 0 {
				eng.Disconnect(pname)
			} else {
				eng.Reconnect(pname)
			}
		case 11: // the producer drains its notifications
			if prod.NewNotifs() == nil {
				t.Fatal("NewNotifs returned nil")
			}
		case 12: // the producer restarts: new process, same name
			if err := prod.Deregister(); err != nil {
				t.Fatal(err)
			}
			gen++
			prod = newT(pname, reactor.Options{})
			fill(prod, gen)
			if r.byte()%2 == 0 {
				add()
			}
		case 13: // hostile metadata or descriptors
			md, desc := prod.AgentMetadata(), prod.MemDescriptor()
			if c := r.byte(); c%2 == 0 {
				md = append([]byte(nil), md...)
				md[int(r.byte())%len(md)] ^= r.byte() | 1
			} else {
				desc = append([]byte(nil), desc...)
				desc[int(r.byte())%len(desc)] ^= r.byte() | 1
			}
			name, err := cons.AddRemotePeer(md, desc)
			check("AddRemotePeer(hostile)", err)
			if err == nil && name != pname {
				// Loaded under another name: forget it again.
				check("RemoveRemotePeer", cons.RemoveRemotePeer(name))
			}
			// A changed blob under the producer's name replaces the peer
			// (a restart), even when its descriptors are then refused; a
			// changed list that is accepted reads other bytes.
			known = cons.PeerPath(pname) != ""
			if err == nil && name == pname {
				genuine = false
			}
		}
	}

	// Everything accepted ends, and DONE means the right bytes (for the
	// producer generation it was posted to, as long as no later READ
	// overwrote the same local block).
	eng.SetDelay(0)
	eng.FailNext(0, 0)
	eng.Reconnect(pname)
	for i, rd := range reads {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		err := cons.Wait(ctx, rd.h)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("accepted READ %d still in flight after 20s", i)
		}
		check("Wait", err)
		st, serr := cons.CheckXferState(rd.h)
		if (st == StateErr) != (serr != nil) || st == StateProc {
			t.Fatalf("final state %v, %v", st, serr)
		}
		if st == StateDone && rd.h == last && rd.genuine {
			for k, li := range rd.local {
				if localUse[li] != 1 {
					continue // another READ wrote it too
				}
				got := cons.Region()[li*bs : (li+1)*bs]
				want := byte(rd.remote[k])*16 + rd.gen
				for _, b := range got {
					if b != want {
						t.Fatalf("DONE READ: local block %d holds %#x, want %#x", li, b, want)
					}
				}
			}
		}
		check("ReleaseXferHandle", cons.ReleaseXferHandle(rd.h))
	}
	// A READ released in flight is freed by the reactor shortly after.
	deadline := time.Now().Add(10 * time.Second)
	for s := cons.Stats(); s.LiveHandles != 0 || s.InFlight != 0; s = cons.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("10s after releasing everything: %d live handles, %d in flight", s.LiveHandles, s.InFlight)
		}
		time.Sleep(100 * time.Microsecond)
	}

	// Whatever happened, the transport still works: re-added, the current
	// producer reads back exactly.
	add()
	all := make([]int, nb)
	rev := make([]int, nb)
	for i := range all {
		all[i], rev[i] = i, nb-1-i
	}
	h, err := cons.PostRead(all, pname, rev, []byte("end"))
	if err != nil {
		t.Fatalf("final READ: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := cons.Wait(ctx, h); err != nil {
		t.Fatalf("final READ: %v", err)
	}
	for i := range all {
		if b := cons.Region()[i*bs]; b != byte(rev[i])*16+gen {
			t.Fatalf("final READ: block %d holds %#x", i, b)
		}
	}
	check("ReleaseXferHandle", cons.ReleaseXferHandle(h))
}
