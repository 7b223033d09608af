package loopback

import (
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
)

// readable polls fd without waiting.
func readable(t testing.TB, fd int) bool {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if err == unix.EINTR {
			continue
		}
		must(t, err)
		return n == 1 && fds[0].Revents&unix.POLLIN != 0
	}
}

func mustArm(t testing.TB, a *Agent, want bool) {
	t.Helper()
	ok, err := a.Arm()
	must(t, err)
	if ok != want {
		t.Fatalf("Arm() = %v, want %v", ok, want)
	}
}

func TestArmStates(t *testing.T) {
	p := newSide(t, "arm-p")
	c := newSide(t, "arm-c")
	rd := link(t, c, p)
	link(t, p, c)
	pfd, cfd := p.a.EventFD(), c.a.EventFD()
	if pfd < 0 || cfd < 0 || pfd == cfd {
		t.Fatalf("event fds %d, %d", pfd, cfd)
	}

	mustArm(t, p.a, true)
	if readable(t, pfd) {
		t.Fatal("armed idle fd is readable")
	}

	// A notification: fd readable, Arm refuses until the inbox is drained.
	must(t, c.a.SendNotif("arm-p", []byte("wake")))
	if !readable(t, pfd) {
		t.Fatal("fd not readable after a notification")
	}
	mustArm(t, p.a, false)
	mustArm(t, p.a, false)
	if !readable(t, pfd) {
		t.Fatal("Arm with work pending cleared the fd")
	}
	if len(notifs(p.a)) != 1 {
		t.Fatal("notification lost")
	}
	mustArm(t, p.a, true)
	if readable(t, pfd) {
		t.Fatal("fd readable after Arm")
	}

	// A posted request, then its unreported completion, keep the initiator
	// awake.
	mustArm(t, c.a, true)
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, rd, []int{0}, []byte("n"))
	must(t, err)
	if readable(t, cfd) {
		t.Fatal("fd readable before PostXfer")
	}
	must(t, c.a.PostXfer(x))
	if !readable(t, cfd) {
		t.Fatal("fd not readable with a posted request")
	}
	mustArm(t, c.a, false)
	_, err = c.a.Progress()
	must(t, err)
	mustArm(t, c.a, false) // the completion is not polled yet
	if got := drainCompletions(c.a); len(got) != 1 {
		t.Fatalf("completions %+v", got)
	}
	mustArm(t, c.a, true)
	if readable(t, cfd) {
		t.Fatal("fd readable after Arm")
	}
	// The producer was notified by the READ.
	if !readable(t, pfd) {
		t.Fatal("producer fd not readable after the READ's notification")
	}
	mustArm(t, p.a, false)
	notifs(p.a)
	mustArm(t, p.a, true)

	// A cancelled request leaves no work behind after one Progress.
	must(t, c.a.PostXfer(x))
	must(t, c.a.ReleaseXfer(x))
	_, err = c.a.Progress()
	must(t, err)
	mustArm(t, c.a, true)
}

// TestWakeUp has the producer sleep in epoll_wait (or poll) on its EventFD
// while a consumer goroutine sends notifications at random moments: every
// sleep must end, and every message must arrive.
func TestWakeUp(t *testing.T) {
	for _, how := range []string{"epoll", "poll"} {
		t.Run(how, func(t *testing.T) {
			p := newSide(t, "wake-p")
			c := newSide(t, "wake-c")
			link(t, c, p)
			const total = 300

			go func() { // the consumer's driver
				for i := range total {
					if i%3 == 0 {
						time.Sleep(time.Duration(i%7) * 20 * time.Microsecond)
					} else {
						runtime.Gosched()
					}
					if err := c.a.SendNotif("wake-p", []byte{byte(i)}); err != nil {
						t.Error(err)
						return
					}
				}
			}()

			var wait func() (int, error)
			switch how {
			case "epoll":
				ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
				must(t, err)
				defer unix.Close(ep)
				must(t, unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, p.a.EventFD(), &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p.a.EventFD())}))
				events := make([]unix.EpollEvent, 1)
				wait = func() (int, error) { return unix.EpollWait(ep, events, 5000) }
			case "poll":
				fds := []unix.PollFd{{Fd: int32(p.a.EventFD()), Events: unix.POLLIN}}
				wait = func() (int, error) { return unix.Poll(fds, 5000) }
			}

			got, sleeps := 0, 0
			m := map[string][][]byte{}
			for got < total {
				got += p.a.GetNotifs(m)
				if got == total {
					break
				}
				ok, err := p.a.Arm()
				must(t, err)
				if !ok {
					continue
				}
				sleeps++
				n, err := wait()
				for err == unix.EINTR {
					n, err = wait()
				}
				must(t, err)
				if n == 0 {
					t.Fatalf("missed wake-up: slept 5 s with %d of %d messages received", got, total)
				}
			}
			msgs := m["wake-c"]
			if len(msgs) != total {
				t.Fatalf("%d messages", len(msgs))
			}
			for i, b := range msgs {
				if len(b) != 1 || b[0] != byte(i) {
					t.Fatalf("message %d is %v", i, b)
				}
			}
			t.Logf("%d messages, %d sleeps", total, sleeps)
		})
	}
}

func TestKillWakesSleeper(t *testing.T) {
	p := newSide(t, "kw-p")
	mustArm(t, p.a, true)
	fds := []unix.PollFd{{Fd: int32(p.a.EventFD()), Events: unix.POLLIN}}
	go func() {
		time.Sleep(10 * time.Millisecond)
		p.a.Kill()
	}()
	n, err := unix.Poll(fds, 5000)
	for err == unix.EINTR {
		n, err = unix.Poll(fds, 5000)
	}
	must(t, err)
	if n != 1 {
		t.Fatal("Kill did not wake the sleeping owner")
	}
	_, err = p.a.Arm()
	mustIs(t, err, ErrClosed)
}
