package ecxfer

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/pattern"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// Two-process tests of the direct path: real producer processes (this test
// binary re-executed), real mappings, bytes verified.

// directRegions are the producer regions of the two-process tests: the
// engine's (a UCX System V segment), a /dev/shm file, anonymous memory.
var directRegions = []struct{ region, path string }{
	{"alloc", "direct-sysv"},
	{"shm", "direct-file"},
	{"mmap", "direct-proc"},
}

// startDirectProducer starts a producer process with the direct path on.
func startDirectProducer(t *testing.T, name, region string, bs, nb int, seed uint64) (*roleProc, string) {
	t.Helper()
	path := filepath.Join("/dev/shm", fmt.Sprintf("ecxfer_test_%d_%s.mmap", os.Getpid(), name))
	t.Cleanup(func() { _ = os.Remove(path) })
	p := startTestProducer(t, nil, name, bs, nb, seed, region, "ECX_DIRECT=1", "ECX_SHM_PATH="+path)
	return p, path
}

// directProcPair starts a direct producer process of region's kind and
// a consumer that knows it, and checks the consumer reads it by path.
func directProcPair(t *testing.T, prefix, region, path string, bs, nb int, seed uint64) (p *roleProc, cons *Transport, pname string) {
	t.Helper()
	pname = uniqueName(prefix + "-prod")
	p, _ = startDirectProducer(t, pname, region, bs, nb, seed)
	cons = ucxEnv(t).transport(uniqueName(prefix+"-cons"), bs, nb, direct)
	got, err := cons.AddRemotePeer(p.hello.Metadata, p.hello.MemDesc)
	require.NoError(t, err)
	require.Equal(t, pname, got)
	require.Equal(t, path, cons.PeerPath(pname))
	return p, cons, pname
}

func directReadVerify(cons *Transport, peer string, local, remote []int, seed uint64, bs int, notif []byte) error {
	h, err := cons.PostRead(local, peer, remote, notif)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	err = cons.Wait(ctx, h)
	cancel()
	if rerr := cons.ReleaseXferHandle(h); err == nil {
		err = rerr
	}
	if err != nil {
		return err
	}
	for i := range local {
		if ok, off := pattern.Check(block(cons, bs, local[i]), seed, remote[i]); !ok {
			return fmt.Errorf("local block %d (remote %d) differs at byte %d", local[i], remote[i], off)
		}
	}
	return nil
}

func TestDirectTwoProcess(t *testing.T) {
	for _, c := range directRegions {
		t.Run(c.region, func(t *testing.T) {
			leakcheck.Check(t)
			const bs, nb, seed = 5120, 1024, 21
			p, cons, pname := directProcPair(t, "dx", c.region, c.path, bs, nb, seed)
			rng := rand.New(rand.NewSource(seed))
			for _, n := range []int{1, 12, 880} {
				remote, local := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
				msg := fmt.Appendf(nil, "session:%d", n)
				require.NoError(t, directReadVerify(cons, pname, local, remote, seed, bs, msg))
				m, err := p.conn.Expect("notif")
				require.NoError(t, err)
				require.Equal(t, cons.cfg.AgentName, m.Name)
				require.Equal(t, msg, m.Data)
			}
			require.Equal(t, uint64(3), cons.Stats().DirectReads)
		})
	}
}

// TestDirectProducerKilled: a producer is SIGKILLed while large copies out
// of its region run, three times (restarted under the same name each
// time). Copies that started may finish; READs after the death is detected
// end in ErrRemoteDisconnect; a second, healthy producer's READs keep
// completing throughout; the restarted producer is read from again.
func TestDirectProducerKilled(t *testing.T) {
	for _, c := range directRegions {
		t.Run(c.region, func(t *testing.T) {
			leakcheck.Check(t)
			base := shmview.Mapped()
			const bs, nb = 32768, 1024
			victim, healthy := uniqueName("dvictim"), uniqueName("dhealthy")
			ph, _ := startDirectProducer(t, healthy, c.region, bs, nb, 2)
			cons := ucxEnv(t).transport(uniqueName("dk-cons"), bs, 4096, direct)
			_, err := cons.AddRemotePeer(ph.hello.Metadata, ph.hello.MemDesc)
			require.NoError(t, err)

			var stop atomic.Bool
			var healthyReads atomic.Int64
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			// Two readers of the healthy producer own local blocks
			// 3072..4095.
			for w := range 2 {
				wg.Go(func() {
					rng := rand.New(rand.NewSource(int64(w)))
					for !stop.Load() {
						remote := rng.Perm(nb)[:256]
						local := make([]int, 256)
						for i := range local {
							local[i] = 3072 + w*512 + i
						}
						if err := directReadVerify(cons, healthy, local, remote, 2, bs, nil); err != nil {
							errs <- fmt.Errorf("healthy producer: %w", err)
							return
						}
						healthyReads.Add(1)
					}
				})
			}
			// Readers write into cons's region: if the test fails early,
			// stop them before cons's own cleanup unmaps it.
			t.Cleanup(func() { stop.Store(true); wg.Wait() })
			for round := range 3 {
				seed := uint64(10 + round)
				pv, _ := startDirectProducer(t, victim, c.region, bs, nb, seed)
				name, err := cons.AddRemotePeer(pv.hello.Metadata, pv.hello.MemDesc)
				require.NoError(t, err)
				require.Equal(t, victim, name)
				require.Equal(t, c.path, cons.PeerPath(victim))
				require.NoError(t, directReadVerify(cons, victim, []int{0}, []int{5}, seed, bs, nil))

				// Four readers of the victim (local blocks 0..3071, 768
				// each), 880-block READs, until it dies.
				var vwg sync.WaitGroup
				var victimDone, victimErr atomic.Int64
				var vstop atomic.Bool
				for w := range 4 {
					vwg.Go(func() {
						rng := rand.New(rand.NewSource(int64(round*10 + w)))
						for !vstop.Load() {
							remote := rng.Perm(nb)[:700]
							local := make([]int, 700)
							for i := range local {
								local[i] = w*768 + i
							}
							err := directReadVerify(cons, victim, local, remote, seed, bs, nil)
							switch {
							case err == nil:
								victimDone.Add(1)
							case errors.Is(err, ErrRemoteDisconnect):
								victimErr.Add(1)
								return
							default:
								errs <- fmt.Errorf("victim: %w", err)
								return
							}
						}
					})
				}
				t.Cleanup(func() { vstop.Store(true); vwg.Wait() })
				time.Sleep(20 * time.Millisecond)
				before := healthyReads.Load()
				pv.kill()
				// Every reader of the victim sees ErrRemoteDisconnect
				// within the wait below (liveness is checked every
				// millisecond while the reactor runs).
				waited := make(chan struct{})
				go func() { vwg.Wait(); close(waited) }()
				select {
				case <-waited:
				case <-time.After(20 * time.Second):
					t.Fatalf("READs of a killed producer still succeed 20s after SIGKILL: %d done, %d refused, stats %+v",
						victimDone.Load(), victimErr.Load(), cons.Stats())
				}
				require.Equal(t, int64(4), victimErr.Load())
				h, err := cons.PostRead([]int{0}, victim, []int{1}, nil)
				require.NoError(t, err)
				st, err := wait(t, cons, h)
				require.Equal(t, StateErr, st)
				require.ErrorIs(t, err, ErrRemoteDisconnect)
				require.NoError(t, cons.ReleaseXferHandle(h))
				require.Eventually(t, func() bool { return healthyReads.Load() >= before+3 }, 20*time.Second, time.Millisecond,
					"the healthy producer stopped serving after the other one died")
				t.Logf("%s round %d: %d victim READs done before the kill was seen; healthy READs go on (%d so far)",
					c.region, round, victimDone.Load(), healthyReads.Load())
			}
			stop.Store(true)
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.NoError(t, cons.RemoveRemotePeer(victim))
			require.NoError(t, cons.RemoveRemotePeer(healthy))
			require.Eventually(t, func() bool { return shmview.Mapped() == base }, 10*time.Second, time.Millisecond,
				"mappings left after the peers were removed")
		})
	}
}

// TestDirectTruncatedTwoProcess: the producer process shrinks its region
// file under a consumer that maps it. The READ that faults ends in
// ErrRemoteDisconnect, the consumer lives on, the peer is gone. Once the
// file is whole again, the peer is read again after RemoveRemotePeer and
// AddRemotePeer; the same metadata added again without the removal
// leaves it dead, as AddRemotePeer's doc says.
func TestDirectTruncatedTwoProcess(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb, seed = 32768, 256, 31
	pname := uniqueName("dt-prod")
	p, path := startDirectProducer(t, pname, "shm", bs, nb, seed)
	healthy := uniqueName("dt-ok")
	ph, _ := startDirectProducer(t, healthy, "alloc", bs, nb, 32)
	cons := ucxEnv(t).transport(uniqueName("dt-cons"), bs, nb, direct)
	for _, q := range []*roleProc{p, ph} {
		_, err := cons.AddRemotePeer(q.hello.Metadata, q.hello.MemDesc)
		require.NoError(t, err)
	}
	all := make([]int, nb)
	for i := range all {
		all[i] = i
	}
	require.NoError(t, directReadVerify(cons, pname, all, all, seed, bs, nil))
	whole, err := os.ReadFile(path)
	require.NoError(t, err)
	// The file is the producer's; shrinking it from here is the same
	// truncation as the producer's own, seen through the consumer's map.
	require.NoError(t, os.Truncate(path, 4096))
	err = directReadVerify(cons, pname, all, all, seed, bs, nil)
	require.ErrorIs(t, err, ErrRemoteDisconnect)
	err = directReadVerify(cons, pname, []int{0}, []int{0}, seed, bs, nil)
	require.ErrorIs(t, err, ErrRemoteDisconnect)
	require.NoError(t, directReadVerify(cons, healthy, all[:100], all[100:200], 32, bs, nil))

	// The file whole again (the producer process never stopped).
	require.NoError(t, os.WriteFile(path, whole, 0o600))
	name, err := cons.AddRemotePeer(p.hello.Metadata, p.hello.MemDesc)
	require.NoError(t, err)
	require.Equal(t, pname, name)
	err = directReadVerify(cons, pname, []int{0}, []int{0}, seed, bs, nil)
	require.ErrorIs(t, err, ErrRemoteDisconnect, "the same metadata again leaves a dead peer dead")
	require.NoError(t, cons.RemoveRemotePeer(pname))
	_, err = cons.AddRemotePeer(p.hello.Metadata, p.hello.MemDesc)
	require.NoError(t, err)
	require.Equal(t, "direct-file", cons.PeerPath(pname))
	require.NoError(t, directReadVerify(cons, pname, all, all, seed, bs, nil), "removed and added again")
}

// TestEngineRefusesSharedQueuePeer: with the direct path off, a same-host
// producer whose region is its own memory (a /dev/shm file, anonymous
// memory) would be read with gets it answers through this process's
// shared-memory receive queue, which a producer killed mid-answer leaves
// stuck for every peer. AddRemotePeer refuses it with ErrConfig; an
// engine-allocated region is read as before, and with the direct path on
// the same producers are read directly.
func TestEngineRefusesSharedQueuePeer(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb = 4096, 64
	all := make([]int, nb)
	for i := range all {
		all[i] = i
	}
	kinds := []string{"shm", "mmap", "alloc"}
	prods := map[string]*roleProc{}
	names := map[string]string{}
	for i, k := range kinds {
		names[k] = uniqueName("sq-" + k)
		prods[k], _ = startDirectProducer(t, names[k], k, bs, nb, uint64(60+i))
	}
	off := ucxEnv(t).transport(uniqueName("sq-off"), bs, nb)
	for _, k := range []string{"shm", "mmap"} {
		_, err := off.AddRemotePeer(prods[k].hello.Metadata, prods[k].hello.MemDesc)
		require.ErrorIs(t, err, ErrConfig, k)
		require.ErrorContains(t, err, "shared-memory receive queue", k)
		_, err = off.PostRead([]int{0}, names[k], []int{0}, nil)
		require.ErrorIs(t, err, ErrUnknownPeer, "a refused peer is not loaded")
	}
	require.Zero(t, off.Stats().Peers)
	_, err := off.AddRemotePeer(prods["alloc"].hello.Metadata, prods["alloc"].hello.MemDesc)
	require.NoError(t, err)
	require.Equal(t, "engine", off.PeerPath(names["alloc"]))
	require.NoError(t, directReadVerify(off, names["alloc"], all, all, 62, bs, nil))

	on := ucxEnv(t).transport(uniqueName("sq-on"), bs, nb, direct)
	for i, k := range kinds {
		_, err := on.AddRemotePeer(prods[k].hello.Metadata, prods[k].hello.MemDesc)
		require.NoError(t, err, k)
		require.NotEqual(t, "engine", on.PeerPath(names[k]), k)
		require.NoError(t, directReadVerify(on, names[k], all, all, uint64(60+i), bs, nil), k)
	}
}

// TestEngineTruncatedOverTCP: over tcp alone there is no shared receive
// queue, so the engine reads a same-host producer's own memory. One that
// dies of SIGBUS while answering (its region file was truncated) fails the
// READ, and a second producer's READs keep completing, round after round.
func TestEngineTruncatedOverTCP(t *testing.T) {
	leakcheck.Check(t)
	tcp := withTLS(t, "tcp")
	const bs, nb = 32768, 128
	all := make([]int, nb)
	for i := range all {
		all[i] = i
	}
	healthy := uniqueName("tt-ok")
	ph := startTestProducer(t, nil, healthy, bs, nb, 72, "mmap", tcp...)
	cons := ucxEnv(t).transport(uniqueName("tt-cons"), bs, nb)
	_, err := cons.AddRemotePeer(ph.hello.Metadata, ph.hello.MemDesc)
	require.NoError(t, err)
	for round := range 3 {
		victim := uniqueName("tt-victim")
		path := filepath.Join("/dev/shm", fmt.Sprintf("ecxfer_test_%d_%s.mmap", os.Getpid(), victim))
		t.Cleanup(func() { _ = os.Remove(path) })
		pv := startTestProducer(t, nil, victim, bs, nb, 71, "shm", append(tcp, "ECX_SHM_PATH="+path)...)
		_, err := cons.AddRemotePeer(pv.hello.Metadata, pv.hello.MemDesc)
		require.NoError(t, err)
		require.Equal(t, "engine", cons.PeerPath(victim))
		require.NoError(t, directReadVerify(cons, victim, all, all, 71, bs, nil))
		require.NoError(t, os.Truncate(path, 4096))
		err = directReadVerify(cons, victim, all, all, 71, bs, nil)
		require.ErrorIs(t, err, ErrRemoteDisconnect, "round %d", round)
		require.NoError(t, directReadVerify(cons, healthy, all[:64], all[64:], 72, bs, nil), "round %d: the healthy producer", round)
		require.NoError(t, cons.RemoveRemotePeer(victim))
	}
}

// countPidfdPolls counts the direct path's polls of producers' pidfds
// after copies until the test ends.
func countPidfdPolls(t *testing.T) *atomic.Int64 {
	n, stop := testhook.Count(&testhook.PidfdPoll)
	t.Cleanup(stop)
	return n
}

// TestDirectLifewordTwoProcess: a producer process advertises its lifeword
// (the token of its notification socket names it); the consumer's direct
// READs, inline and on the copy workers, check that the producer is alive
// with a load of it instead of a poll of its pidfd, bytes verified; a
// READ posted once the producer has been killed fails. Every region kind.
func TestDirectLifewordTwoProcess(t *testing.T) {
	for _, c := range directRegions {
		t.Run(c.region, func(t *testing.T) {
			leakcheck.Check(t)
			const bs, nb, seed = 5120, 1024, 33
			p, cons, pname := directProcPair(t, "dl", c.region, c.path, bs, nb, seed)
			require.Equal(t, "lifeword", cons.r.PeerLiveness(pname))
			polls := countPidfdPolls(t)
			rng := rand.New(rand.NewSource(seed))
			for i := range 200 {
				require.NoError(t, directReadVerify(cons, pname, []int{i}, []int{rng.Intn(nb)}, seed, bs, nil))
			}
			// 880-block READs for 50 ms: the copy workers' READs keep the
			// reactor turning, and its watch of the peer runs every 1 ms.
			pool := 0
			for start := time.Now(); pool < 3 || time.Since(start) < 50*time.Millisecond; pool++ {
				require.NoError(t, directReadVerify(cons, pname, rng.Perm(nb)[:880], rng.Perm(nb)[:880], seed, bs, nil))
			}
			require.Zero(t, polls.Load(), "READs of a producer with a lifeword, or the reactor's watch of it, polled its pidfd")
			require.Equal(t, uint64(200+pool), cons.Stats().DirectReads)
			p.kill()
			h, err := cons.PostRead([]int{0}, pname, []int{1}, nil)
			require.NoError(t, err)
			st, err := wait(t, cons, h)
			require.Equal(t, StateErr, st)
			require.ErrorIs(t, err, ErrRemoteDisconnect)
			require.NoError(t, cons.ReleaseXferHandle(h))
		})
	}
}

// TestDirectLifewordForgedFallsBack: metadata whose token names a
// descriptor of the producer that is not its lifeword (its stdin, a pipe)
// gets the pidfd check: READs work and poll, and a killed producer is
// still caught.
func TestDirectLifewordForgedFallsBack(t *testing.T) {
	leakcheck.Check(t)
	const bs, nb, seed = 5120, 1024, 34
	pname := uniqueName("dlf-prod")
	p, _ := startDirectProducer(t, pname, "shm", bs, nb, seed)
	md, adv, err := shmview.Split(p.hello.Metadata)
	require.NoError(t, err)
	require.NotNil(t, adv)
	_, ok := adv.LifeFD()
	require.True(t, ok, "the producer advertises a lifeword")
	adv.Notify = shmview.LifeToken(adv.Notify, 0)
	cons := ucxEnv(t).transport(uniqueName("dlf-cons"), bs, nb, direct)
	_, err = cons.AddRemotePeer(shmview.Wrap(md, adv), p.hello.MemDesc)
	require.NoError(t, err)
	require.Equal(t, "direct-file", cons.PeerPath(pname))
	require.Equal(t, "pidfd", cons.r.PeerLiveness(pname))
	polls := countPidfdPolls(t)
	for i := range 20 {
		require.NoError(t, directReadVerify(cons, pname, []int{i}, []int{i + 7}, seed, bs, nil))
	}
	// 20 after the copies, and the reactor's liveness watch polls it too.
	require.GreaterOrEqual(t, polls.Load(), int64(20))
	p.kill()
	require.Eventually(t, func() bool {
		h, err := cons.PostRead([]int{0}, pname, []int{1}, nil)
		if err != nil {
			return false
		}
		defer func() { _ = cons.ReleaseXferHandle(h) }()
		st, err := wait(t, cons, h)
		return st == StateErr && errors.Is(err, ErrRemoteDisconnect)
	}, 10*time.Second, time.Millisecond)
}

// TestDirectProducerDeregisteredTwoProcess: a producer process closes its
// transport and lives on; the consumer's READs of it end in
// ErrRemoteDisconnect from then on, on the caller's goroutine and on the
// copy workers, for every kind of region. Before, they ended DONE with
// whatever the region held (its lifeword went quiet at close and the
// producer's pidfd said it was alive).
func TestDirectProducerDeregisteredTwoProcess(t *testing.T) {
	for _, c := range directRegions {
		t.Run(c.region, func(t *testing.T) {
			leakcheck.Check(t)
			const bs, nb, seed = 5120, 1024, 23
			p, cons, pname := directProcPair(t, "dd", c.region, c.path, bs, nb, seed)
			rng := rand.New(rand.NewSource(seed))
			for _, n := range []int{1, 880} { // in PostRead, on the copy workers
				remote, local := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
				require.NoError(t, directReadVerify(cons, pname, local, remote, seed, bs, nil))
			}
			_, err := p.request(ctrl.Message{Kind: "deregister"}, "deregistered")
			require.NoError(t, err)
			for _, n := range []int{1, 880, 1} {
				remote, local := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
				err := directReadVerify(cons, pname, local, remote, seed, bs, nil)
				require.ErrorIs(t, err, ErrRemoteDisconnect, "a READ of %d blocks after the producer closed", n)
			}
			select {
			case <-p.exited:
				t.Fatal("the producer process exited; the test is about one that lives on")
			default:
			}
			require.Equal(t, int64(0), cons.Stats().InFlight)
		})
	}
}
