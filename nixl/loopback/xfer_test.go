package loopback

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

func seq(from, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = from + i
	}
	return s
}

func reversed(s []int) []int {
	slices.Reverse(s)
	return s
}

func TestTransferBytes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	perm := rng.Perm(numBlocks)
	tests := []struct {
		name        string
		local, remo []int
	}{
		{"contiguous", seq(0, numBlocks), seq(0, numBlocks)},
		{"single", []int{3}, []int{11}},
		{"shifted run", seq(0, 4), seq(8, 4)},
		{"reversed", reversed(seq(0, numBlocks)), seq(0, numBlocks)},
		{"scattered", perm[:7], perm[7:14]},
		{"permutation", seq(0, numBlocks), perm},
		{"repeated source", []int{0, 1, 2}, []int{5, 5, 5}},
	}
	for _, op := range []nixl.Op{nixl.Read, nixl.Write} {
		for _, tc := range tests {
			if op == nixl.Write && tc.name == "repeated source" {
				continue // several writes to one block: order is not part of the contract
			}
			t.Run(op.String()+"/"+tc.name, func(t *testing.T) {
				p := newSide(t, "bytes-p")
				c := newSide(t, "bytes-c")
				rd := link(t, c, p)
				fill(rng, p.buf)
				fill(rng, c.buf)
				pBefore, cBefore := bytes.Clone(p.buf), bytes.Clone(c.buf)
				wantP, wantC := bytes.Clone(p.buf), bytes.Clone(c.buf)
				for i := range tc.local {
					if op == nixl.Read {
						copy(block(wantC, tc.local[i]), block(pBefore, tc.remo[i]))
					} else {
						copy(block(wantP, tc.remo[i]), block(cBefore, tc.local[i]))
					}
				}

				x, err := c.a.MakeXfer(op, c.dlocal, tc.local, rd, tc.remo, nil)
				must(t, err)
				must(t, c.a.PostXfer(x))
				// Nothing moves before Progress: the request is in flight.
				done, err := c.a.XferStatus(x)
				if done || err != nil {
					t.Fatalf("XferStatus before Progress = %v, %v; want in flight", done, err)
				}
				sameBytes(t, "consumer before Progress", c.buf, cBefore)
				sameBytes(t, "producer before Progress", p.buf, pBefore)
				if n := c.a.PollCompletions(make([]nixl.Completion, 4)); n != 0 {
					t.Fatalf("%d completions before Progress", n)
				}

				did, err := c.a.Progress()
				must(t, err)
				if !did {
					t.Fatal("Progress did no work")
				}
				must(t, waitDone(t, c.a, x))
				sameBytes(t, "consumer", c.buf, wantC)
				sameBytes(t, "producer", p.buf, wantP)
				got := drainCompletions(c.a)
				if len(got) != 1 || got[0].ID != x || got[0].Err != nil {
					t.Fatalf("completions %+v", got)
				}
				if did, _ := c.a.Progress(); did {
					t.Fatal("idle Progress reported work")
				}
				if n := len(notifs(p.a)); n != 0 {
					t.Fatalf("%d notifications for an empty notif", n)
				}
			})
		}
	}
}

// TestNotificationAfterData has the data owner watch its inbox on its own
// goroutine: when the notification shows up, the bytes must be in place.
func TestNotificationAfterData(t *testing.T) {
	for _, op := range []nixl.Op{nixl.Read, nixl.Write} {
		t.Run(op.String(), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(3, uint64(op)))
			p := newSide(t, "notif-p")
			c := newSide(t, "notif-c")
			rd := link(t, c, p)
			fill(rng, p.buf)
			fill(rng, c.buf)
			local, remote := []int{9, 4, 5, 6}, []int{0, 1, 2, 15}
			want := bytes.Clone(p.buf)
			if op == nixl.Read {
				want = bytes.Clone(c.buf)
			}
			for i := range local {
				if op == nixl.Read {
					copy(block(want, local[i]), block(p.buf, remote[i]))
				} else {
					copy(block(want, remote[i]), block(c.buf, local[i]))
				}
			}
			msg := []byte("image-42\x00\xff")

			got := make(chan map[string][][]byte)
			stop := make(chan struct{})
			go func() { // the producer's driver
				m := map[string][][]byte{}
				take := func() bool {
					if p.a.GetNotifs(m) == 0 {
						return false
					}
					// Read the landed bytes before anything else.
					dst := c.buf
					if op == nixl.Write {
						dst = p.buf
					}
					if !bytes.Equal(dst, want) {
						m["data missing"] = nil
					}
					return true
				}
				for !take() {
					select {
					case <-stop:
						// Once more: the notification may have come
						// between the last look and stop.
						take()
						got <- m
						return
					default:
					}
				}
				<-stop
				got <- m
			}()

			x, err := c.a.MakeXfer(op, c.dlocal, local, rd, remote, msg)
			must(t, err)
			msg[0] = 'X' // MakeXfer copied it
			must(t, c.a.PostXfer(x))
			must(t, waitDone(t, c.a, x))
			time.Sleep(10 * time.Millisecond)
			close(stop)
			m := <-got
			if _, bad := m["data missing"]; bad {
				t.Fatal("notification seen before the data landed")
			}
			msgs := m["notif-c"]
			if len(m) != 1 || len(msgs) != 1 || string(msgs[0]) != "image-42\x00\xff" {
				t.Fatalf("notifications %q", m)
			}
			if n := len(notifs(p.a)); n != 0 {
				t.Fatalf("%d extra notifications", n)
			}
			if n := len(notifs(c.a)); n != 0 {
				t.Fatalf("initiator got %d notifications", n)
			}
		})
	}
}

func TestMakeXferHostile(t *testing.T) {
	p := newSide(t, "mk-p")
	c := newSide(t, "mk-c")
	rd := link(t, c, p)
	// A remote list whose descriptors are half a block long.
	half, err := c.a.PrepDlist("mk-p", descriptors.BuildBlockDescs(nixl.Addr(p.buf), 4, blockSize/2, 0), nixl.DRAM)
	must(t, err)
	released, err := c.a.PrepDlist("", c.descs[:1], nixl.DRAM)
	must(t, err)
	must(t, c.a.ReleaseDlist(released))

	tests := []struct {
		name        string
		op          nixl.Op
		local, remo nixl.DlistID
		li, ri      []int
		want        error
		alsoIs      error
	}{
		{"ok", nixl.Read, c.dlocal, rd, []int{0}, []int{0}, nil, nil},
		{"bad op", nixl.Op(5), c.dlocal, rd, []int{0}, []int{0}, nixl.ErrInvalidParam, nil},
		{"zero local", nixl.Read, 0, rd, []int{0}, []int{0}, nixl.ErrNotFound, nil},
		{"zero remote", nixl.Read, c.dlocal, 0, []int{0}, []int{0}, nixl.ErrNotFound, nil},
		{"unknown local", nixl.Read, 4242, rd, []int{0}, []int{0}, nixl.ErrNotFound, nil},
		{"released local", nixl.Read, released, rd, []int{0}, []int{0}, nixl.ErrNotFound, nil},
		{"swapped lists", nixl.Read, rd, c.dlocal, []int{0}, []int{0}, nixl.ErrInvalidParam, nil},
		{"two local", nixl.Write, c.dlocal, c.dlocal, []int{0}, []int{0}, nixl.ErrInvalidParam, nil},
		{"empty", nixl.Read, c.dlocal, rd, nil, nil, nixl.ErrInvalidParam, nil},
		{"count mismatch", nixl.Read, c.dlocal, rd, []int{0, 1}, []int{0}, nixl.ErrInvalidParam, descriptors.ErrIndexMismatch},
		{"local negative", nixl.Read, c.dlocal, rd, []int{-1}, []int{0}, nixl.ErrInvalidParam, descriptors.ErrIndexRange},
		{"local past end", nixl.Read, c.dlocal, rd, []int{numBlocks}, []int{0}, nixl.ErrInvalidParam, descriptors.ErrIndexRange},
		{"remote past end", nixl.Write, c.dlocal, rd, []int{0}, []int{numBlocks}, nixl.ErrInvalidParam, descriptors.ErrIndexRange},
		{"length mismatch", nixl.Read, c.dlocal, half, []int{0}, []int{0}, nixl.ErrMismatch, descriptors.ErrLenMismatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			id, err := c.a.MakeXfer(tc.op, tc.local, tc.li, tc.remo, tc.ri, []byte("n"))
			if tc.want == nil {
				must(t, err)
				if id == 0 {
					t.Fatal("zero XferID")
				}
				must(t, c.a.ReleaseXfer(id))
				return
			}
			mustIs(t, err, tc.want)
			if tc.alsoIs != nil {
				mustIs(t, err, tc.alsoIs)
			}
			if id != 0 {
				t.Fatalf("id %d on error", id)
			}
		})
	}
	if len(c.a.xfers) != 0 {
		t.Fatalf("%d requests left", len(c.a.xfers))
	}
}

func TestXferIDs(t *testing.T) {
	p := newSide(t, "id-p")
	c := newSide(t, "id-c")
	rd := link(t, c, p)
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, nil)
	must(t, err)

	done, err := c.a.XferStatus(x)
	mustIs(t, err, nixl.ErrNotPosted)
	if done {
		t.Fatal("unposted request reported done")
	}
	for _, id := range []nixl.XferID{0, x + 1000} {
		mustIs(t, c.a.PostXfer(id), nixl.ErrNotFound)
		_, err := c.a.XferStatus(id)
		mustIs(t, err, nixl.ErrNotFound)
		mustIs(t, c.a.ReleaseXfer(id), nixl.ErrNotFound)
	}

	must(t, c.a.PostXfer(x))
	mustIs(t, c.a.PostXfer(x), nixl.ErrRepostActive)
	must(t, waitDone(t, c.a, x))
	// A finished request may be posted again; each post completes once.
	must(t, c.a.PostXfer(x))
	must(t, waitDone(t, c.a, x))
	got := drainCompletions(c.a)
	if len(got) != 1 || got[0].ID != x {
		t.Fatalf("completions %+v; want the second post only", got)
	}
	must(t, c.a.PostXfer(x))
	must(t, waitDone(t, c.a, x))
	if got := drainCompletions(c.a); len(got) != 1 || got[0].ID != x {
		t.Fatalf("completions %+v", got)
	}

	must(t, c.a.ReleaseXfer(x))
	mustIs(t, c.a.ReleaseXfer(x), nixl.ErrNotFound)
	mustIs(t, c.a.PostXfer(x), nixl.ErrNotFound)
	_, err = c.a.XferStatus(x)
	mustIs(t, err, nixl.ErrNotFound)
	y, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, nil)
	must(t, err)
	if y == x {
		t.Fatal("released ID reused")
	}
}

func TestReleaseCancels(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	p := newSide(t, "cancel-p")
	c := newSide(t, "cancel-c")
	rd := link(t, c, p)
	fill(rng, p.buf)
	before := bytes.Clone(c.buf)

	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, seq(0, numBlocks), rd, seq(0, numBlocks), []byte("bye"))
	must(t, err)
	must(t, c.a.PostXfer(x))
	mustIs(t, c.a.ReleaseDlist(rd), nixl.ErrNotAllowed) // in use
	must(t, c.a.ReleaseXfer(x))
	did, err := c.a.Progress()
	must(t, err)
	if did {
		t.Fatal("Progress ran a cancelled request")
	}
	sameBytes(t, "consumer", c.buf, before)
	if got := drainCompletions(c.a); len(got) != 0 {
		t.Fatalf("cancelled request reported: %+v", got)
	}
	if n := len(notifs(p.a)); n != 0 {
		t.Fatalf("cancelled request notified %d times", n)
	}

	// Releasing a finished, unreported request drops its completion.
	y, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, nil)
	must(t, err)
	must(t, c.a.PostXfer(y))
	must(t, waitDone(t, c.a, y))
	must(t, c.a.ReleaseXfer(y))
	if got := drainCompletions(c.a); len(got) != 0 {
		t.Fatalf("released request reported: %+v", got)
	}
	must(t, c.a.ReleaseDlist(rd))
}

func TestPollCompletionsBounded(t *testing.T) {
	p := newSide(t, "poll-p")
	c := newSide(t, "poll-c")
	rd := link(t, c, p)
	var ids []nixl.XferID
	for i := range 10 {
		x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{i}, rd, []int{i}, nil)
		must(t, err)
		must(t, c.a.PostXfer(x))
		ids = append(ids, x)
	}
	if n := c.a.PollCompletions(nil); n != 0 {
		t.Fatalf("PollCompletions(nil) = %d", n)
	}
	_, err := c.a.Progress()
	must(t, err)
	seen := map[nixl.XferID]int{}
	buf := make([]nixl.Completion, 3)
	for _, want := range []int{3, 3, 3, 1, 0} {
		n := c.a.PollCompletions(buf)
		if n != want {
			t.Fatalf("PollCompletions = %d, want %d", n, want)
		}
		for _, cp := range buf[:n] {
			if cp.Err != nil {
				t.Fatalf("completion %+v", cp)
			}
			seen[cp.ID]++
		}
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Fatalf("request %d reported %d times", id, seen[id])
		}
	}
}

func TestInvalidateInFlight(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	p := newSide(t, "inv-p")
	c := newSide(t, "inv-c")
	rd := link(t, c, p)
	fill(rng, p.buf)
	before := bytes.Clone(c.buf)
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0, 1}, rd, []int{0, 1}, []byte("n"))
	must(t, err)
	must(t, c.a.PostXfer(x))

	must(t, c.a.InvalidateRemoteMetadata("inv-p"))
	done, err := c.a.XferStatus(x)
	if !done {
		t.Fatal("in-flight request survived invalidation")
	}
	mustIs(t, err, nixl.ErrRemoteDisconnect)
	if _, err := c.a.Progress(); err != nil {
		t.Fatal(err)
	}
	sameBytes(t, "consumer", c.buf, before)
	if n := len(notifs(p.a)); n != 0 {
		t.Fatalf("%d notifications", n)
	}
	if got := drainCompletions(c.a); len(got) != 1 || !errors.Is(got[0].Err, nixl.ErrRemoteDisconnect) {
		t.Fatalf("completions %+v", got)
	}

	// The peer's list is dead, but can be released.
	_, err = c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, nil)
	mustIs(t, err, nixl.ErrNotFound)
	mustIs(t, c.a.PostXfer(x), nixl.ErrNotFound)
	_, err = c.a.PrepDlist("inv-p", p.descs, nixl.DRAM)
	mustIs(t, err, nixl.ErrNotFound)
	mustIs(t, c.a.SendNotif("inv-p", []byte("m")), nixl.ErrNotFound)
	must(t, c.a.ReleaseDlist(rd))
	must(t, c.a.ReleaseXfer(x))

	// Reload: works again.
	rd = link(t, c, p)
	y, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0, 1}, rd, []int{0, 1}, nil)
	must(t, err)
	must(t, c.a.PostXfer(y))
	must(t, waitDone(t, c.a, y))
	sameBytes(t, "consumer", c.buf[:2*blockSize], p.buf[:2*blockSize])
}

func TestRestart(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	c := newSide(t, "rs-c")
	p1, err := New("rs-p")
	must(t, err)
	_, buf1, err := p1.AllocMem(numBlocks*blockSize, nixl.DRAM, 0)
	must(t, err)
	md1, err := p1.LocalMetadata()
	must(t, err)
	_, err = c.a.LoadRemoteMetadata(md1)
	must(t, err)
	rd, err := c.a.PrepDlist("rs-p", descriptors.BuildBlockDescs(nixl.Addr(buf1), numBlocks, blockSize, 0), nixl.DRAM)
	must(t, err)
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, []byte("old"))
	must(t, err)
	must(t, c.a.PostXfer(x))

	// The producer restarts: same name, new incarnation, new memory.
	must(t, p1.Close())
	p2 := newSide(t, "rs-p")
	fill(rng, p2.buf)
	mustIs(t, waitDone(t, c.a, x), nixl.ErrRemoteDisconnect)

	md2, err := p2.a.LocalMetadata()
	must(t, err)
	name, err := c.a.LoadRemoteMetadata(md2)
	mustIs(t, err, nixl.ErrNotAllowed)
	must(t, c.a.InvalidateRemoteMetadata(name))
	must(t, c.a.ReleaseXfer(x))
	must(t, c.a.ReleaseDlist(rd))
	rd = link(t, c, p2)
	y, err := c.a.MakeXfer(nixl.Read, c.dlocal, seq(0, numBlocks), rd, seq(0, numBlocks), []byte("new"))
	must(t, err)
	must(t, c.a.PostXfer(y))
	must(t, waitDone(t, c.a, y))
	sameBytes(t, "consumer", c.buf, p2.buf)
	if m := notifs(p2.a); len(m) != 1 || len(m["rs-c"]) != 1 || string(m["rs-c"][0]) != "new" {
		t.Fatalf("notifications %q", m)
	}
}

// TestRangeAcrossRegions: two adjacent registered regions; descriptors
// merge into a run that crosses from one into the other.
func TestRangeAcrossRegions(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	p := newAgent(t, "adj-p")
	c := newSide(t, "adj-c")
	heap := make([]byte, numBlocks*blockSize)
	fill(rng, heap)
	_, err := p.RegisterMem(heap[:len(heap)/2], nixl.DRAM, 0)
	must(t, err)
	_, err = p.RegisterMem(heap[len(heap)/2:], nixl.DRAM, 0)
	must(t, err)
	md, err := p.LocalMetadata()
	must(t, err)
	_, err = c.a.LoadRemoteMetadata(md)
	must(t, err)
	descs := descriptors.BuildBlockDescs(nixl.Addr(heap), numBlocks, blockSize, 0)
	rd, err := c.a.PrepDlist("adj-p", descs, nixl.DRAM)
	must(t, err)
	// One descriptor straddling the two regions is refused.
	_, err = c.a.PrepDlist("adj-p", descriptors.List{{Addr: nixl.Addr(heap) + uint64(len(heap)/2) - 8, Len: 16}}, nixl.DRAM)
	mustIs(t, err, nixl.ErrInvalidParam)

	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, seq(0, numBlocks), rd, seq(0, numBlocks), nil)
	must(t, err)
	if n := len(c.a.xfers[x].ranges); n != 1 {
		t.Fatalf("%d merged ranges, want 1", n)
	}
	must(t, c.a.PostXfer(x))
	must(t, waitDone(t, c.a, x))
	sameBytes(t, "consumer", c.buf, heap)
}

// TestSelfTransfer: an agent that loads its own metadata moves bytes
// within its memory and notifies itself.
func TestSelfTransfer(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	s := newSide(t, "self")
	fill(rng, s.buf)
	rd := link(t, s, s)
	want := bytes.Clone(s.buf)
	copy(block(want, 0), block(s.buf, 15))
	x, err := s.a.MakeXfer(nixl.Read, s.dlocal, []int{0}, rd, []int{15}, []byte("me"))
	must(t, err)
	must(t, s.a.PostXfer(x))
	must(t, waitDone(t, s.a, x))
	sameBytes(t, "self", s.buf, want)
	if m := notifs(s.a); len(m["self"]) != 1 || string(m["self"][0]) != "me" {
		t.Fatalf("notifications %q", m)
	}
}

func TestSendNotif(t *testing.T) {
	p := newSide(t, "sn-p")
	c := newSide(t, "sn-c")
	link(t, c, p)
	mustIs(t, c.a.SendNotif("nobody", []byte("x")), nixl.ErrNotFound)
	mustIs(t, c.a.SendNotif("", []byte("x")), nixl.ErrNotFound)

	msg := []byte("hello")
	must(t, c.a.SendNotif("sn-p", msg))
	must(t, c.a.SendNotif("sn-p", []byte{}))
	msg[0] = 'J' // the agent sent a copy
	if n := p.a.GetNotifs(nil); n != 0 {
		t.Fatalf("GetNotifs(nil) = %d", n)
	}
	dst := map[string][][]byte{"earlier": {[]byte("kept")}}
	if n := p.a.GetNotifs(dst); n != 2 {
		t.Fatalf("GetNotifs = %d, want 2", n)
	}
	got := dst["sn-c"]
	if len(dst) != 2 || len(got) != 2 || string(got[0]) != "hello" || len(got[1]) != 0 || string(dst["earlier"][0]) != "kept" {
		t.Fatalf("notifications %q", dst)
	}
	got[0][0] = 'Y' // the caller owns the slices
	must(t, c.a.SendNotif("sn-p", []byte("again")))
	if m := notifs(p.a); len(m["sn-c"]) != 1 || string(m["sn-c"][0]) != "again" {
		t.Fatalf("notifications %q", m)
	}
	if n := p.a.GetNotifs(map[string][][]byte{}); n != 0 {
		t.Fatalf("drained inbox gave %d", n)
	}
}

// TestConcurrentAgents runs a producer and several consumers on their own
// goroutines, as the reactor will, for the race detector.
func TestConcurrentAgents(t *testing.T) {
	p := newSide(t, "cc-p")
	rng := rand.New(rand.NewPCG(15, 16))
	fill(rng, p.buf)
	const consumers, rounds = 3, 50
	var wg sync.WaitGroup
	total := make(chan int, 1)
	stop := make(chan struct{})
	go func() { // producer: drains notifications
		n := 0
		m := map[string][][]byte{}
		for {
			n += p.a.GetNotifs(m)
			if n == consumers*rounds {
				break
			}
			select {
			case <-stop:
				total <- n
				return
			default:
			}
		}
		for name, msgs := range m {
			for _, b := range msgs {
				if string(b) != name {
					n = -1
				}
			}
		}
		total <- n
	}()
	for i := range consumers {
		c := newSide(t, "cc-c"+string(rune('0'+i)))
		rd := link(t, c, p)
		wg.Go(func() {
			for r := range rounds {
				b := r % numBlocks
				x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{b}, rd, []int{b}, []byte(c.a.Name()))
				if err != nil {
					t.Error(err)
					return
				}
				if err := c.a.PostXfer(x); err != nil {
					t.Error(err)
					return
				}
				if err := waitDoneNoFatal(c.a, x); err != nil {
					t.Error(err)
					return
				}
				if !bytes.Equal(block(c.buf, b), block(p.buf, b)) {
					t.Errorf("%s: block %d differs", c.a.Name(), b)
				}
				if err := c.a.ReleaseXfer(x); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	select {
	case n := <-total:
		if n != consumers*rounds {
			t.Fatalf("producer got %d notifications, want %d", n, consumers*rounds)
		}
	case <-time.After(5 * time.Second):
		close(stop)
		t.Fatalf("producer got %d notifications, want %d", <-total, consumers*rounds)
	}
}

func waitDoneNoFatal(a *Agent, id nixl.XferID) error {
	for {
		if _, err := a.Progress(); err != nil {
			return err
		}
		if done, err := a.XferStatus(id); done || err != nil {
			return err
		}
	}
}

// TestRemoteRegionGone: the peer releases memory it advertised; a transfer
// into the released range fails instead of touching unmapped memory.
func TestRemoteRegionGone(t *testing.T) {
	p := newAgent(t, "gone-p")
	c := newSide(t, "gone-c")
	mem, buf, err := p.AllocMem(numBlocks*blockSize, nixl.DRAM, 0)
	must(t, err)
	md, err := p.LocalMetadata()
	must(t, err)
	_, err = c.a.LoadRemoteMetadata(md)
	must(t, err)
	rd, err := c.a.PrepDlist("gone-p", descriptors.BuildBlockDescs(nixl.Addr(buf), numBlocks, blockSize, 0), nixl.DRAM)
	must(t, err)
	x, err := c.a.MakeXfer(nixl.Write, c.dlocal, []int{0}, rd, []int{0}, []byte("n"))
	must(t, err)
	must(t, c.a.PostXfer(x))
	must(t, p.DeregisterMem(mem))
	mustIs(t, waitDone(t, c.a, x), nixl.ErrBackend)
	if n := len(notifs(p)); n != 0 {
		t.Fatalf("%d notifications for a failed write", n)
	}
}

// TestCloseInFlight: closing an initiator with posted requests cancels
// them; closing the target fails the initiator's requests.
func TestCloseInFlight(t *testing.T) {
	p := newSide(t, "ci-p")
	c, err := New("ci-c")
	must(t, err)
	_, buf, err := c.AllocMem(blockSize, nixl.DRAM, 0)
	must(t, err)
	local, err := c.PrepDlist("", descriptors.List{{Addr: nixl.Addr(buf), Len: blockSize}}, nixl.DRAM)
	must(t, err)
	md, err := p.a.LocalMetadata()
	must(t, err)
	_, err = c.LoadRemoteMetadata(md)
	must(t, err)
	rd, err := c.PrepDlist("ci-p", p.descs, nixl.DRAM)
	must(t, err)
	x, err := c.MakeXfer(nixl.Read, local, []int{0}, rd, []int{0}, []byte("n"))
	must(t, err)
	must(t, c.PostXfer(x))
	must(t, c.Close())
	if n := len(notifs(p.a)); n != 0 {
		t.Fatalf("closed initiator's request notified %d times", n)
	}

	// The other way round: the target closes under a posted READ.
	c2 := newSide(t, "ci-c")
	rd2 := link(t, c2, p)
	y, err := c2.a.MakeXfer(nixl.Read, c2.dlocal, []int{0}, rd2, []int{0}, nil)
	must(t, err)
	must(t, c2.a.PostXfer(y))
	must(t, p.a.Close())
	mustIs(t, waitDone(t, c2.a, y), nixl.ErrRemoteDisconnect)
}
