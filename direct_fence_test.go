package ecxfer

import (
	"math/rand"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// An engine-path READ released while its gets are outstanding (its
// producer, a real process, stopped) may still have their replies land in
// its local blocks when the producer resumes. A direct-path READ of
// another producer into those blocks is held until they have landed, on
// the copy workers and inline alike, so its bytes are the ones that stay;
// direct READs into other blocks are not held. Before, the direct READ
// copied at once, and the old producer's late reply then overwrote it.
// A held READ can be released, times out, ends with its peer's removal
// or replacement and at Deregister, and copies nothing then; the counts
// add up.
func TestDirectReadHeldByEngineFence(t *testing.T) {
	for _, tc := range tlsCases {
		t.Run(tc.name, func(t *testing.T) {
			env := withTLS(t, tc.tls)
			leakcheck.Check(t)
			old := uniqueName("old")
			penv := append(env, "ECX_DIRECT=0")
			if tc.tls == "tcp" {
				// Peers that are both tcp alone gather their READs, whose
				// late answers are dropped: no fence. Gets (NoGather at
				// the producer) leave one.
				penv = append(penv, "ECX_NOGATHER=1")
			}
			po := startTestProducer(t, nil, old, relBS, relNB, 11, "mmap", penv...)
			e := ucxEnv(t)
			pn := e.transport(uniqueName("new"), relBS, relNB, direct)
			pattern.FillRegion(pn.Region(), 12, relBS)
			cons := e.transport(uniqueName("cons"), relBS, relNB, direct, sharedQueue)
			_, err := cons.AddRemotePeer(po.hello.Metadata, po.hello.MemDesc)
			require.NoError(t, err)
			nw, err := cons.AddRemotePeer(pn.AgentMetadata(), pn.MemDescriptor())
			require.NoError(t, err)
			require.Equal(t, "engine", cons.PeerPath(old))
			require.Contains(t, cons.PeerPath(nw), "direct")
			rng := rand.New(rand.NewSource(3))
			readVerify(t, cons, old, 64, 11, rng)
			readVerify(t, cons, nw, 64, 12, rng)

			// orphan leaves the local blocks 0-79 fenced: a READ of the
			// stopped old producer into them, released with its gets
			// outstanding.
			orphan := func() {
				t.Helper()
				po.signal(syscall.SIGSTOP)
				po.waitStopped()
				h, err := cons.PostRead(seq(0, 80), old, seq(500, 80), nil)
				require.NoError(t, err)
				require.Eventually(t, func() bool { return cons.Stats().InFlight == 1 }, 10*time.Second, time.Millisecond)
				time.Sleep(20 * time.Millisecond) // its gets leave; nobody answers
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			post := func(local []int, remote int) Handle {
				t.Helper()
				h, err := cons.PostRead(local, nw, seq(remote, len(local)), []byte("n"))
				require.NoError(t, err)
				return h
			}
			held := func(hs ...Handle) {
				t.Helper()
				time.Sleep(100 * time.Millisecond)
				for _, h := range hs {
					st, err := cons.CheckXferState(h)
					require.NoError(t, err)
					require.Equal(t, StateProc, st, "a direct READ into blocks an engine READ's late data may still write was not held")
				}
			}
			verify := func(local []int, remote int) {
				t.Helper()
				for k, l := range local {
					ok, off := pattern.Check(block(cons, relBS, l), 12, remote+k)
					require.True(t, ok, "local block %d is not block %d of the direct producer (differs at %d)", l, remote+k, off)
				}
			}
			done := func(h Handle) {
				t.Helper()
				st, err := wait(t, cons, h)
				require.NoError(t, err)
				require.Equal(t, StateDone, st)
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			ends := func(h Handle, want error) {
				t.Helper()
				st, err := wait(t, cons, h)
				require.Equal(t, StateErr, st)
				require.ErrorIs(t, err, want)
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			// untouched: a held READ that did not complete copied nothing.
			const mark = 0x5a
			marked := func(local []int) {
				for _, l := range local {
					b := block(cons, relBS, l)
					for i := range b {
						b[i] = mark
					}
				}
			}
			untouched := func(local []int) {
				t.Helper()
				for _, l := range local {
					for i, c := range block(cons, relBS, l) {
						require.Equal(t, byte(mark), c, "block %d byte %d written by a READ that did not complete", l, i)
					}
				}
			}
			balanced := func() {
				t.Helper()
				require.Eventually(t, func() bool {
					st := cons.Stats()
					return st.InFlight == 0 && st.ReadsPosted == st.ReadsDone+st.ReadsFailed+st.ReadsCanceled
				}, 10*time.Second, time.Millisecond, "%+v", cons.Stats())
				require.Zero(t, cons.Stats().LiveHandles)
			}

			orphan()
			inline0 := cons.Stats().InlineReads
			inline := post([]int{0}, 100)   // 5,120 bytes: copied by the caller when not held
			pooled := post(seq(1, 31), 101) // 158,720 bytes: the copy workers
			free, freeInline := post(seq(200, 32), 200), post([]int{300}, 300)
			done(free)
			done(freeInline)
			verify(seq(200, 32), 200)
			verify([]int{300}, 300)
			require.Equal(t, inline0+1, cons.Stats().InlineReads, "only the READ into unfenced blocks was copied inline")
			held(inline, pooled)
			require.Equal(t, int64(2), cons.Stats().InFlight)
			// Held READs are looked at when something changes, not at
			// every loop turn (the loop turns at least every 1 ms while
			// any is held).
			looks, stop := testhook.Count(&testhook.HeldLook)
			turns := cons.Stats().LoopTurns
			time.Sleep(50 * time.Millisecond)
			require.Greater(t, cons.Stats().LoopTurns, turns+20)
			require.Zero(t, looks.Load(), "the held READs were looked at with nothing changed")
			stop()
			marked(seq(32, 30))
			released := post(seq(32, 30), 132) // on the copy workers when not held
			held(released)
			require.NoError(t, cons.ReleaseXferHandle(released))
			require.Eventually(t, func() bool { return cons.Stats().InFlight == 2 }, 10*time.Second, time.Millisecond)

			// The old producer resumes: its late replies land, then the
			// held READs copy over them.
			po.signal(syscall.SIGCONT)
			done(inline)
			done(pooled)
			readVerify(t, cons, old, 64, 11, rng) // the old producer has answered everything before
			time.Sleep(50 * time.Millisecond)
			verify([]int{0}, 100)
			verify(seq(1, 31), 101)
			balanced()

			// A held READ times out, ends with its peer's removal or
			// replacement, and ends at Deregister, copying nothing.
			orphan()
			marked(seq(0, 80))
			cons.r.SetTimeout(300 * time.Millisecond)
			ends(post(seq(40, 30), 140), ErrTimeout)
			cons.r.SetTimeout(DefaultXferTimeout)
			h := post(seq(0, 4), 100)
			held(h)
			require.NoError(t, cons.RemoveRemotePeer(nw))
			ends(h, ErrCanceled)
			_, err = cons.AddRemotePeer(pn.AgentMetadata(), pn.MemDescriptor())
			require.NoError(t, err)
			h = post(seq(4, 30), 104)
			held(h)
			// The direct producer restarts (a new transport under its
			// name): the held READ of the old one ends as replaced.
			require.NoError(t, pn.Deregister())
			pn = e.transport(nw, relBS, relNB, direct)
			pattern.FillRegion(pn.Region(), 12, relBS)
			_, err = cons.AddRemotePeer(pn.AgentMetadata(), pn.MemDescriptor())
			require.NoError(t, err)
			ends(h, ErrRemoteDisconnect)
			untouched(seq(0, 80))
			balanced()
			h = post(seq(0, 4), 100)
			held(h)
			if tc.tls != "" {
				// Over tcp the old producer, resumed after the consumer
				// has gone, would find its gets' endpoint closed, which
				// UCX 1.13 treats as fatal: it resumes first here.
				po.signal(syscall.SIGCONT)
				done(h)
				verify(seq(0, 4), 100)
				balanced()
				return
			}
			require.NoError(t, cons.Deregister())
			st, err := cons.CheckXferState(h)
			require.Equal(t, StateErr, st)
			require.ErrorIs(t, err, ErrClosed)
			require.Zero(t, cons.Stats().InFlight)
			s := cons.Stats()
			require.Equal(t, s.ReadsPosted, s.ReadsDone+s.ReadsFailed+s.ReadsCanceled)
			po.signal(syscall.SIGCONT)
		})
	}
}

// seq returns n consecutive block indices from first.
func seq(first, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = first + i
	}
	return s
}
