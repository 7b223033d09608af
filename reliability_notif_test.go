package ecxfer

import (
	"bytes"
	"fmt"
	"log/slog"
	"math/rand"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/reactor"
)

// TestReleasedReadsDoNotNotify: READs released at random moments, many of
// them while the engine works on them. The producer is told about exactly
// the READs the consumer saw DONE: it receives as many notifications as the
// consumer's Stats count sent, one per READ counted done, and every READ
// ends counted once (done, canceled or failed).
func TestReleasedReadsDoNotNotify(t *testing.T) {
	leakcheck.Check(t)
	for _, tc := range []struct {
		name, backend string
		opt           func(*Config)
	}{
		{"loopback", "loopback", func(*Config) {}},
		{"ucx", "ucx", func(*Config) {}},
		// The direct path: small READs copied inside PostRead, the others
		// by the copy workers.
		{"ucx-direct", "ucx", func(c *Config) { c.Direct = DirectOn }},
		{"ucx-direct-workers", "ucx", func(c *Config) { c.Direct = DirectOn; c.InlineBytes = -1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const bs, nb, reads, depth = 4096, 256, 4000, 32
			e := env{t: t, backend: tc.backend}
			pname := uniqueName("prod")
			prod := e.transport(pname, bs, nb, tc.opt)
			cons := e.transport(uniqueName("cons"), bs, nb, tc.opt)
			_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			rng := rand.New(rand.NewSource(7))
			waited := map[string]bool{}
			var inflight []Handle
			for i := 0; i < reads; i++ {
				n := 1 + rng.Intn(8)
				local, remote := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
				msg := fmt.Sprintf("read-%d", i)
				h, err := cons.PostRead(local, pname, remote, []byte(msg))
				require.NoError(t, err)
				if rng.Intn(10) < 3 {
					// Release at a random moment: before the reactor sees
					// the READ, while the engine works on it, or after.
					for k := rng.Intn(4); k > 0; k-- {
						runtime.Gosched()
					}
					require.NoError(t, cons.ReleaseXferHandle(h))
					continue
				}
				waited[msg] = true
				inflight = append(inflight, h)
				if len(inflight) == depth {
					for _, h := range inflight {
						st, err := wait(t, cons, h)
						require.NoError(t, err)
						require.Equal(t, StateDone, st)
						require.NoError(t, cons.ReleaseXferHandle(h))
					}
					inflight = inflight[:0]
				}
			}
			for _, h := range inflight {
				_, err := wait(t, cons, h)
				require.NoError(t, err)
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			// The reactor counts a READ (and sends its notification) just
			// after publishing it, so the counters can lag the handles.
			require.Eventually(t, func() bool {
				s := cons.Stats()
				return s.InFlight == 0 && s.LiveHandles == 0 &&
					s.ReadsPosted == s.ReadsDone+s.ReadsCanceled+s.ReadsFailed && s.ReadsDone == s.NotifsSent
			}, 10*time.Second, time.Millisecond, "%+v", cons.Stats())
			s := cons.Stats()
			require.Equal(t, s.ReadsPosted, s.ReadsDone+s.ReadsCanceled+s.ReadsFailed, "every posted READ ends counted once: %+v", s)
			require.Zero(t, s.ReadsFailed)
			require.Equal(t, s.ReadsDone, s.NotifsSent, "one notification per READ counted done")

			// Everything the consumer sent arrives; then nothing more does.
			got := map[string]int{}
			total := uint64(0)
			deadline := time.Now().Add(10 * time.Second)
			for total < s.NotifsSent && time.Now().Before(deadline) {
				for sender, msgs := range prod.NewNotifs() {
					require.Equal(t, cons.cfg.AgentName, sender)
					for _, m := range msgs {
						got[string(m)]++
						total++
					}
				}
				time.Sleep(time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond)
			for _, msgs := range prod.NewNotifs() {
				total += uint64(len(msgs))
			}
			t.Logf("%d READs: %d posted, %d done, %d canceled; %d notifications received",
				reads, s.ReadsPosted, s.ReadsDone, s.ReadsCanceled, total)
			require.Equal(t, s.NotifsSent, total, "notifications received at the producer")
			for m := range waited {
				require.Equal(t, 1, got[m], "READ %s was DONE: its notification arrives once", m)
			}
		})
	}
}

// TestOversizedNotifsDropped: a consumer configured with a 1 MiB limit
// sends notifications of 65,537 B, 512 KiB and 1 MiB to a producer at the
// 64 KiB default: the producer drops them, counts them and logs the event
// once for that sender; a 64 KiB one still arrives.
func TestOversizedNotifsDropped(t *testing.T) {
	leakcheck.Check(t)
	for _, backend := range []string{"loopback", "ucx"} {
		t.Run(backend, func(t *testing.T) {
			var logBuf syncBuffer
			e := env{t: t, backend: backend}
			pname := uniqueName("prod")
			prod := e.transport(pname, 4096, 8, func(c *Config) {
				c.Logger = slog.New(slog.NewJSONHandler(&logBuf, nil))
			})
			cons := e.transport(uniqueName("cons"), 4096, 8, func(c *Config) { c.Reactor.MaxNotif = 1 << 20 })
			_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			for _, n := range []int{65537, 512 << 10, 1 << 20, 64 << 10} {
				h, err := cons.PostRead([]int{0}, pname, []int{1}, bytes.Repeat([]byte{'x'}, n))
				require.NoError(t, err)
				st, err := wait(t, cons, h)
				require.NoError(t, err)
				require.Equal(t, StateDone, st)
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			// The reactor sends a READ's notification after it has
			// published the READ DONE, so the count can lag Wait.
			require.Eventually(t, func() bool { return cons.Stats().NotifsSent == 4 }, 10*time.Second, time.Millisecond,
				"notifications sent: %d", cons.Stats().NotifsSent)
			got := notifsUntil(prod, 1, 10*time.Second)
			require.Eventually(t, func() bool { return prod.Stats().NotifsOversized == 3 }, 10*time.Second, time.Millisecond)
			time.Sleep(100 * time.Millisecond)
			for _, m := range prod.NewNotifs() {
				got[cons.cfg.AgentName] = append(got[cons.cfg.AgentName], m...)
			}
			require.Len(t, got[cons.cfg.AgentName], 1)
			require.Len(t, got[cons.cfg.AgentName][0], 64<<10)
			s := prod.Stats()
			require.Equal(t, uint64(1), s.NotifsReceived)
			require.Equal(t, uint64(3), s.NotifsOversized)
			require.Equal(t, 1, strings.Count(logBuf.String(), reactor.EventNotifOversized), logBuf.String())
		})
	}
}

// syncBuffer is a bytes.Buffer safe for the reactor thread to write while
// the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestTimedOutReadsDoNotNotify: READs (with notifications) to a producer
// frozen by SIGSTOP end in ErrTimeout; after the producer resumes it is
// told nothing about them, while a READ posted after that notifies it as
// usual. The consumer counts them failed, not done.
func TestTimedOutReadsDoNotNotify(t *testing.T) {
	leakcheck.Check(t)
	prod := uniqueName("prod")
	pp := startTestProducer(t, nil, prod, relBS, relNB, 51, "mmap")
	cons := ucxEnv(t).transport(uniqueName("cons"), relBS, relNB, sharedQueue)
	_, err := cons.AddRemotePeer(pp.hello.Metadata, pp.hello.MemDesc)
	require.NoError(t, err)
	readVerify(t, cons, prod, 16, 51, rand.New(rand.NewSource(1)))

	pp.signal(syscall.SIGSTOP)
	pp.waitStopped()
	hs := postStalled(t, cons, prod, 4) // each carries the notification "stalled"
	// A short timeout only now, for the stalled READs (counted from their
	// post): on a loaded machine the READs above, and the posting and
	// checks of postStalled, can take longer than it.
	cons.r.SetTimeout(300 * time.Millisecond)
	for _, h := range hs {
		st, err := wait(t, cons, h)
		require.Equal(t, StateErr, st)
		require.ErrorIs(t, err, ErrTimeout)
		require.NoError(t, cons.ReleaseXferHandle(h))
	}
	cons.r.SetTimeout(DefaultXferTimeout)
	pp.signal(syscall.SIGCONT)
	// The gets the frozen producer owed may still be answered now; give it
	// time to send whatever it would.
	time.Sleep(500 * time.Millisecond)
	h, err := cons.PostRead([]int{0}, prod, []int{0}, []byte("after"))
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
	require.Eventually(t, func() bool {
		s, err := pp.request(ctrl.Message{Kind: "stats"}, "stats")
		return err == nil && s.Ints["notifs"] >= 1
	}, 10*time.Second, 10*time.Millisecond)
	time.Sleep(200 * time.Millisecond)
	s, err := pp.request(ctrl.Message{Kind: "stats"}, "stats")
	require.NoError(t, err)
	var msgs []string
	for _, n := range pp.notifs {
		msgs = append(msgs, fmt.Sprint(n.Strs))
	}
	require.Equal(t, int64(1), s.Ints["notifs"], "notifications at the producer: %v", msgs)
	require.Eventually(t, func() bool { return cons.Stats().NotifsSent == 1 }, 10*time.Second, time.Millisecond)
	cs := cons.Stats()
	require.GreaterOrEqual(t, cs.ReadsFailed, uint64(len(hs)))
}
