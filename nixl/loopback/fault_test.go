package loopback

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer/nixl"
)

func TestFailNext(t *testing.T) {
	tests := []struct {
		name   string
		n      int
		status nixl.Status
		want   nixl.Status // what the failing posts report
		fails  int
	}{
		{"two backend", 2, nixl.ErrBackend, nixl.ErrBackend, 2},
		{"one disconnect", 1, nixl.ErrRemoteDisconnect, nixl.ErrRemoteDisconnect, 1},
		{"canceled", 3, nixl.ErrCanceled, nixl.ErrCanceled, 3},
		{"success coerced", 1, nixl.Success, nixl.ErrBackend, 1},
		{"in-progress coerced", 1, nixl.InProgress, nixl.ErrBackend, 1},
		{"zero count", 0, nixl.ErrBackend, 0, 0},
		{"negative count", -4, nixl.ErrBackend, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(21, uint64(tc.n)))
			p := newSide(t, "fail-p")
			c := newSide(t, "fail-c")
			rd := link(t, c, p)
			fill(rng, p.buf)
			c.a.FailNext(tc.n, tc.status)
			for i := range tc.fails + 1 {
				before := bytes.Clone(c.buf)
				x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{i}, rd, []int{i}, []byte("n"))
				must(t, err)
				must(t, c.a.PostXfer(x))
				if done, err := c.a.XferStatus(x); done || err != nil {
					t.Fatalf("post %d: not asynchronous: %v, %v", i, done, err)
				}
				err = waitDone(t, c.a, x)
				m := notifs(p.a)
				if i < tc.fails {
					mustIs(t, err, tc.want)
					sameBytes(t, "consumer after injected failure", c.buf, before)
					if len(m) != 0 {
						t.Fatalf("failed post notified: %q", m)
					}
					continue
				}
				must(t, err)
				sameBytes(t, "block", block(c.buf, i), block(p.buf, i))
				if len(m["fail-c"]) != 1 {
					t.Fatalf("notifications %q", m)
				}
			}
		})
	}

	t.Run("cleared", func(t *testing.T) {
		p := newSide(t, "fail-p")
		c := newSide(t, "fail-c")
		rd := link(t, c, p)
		c.a.FailNext(5, nixl.ErrBackend)
		c.a.FailNext(0, nixl.ErrBackend)
		x, err := c.a.MakeXfer(nixl.Write, c.dlocal, []int{0}, rd, []int{0}, nil)
		must(t, err)
		must(t, c.a.PostXfer(x))
		must(t, waitDone(t, c.a, x))
	})
}

func TestSetDelay(t *testing.T) {
	const d = 30 * time.Millisecond
	for _, viaOption := range []bool{false, true} {
		name := "SetDelay"
		if viaOption {
			name = "WithDelay"
		}
		t.Run(name, func(t *testing.T) {
			p := newSide(t, "delay-p")
			var c *side
			if viaOption {
				c = newSide(t, "delay-c", WithDelay(d))
			} else {
				c = newSide(t, "delay-c")
				c.a.SetDelay(d)
			}
			rd := link(t, c, p)
			x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, []byte("late"))
			must(t, err)
			start := time.Now()
			must(t, c.a.PostXfer(x))
			for range 3 {
				did, err := c.a.Progress()
				must(t, err)
				if did {
					t.Fatal("Progress finished a request before its delay")
				}
			}
			if done, _ := c.a.XferStatus(x); done && time.Since(start) < d {
				t.Fatal("done before the delay")
			}
			if len(notifs(p.a)) != 0 && time.Since(start) < d {
				t.Fatal("notified before the delay")
			}
			must(t, waitDone(t, c.a, x))
			if el := time.Since(start); el < d {
				t.Fatalf("finished after %v, delay %v", el, d)
			}
			if len(notifs(p.a)["delay-c"]) != 1 {
				t.Fatal("no notification")
			}
			// Back to immediate completion.
			c.a.SetDelay(0)
			must(t, c.a.PostXfer(x))
			did, err := c.a.Progress()
			must(t, err)
			if !did {
				t.Fatal("request not done at the first Progress without delay")
			}
		})
	}
}

func TestDisconnect(t *testing.T) {
	for _, who := range []string{"initiator", "target"} {
		t.Run(who, func(t *testing.T) {
			p := newSide(t, "dc-p")
			c := newSide(t, "dc-c")
			rd := link(t, c, p)
			link(t, p, c)
			cut := func() { c.a.Disconnect("dc-p") }
			heal := func() { c.a.Reconnect("dc-p") }
			if who == "target" {
				cut = func() { p.a.Disconnect("dc-c") }
				heal = func() { p.a.Reconnect("dc-c") }
			}
			// An in-flight request, delayed so that it would not be due yet.
			c.a.SetDelay(time.Hour)
			x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, []byte("n"))
			must(t, err)
			must(t, c.a.PostXfer(x))
			cut()
			did, err := c.a.Progress()
			must(t, err)
			if !did {
				t.Fatal("Progress did not fail the request of a disconnected peer")
			}
			done, err := c.a.XferStatus(x)
			if !done {
				t.Fatal("still in flight")
			}
			mustIs(t, err, nixl.ErrRemoteDisconnect)
			c.a.SetDelay(0)
			must(t, c.a.PostXfer(x))
			mustIs(t, waitDone(t, c.a, x), nixl.ErrRemoteDisconnect)
			mustIs(t, c.a.SendNotif("dc-p", []byte("m")), nixl.ErrRemoteDisconnect)
			mustIs(t, p.a.SendNotif("dc-c", []byte("m")), nixl.ErrRemoteDisconnect)
			if len(notifs(p.a))+len(notifs(c.a)) != 0 {
				t.Fatal("notification crossed a cut link")
			}

			heal()
			must(t, c.a.PostXfer(x))
			must(t, waitDone(t, c.a, x))
			must(t, c.a.SendNotif("dc-p", []byte("m")))
			if m := notifs(p.a); len(m["dc-c"]) != 2 {
				t.Fatalf("notifications after reconnect %q", m)
			}
		})
	}
}

func TestKill(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 32))
	p := newSide(t, "kill-p")
	c := newSide(t, "kill-c")
	rd := link(t, c, p)
	fill(rng, p.buf)
	before := bytes.Clone(c.buf)
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, seq(0, numBlocks), rd, seq(0, numBlocks), []byte("n"))
	must(t, err)
	must(t, c.a.PostXfer(x))

	// Kill from another goroutine while the victim's own driver is busy.
	var wg sync.WaitGroup
	victimErr := make(chan error, 1)
	wg.Go(func() {
		for {
			if _, err := p.a.Progress(); err != nil {
				victimErr <- err
				return
			}
		}
	})
	wg.Go(func() { p.a.Kill(); p.a.Kill() })
	wg.Wait()
	mustIs(t, <-victimErr, ErrClosed)

	mustIs(t, waitDone(t, c.a, x), nixl.ErrRemoteDisconnect)
	sameBytes(t, "consumer", c.buf, before)
	mustIs(t, c.a.SendNotif("kill-p", []byte("m")), nixl.ErrRemoteDisconnect)
	_, err = p.a.LocalMetadata()
	mustIs(t, err, ErrClosed)
	for _, n := range LiveAgents() {
		if n == "kill-p" {
			t.Fatal("killed agent still registered")
		}
	}
	// The name is free at once; the killed agent's Close still releases
	// its resources (run by the cleanup) and leaves the new agent alone.
	q := newAgent(t, "kill-p")
	must(t, p.a.Close())
	if lookup("kill-p") != q {
		t.Fatal("Close of the killed agent unregistered its successor")
	}
	p.a.Kill() // after Close: no effect
}

// TestFaultsConcurrently flips every fault from other goroutines while a
// consumer transfers, for the race detector; every request must end either
// well or with one of the injected errors.
func TestFaultsConcurrently(t *testing.T) {
	p := newSide(t, "fc-p")
	c := newSide(t, "fc-c")
	rd := link(t, c, p)
	stop := make(chan struct{})
	var flips atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			flips.Add(1)
			select {
			case <-stop:
				return
			default:
			}
			switch i % 6 {
			case 0:
				c.a.FailNext(1, nixl.ErrBackend)
			case 1:
				c.a.SetDelay(time.Duration(i%3) * time.Microsecond)
			case 2:
				c.a.Disconnect("fc-p")
			case 3:
				c.a.Reconnect("fc-p")
			case 4:
				p.a.Disconnect("fc-c")
			case 5:
				p.a.Reconnect("fc-c")
			}
			time.Sleep(50 * time.Microsecond)
		}
	})
	okN, failN := 0, 0
	for i := 0; i < 300 || flips.Load() < 60 || okN == 0 || failN == 0; i++ {
		if i > 1e6 {
			t.Fatalf("faults never took effect: %d good, %d failed", okN, failN)
		}
		x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{i % numBlocks}, rd, []int{i % numBlocks}, []byte("n"))
		must(t, err)
		must(t, c.a.PostXfer(x))
		err = waitDone(t, c.a, x)
		switch {
		case err == nil:
			okN++
		case errors.Is(err, nixl.ErrBackend), errors.Is(err, nixl.ErrRemoteDisconnect):
			failN++
		default:
			t.Fatalf("unexpected error %v", err)
		}
		must(t, c.a.ReleaseXfer(x))
	}
	close(stop)
	wg.Wait()
	p.a.Reconnect("fc-c")
	got := 0
	for _, msgs := range notifs(p.a) {
		got += len(msgs)
	}
	if got != okN {
		t.Fatalf("%d notifications for %d good transfers (%d failed)", got, okN, failN)
	}
}
