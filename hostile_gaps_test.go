package ecxfer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/shmview"
)

// Hostile input the other tests do not give: Configs New must refuse
// before it starts an engine, every method racing Deregister, handles of
// another transport or forged from a real one, and several goroutines
// releasing one handle.

// New refuses the Config fields every caller sets (name, sizes, backend,
// region) with ErrConfig, before any engine starts, leaking nothing.
func TestHostileNewConfig(t *testing.T) {
	leakcheck.Check(t)
	agents := countAgents(t)
	short := anonRegion(t, 4096) // off the Go heap, but too short
	cases := map[string]func(*Config){
		"empty name":            func(c *Config) { c.AgentName = "" },
		"257-byte name":         func(c *Config) { c.AgentName = strings.Repeat("n", 257) },
		"name with a space":     func(c *Config) { c.AgentName = "a b" },
		"name with a NUL":       func(c *Config) { c.AgentName = "a\x00b" },
		"name with a newline":   func(c *Config) { c.AgentName = "a\nb" },
		"non-ASCII name":        func(c *Config) { c.AgentName = "caf\u00e9" },
		"zero block size":       func(c *Config) { c.BlockSize = 0 },
		"negative block size":   func(c *Config) { c.BlockSize = -4096 },
		"zero blocks":           func(c *Config) { c.NumBlocks = 0 },
		"negative blocks":       func(c *Config) { c.NumBlocks = -1 },
		"min int blocks":        func(c *Config) { c.NumBlocks = math.MinInt },
		"region beyond 1 TiB":   func(c *Config) { c.BlockSize, c.NumBlocks = 1<<30, 2048 },
		"product overflows int": func(c *Config) { c.BlockSize, c.NumBlocks = math.MaxInt, 2 },
		"short region":          func(c *Config) { c.Region, c.BlockSize, c.NumBlocks = short, 4096, 2 },
		"empty non-nil region":  func(c *Config) { c.Region = short[:0] },
		"unknown backend":       func(c *Config) { c.Backend = "carrier-pigeon" },
		"backend in capitals":   func(c *Config) { c.Backend = "UCX" },
	}
	for name, set := range cases {
		for _, backend := range []string{"ucx", "loopback"} {
			t.Run(name+"/"+backend, func(t *testing.T) {
				before := agents.Load()
				cfg := Config{AgentName: uniqueName("hc"), Backend: backend, BlockSize: 64, NumBlocks: 4}
				set(&cfg)
				tr, err := New(cfg)
				if tr != nil {
					_ = tr.Deregister()
				}
				require.Nil(t, tr)
				require.ErrorIs(t, err, ErrConfig)
				require.NotErrorIs(t, err, ErrEngine)
				if !strings.Contains(name, "backend") {
					require.Equal(t, before, agents.Load(), "an engine was started")
				}
			})
		}
	}
	for _, ok := range []string{"a", strings.Repeat("x", 256), "prefill-0:rank/1~!"} {
		require.NoError(t, ValidAgentName(ok), "%q", ok)
	}
	for _, bad := range []string{"", strings.Repeat("x", 257), " a", "a\tb", "\x7f", "\xff", "é"} {
		require.ErrorIs(t, ValidAgentName(bad), ErrConfig, "%q", bad)
	}
	// A megabyte of name is quoted in part, with its length: the message
	// (which the C ABI hands to Python whole) stays short.
	err := ValidAgentName(strings.Repeat("y", 1<<20))
	require.ErrorIs(t, err, ErrConfig)
	require.Less(t, len(err.Error()), 1024)
	require.Contains(t, err.Error(), "(1048576 bytes)")
}

// racingErr reports an error a call racing Deregister may not return.
func racingErr(what string, err error, allowed ...error) error {
	if err == nil {
		return nil
	}
	for _, a := range append(allowed, ErrClosed) {
		if errors.Is(err, a) {
			return nil
		}
	}
	return fmt.Errorf("%s: %w", what, err)
}

// Every method of a transport, called from several goroutines while
// Deregister runs: each call returns (no hang, no panic) with nil, ErrClosed
// or the error its own input explains; afterwards nothing is live or in
// flight, the methods documented to keep working do, and nothing leaked.
// READs are held in the engine 300 µs so that some are in flight at the end.
func TestEveryMethodRacingDeregister(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "loopback"}
	prod := e.transport(uniqueName("rdp"), 512, 16)
	for round := 0; round < 16; round++ {
		cons, err := New(Config{AgentName: uniqueName("rdc"), Backend: "loopback", BlockSize: 512, NumBlocks: 16})
		require.NoError(t, err)
		pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
		require.NoError(t, err)
		engine(t, cons).SetDelay(300 * time.Microsecond)

		var stop atomic.Bool
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		report := func(err error) {
			if err != nil {
				select {
				case errs <- err:
				default:
				}
			}
		}
		run := func(f func(i int)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; !stop.Load(); i++ {
					f(i)
				}
			}()
		}
		for w := 0; w < 3; w++ {
			run(func(i int) { // post, check, wait a little, release
				h, err := cons.PostRead([]int{i % 16}, pname, []int{(i + w) % 16}, []byte("n"))
				if err != nil {
					report(racingErr("PostRead", err, ErrBusy, ErrUnknownPeer))
					if errors.Is(err, ErrClosed) {
						stop.Store(true)
					}
					return
				}
				if h == 0 {
					report(errors.New("PostRead: handle 0 without an error"))
				}
				st, err := cons.CheckXferState(h)
				if (st == StateErr) != (err != nil) {
					report(fmt.Errorf("CheckXferState: %v with %v", st, err))
				}
				report(racingErr("CheckXferState", err, ErrCanceled))
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%3)*time.Millisecond)
				err = cons.Wait(ctx, h)
				cancel()
				report(racingErr("Wait", err, context.DeadlineExceeded, ErrCanceled))
				report(racingErr("ReleaseXferHandle", cons.ReleaseXferHandle(h)))
			})
		}
		run(func(i int) { // the peer comes and goes
			if i%4 == 3 {
				report(racingErr("RemoveRemotePeer", cons.RemoveRemotePeer(pname), ErrUnknownPeer))
			} else {
				_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
				report(racingErr("AddRemotePeer", err))
			}
			time.Sleep(3 * time.Millisecond)
		})
		run(func(i int) { // everything that reads
			if cons.NewNotifs() == nil {
				report(errors.New("NewNotifs: nil"))
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
			m, err := cons.WaitNotifs(ctx)
			cancel()
			if m == nil {
				report(errors.New("WaitNotifs: nil map"))
			}
			report(racingErr("WaitNotifs", err, context.DeadlineExceeded))
			_ = cons.Stats()
			_ = cons.PeerStats(nil)
			_ = cons.PeerPath(pname)
			_ = cons.PeerPath("")
			_, _ = cons.ReactorCPU()
			_ = cons.AgentMetadata()
			_ = cons.MemDescriptor()
			_ = cons.Region()
			_ = cons.AgentName()
		})

		time.Sleep(time.Duration(5+3*round) * time.Millisecond)
		deregistered := make(chan error, 1)
		go func() { deregistered <- cons.Deregister() }()
		select {
		case err := <-deregistered:
			require.NoError(t, err, "round %d", round)
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: Deregister did not return", round)
		}
		stop.Store(true)
		ended := make(chan struct{})
		go func() { wg.Wait(); close(ended) }()
		select {
		case <-ended:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: calls racing Deregister did not return", round)
		}
		close(errs)
		for err := range errs {
			require.NoError(t, err, "round %d", round)
		}
		st := cons.Stats()
		t.Logf("round %d: %d READs posted, %d done, %d failed, %d canceled", round, st.ReadsPosted, st.ReadsDone, st.ReadsFailed, st.ReadsCanceled)
		require.Zero(t, st.LiveHandles, "round %d: live handles after Deregister", round)
		require.Zero(t, st.InFlight, "round %d: READs in flight after Deregister", round)
		require.GreaterOrEqual(t, st.ReadsPosted, st.ReadsDone+st.ReadsFailed+st.ReadsCanceled, "round %d", round)
		require.Equal(t, "", cons.PeerPath(pname), "round %d: a peer after Deregister", round)
		_, err = cons.WaitNotifs(context.Background())
		for err == nil { // notifications from before Close come out first
			_, err = cons.WaitNotifs(context.Background())
		}
		require.ErrorIs(t, err, ErrClosed)
		_ = prod.NewNotifs()
	}
}

// Peers on the direct path added and removed while Deregister runs: every
// region mapping and pidfd a racing AddRemotePeer opened is closed again
// (the mappings are counted by shmview, descriptors by leakcheck).
func TestDirectPeerChurnRacingDeregister(t *testing.T) {
	leakcheck.Check(t)
	base := shmview.Mapped()
	e := env{t: t, backend: "ucx"}
	prods := make([]*Transport, 2)
	for i := range prods {
		prods[i] = e.transport(uniqueName("dcp"), 4096, 8, direct)
	}
	var adds, reads atomic.Int64
	for round := 0; round < 15; round++ {
		cons, err := New(Config{AgentName: uniqueName("dcc"), BlockSize: 4096, NumBlocks: 8, Direct: DirectOn})
		require.NoError(t, err)
		var stop atomic.Bool
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for _, p := range prods {
			md, desc := p.AgentMetadata(), p.MemDescriptor()
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					name, err := cons.AddRemotePeer(md, desc)
					if err != nil {
						if racingErr("AddRemotePeer", err) != nil {
							errs <- err
						}
						return
					}
					adds.Add(1)
					if path := cons.PeerPath(name); path != "" && !strings.HasPrefix(path, "direct-") {
						errs <- fmt.Errorf("peer %s on path %q", name, path)
						return
					}
					h, err := cons.PostRead([]int{1}, name, []int{2}, nil)
					if err == nil {
						reads.Add(1)
						_ = cons.Wait(context.Background(), h)
						_ = cons.ReleaseXferHandle(h)
					} else if err := racingErr("PostRead", err, ErrUnknownPeer); err != nil {
						errs <- err
						return
					}
					if err := racingErr("RemoveRemotePeer", cons.RemoveRemotePeer(name), ErrUnknownPeer); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(1+round) * time.Millisecond)
		require.NoError(t, cons.Deregister())
		stop.Store(true)
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err, "round %d", round)
		}
		require.Zero(t, cons.Stats().LiveHandles)
	}
	t.Logf("%d direct peers added, %d READs posted", adds.Load(), reads.Load())
	require.Eventually(t, func() bool { return shmview.Mapped() == base }, 10*time.Second, 10*time.Millisecond,
		"region views left mapped: %d, base %d", shmview.Mapped(), base)
}

// Handles that are not this transport's: another transport's, forged from
// a real one by flipping bits, and ones left from before Deregister. Each is
// ErrBadHandle (ErrClosed once closed) for every handle method, and touches
// nothing: the genuine READ is still there, still the caller's to release.
func TestForeignAndForgedHandles(t *testing.T) {
	prod, cons, pname := loopbackPair(t, 512, 8)
	other, err := New(Config{AgentName: uniqueName("other"), Backend: "loopback", BlockSize: 512, NumBlocks: 8})
	require.NoError(t, err)
	_, err = other.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)

	engine(t, cons).SetDelay(time.Hour) // the genuine READ stays PROC
	h, err := cons.PostRead([]int{0}, pname, []int{1}, nil)
	require.NoError(t, err)
	oh, err := other.PostRead([]int{0}, pname, []int{1}, nil)
	require.NoError(t, err)
	_, err = wait(t, other, oh)
	require.NoError(t, err)

	forged := []Handle{oh, h | 1<<63, h ^ 1<<62, h ^ 1<<40, h + 1, h - 1, h &^ 0xff, ^h}
	for _, f := range forged {
		if f == h {
			continue
		}
		st, err := cons.CheckXferState(f)
		require.Equal(t, StateErr, st, "handle %#x", uint64(f))
		require.ErrorIs(t, err, ErrBadHandle, "handle %#x", uint64(f))
		require.ErrorIs(t, cons.Wait(context.Background(), f), ErrBadHandle, "handle %#x", uint64(f))
		require.ErrorIs(t, cons.ReleaseXferHandle(f), ErrBadHandle, "handle %#x", uint64(f))
	}
	// cons's handle on the other transport, where a READ is live too.
	_, err = other.CheckXferState(h)
	require.ErrorIs(t, err, ErrBadHandle)
	require.ErrorIs(t, other.ReleaseXferHandle(h), ErrBadHandle)
	st, err := other.CheckXferState(oh)
	require.NoError(t, err)
	require.Equal(t, StateDone, st, "the other transport's READ was touched")

	st, err = cons.CheckXferState(h)
	require.NoError(t, err)
	require.Equal(t, StateProc, st, "the genuine READ was touched by a forged handle")
	require.Equal(t, int64(1), cons.Stats().LiveHandles)
	require.NoError(t, cons.ReleaseXferHandle(h))
	require.Eventually(t, func() bool { return cons.Stats().LiveHandles == 0 }, 10*time.Second, time.Millisecond)

	// Handles from before Deregister, and posts after it: ErrClosed, except
	// index lists longer than NumBlocks, which are ErrIndexRange as
	// documented.
	require.NoError(t, other.Deregister())
	st, err = other.CheckXferState(oh)
	require.Equal(t, StateErr, st)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, other.ReleaseXferHandle(oh), ErrClosed)
	require.ErrorIs(t, other.Wait(context.Background(), oh), ErrClosed)
	_, err = other.PostRead(make([]int, 9), pname, make([]int, 9), nil)
	require.ErrorIs(t, err, ErrIndexRange)
	_, err = other.PostRead([]int{0}, pname, []int{0}, nil)
	require.ErrorIs(t, err, ErrClosed)
	require.Equal(t, "", other.PeerPath(pname))
	require.Zero(t, other.Stats().LiveHandles)
}

// Several goroutines release one handle at once, in flight and done:
// exactly one succeeds, the rest get ErrBadHandle, and the handle table
// ends empty.
func TestConcurrentReleaseOfOneHandle(t *testing.T) {
	_, cons, pname := loopbackPair(t, 512, 8)
	for _, inFlight := range []bool{true, false} {
		if inFlight {
			engine(t, cons).SetDelay(time.Hour)
		} else {
			engine(t, cons).SetDelay(0)
		}
		for i := 0; i < 200; i++ {
			h, err := cons.PostRead([]int{i % 8}, pname, []int{(i + 1) % 8}, nil)
			require.NoError(t, err)
			if !inFlight {
				_, err = wait(t, cons, h)
				require.NoError(t, err)
			}
			const n = 6
			var ok, bad atomic.Int32
			var other atomic.Value
			start := make(chan struct{})
			var wg sync.WaitGroup
			for g := 0; g < n; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					switch err := cons.ReleaseXferHandle(h); {
					case err == nil:
						ok.Add(1)
					case errors.Is(err, ErrBadHandle):
						bad.Add(1)
					default:
						other.Store(err)
					}
				}()
			}
			close(start)
			wg.Wait()
			require.Nil(t, other.Load(), "in flight %v, try %d", inFlight, i)
			require.Equal(t, int32(1), ok.Load(), "in flight %v, try %d: releases that succeeded", inFlight, i)
			require.Equal(t, int32(n-1), bad.Load())
		}
		require.Eventually(t, func() bool {
			s := cons.Stats()
			return s.LiveHandles == 0 && s.InFlight == 0
		}, 10*time.Second, time.Millisecond)
	}
}

// Calls blocked in Wait and WaitNotifs when Deregister comes return
// ErrClosed at once, not when their context ends; Deregister does not wait
// for them.
func TestBlockedCallsEndAtDeregister(t *testing.T) {
	leakcheck.Check(t)
	e := env{t: t, backend: "loopback"}
	prod := e.transport(uniqueName("bp"), 512, 8)
	cons, err := New(Config{AgentName: uniqueName("bc"), Backend: "loopback", BlockSize: 512, NumBlocks: 8})
	require.NoError(t, err)
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	engine(t, cons).SetDelay(time.Hour)
	var hs []Handle
	for i := 0; i < 4; i++ {
		h, err := cons.PostRead([]int{i}, pname, []int{i}, []byte("never"))
		require.NoError(t, err)
		hs = append(hs, h)
	}
	got := make(chan error, len(hs)+1)
	for _, h := range hs {
		go func() { got <- cons.Wait(context.Background(), h) }()
	}
	go func() {
		_, err := cons.WaitNotifs(context.Background())
		got <- err
	}()
	time.Sleep(30 * time.Millisecond) // past WaitSpin: blocked
	start := time.Now()
	require.NoError(t, cons.Deregister())
	for range len(hs) + 1 {
		select {
		case err := <-got:
			require.ErrorIs(t, err, ErrClosed)
		case <-time.After(10 * time.Second):
			t.Fatal("a blocked call did not return after Deregister")
		}
	}
	require.Less(t, time.Since(start), 5*time.Second)
	for _, h := range hs {
		st, err := cons.CheckXferState(h)
		require.Equal(t, StateErr, st)
		require.ErrorIs(t, err, ErrClosed)
	}
	s := cons.Stats()
	require.Zero(t, s.LiveHandles)
	require.Zero(t, s.InFlight)
	require.Empty(t, prod.NewNotifs(), "a READ ended by Deregister notified its producer")
}

// Wait given a context that ends (or has ended) while the READ is still in
// flight returns ctx's error then, whatever Reactor.WaitSpin says: the doc
// promises "ctx's error when ctx ends first". WaitSpin is a valid option
// with no upper bound (TestWaitSpinThenBlock uses a minute); here it is 20 s
// and the READ is held in the engine for an hour.
func TestWaitHonorsContextDuringSpin(t *testing.T) {
	_, cons, pname := loopbackPair(t, 512, 8, func(c *Config) { c.Reactor.WaitSpin = 20 * time.Second })
	engine(t, cons).SetDelay(time.Hour)
	h, err := cons.PostRead([]int{0}, pname, []int{0}, nil)
	require.NoError(t, err)
	defer func() {
		require.NoError(t, cons.ReleaseXferHandle(h))
		require.Eventually(t, func() bool { return cons.Stats().LiveHandles == 0 }, 10*time.Second, time.Millisecond)
	}()

	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	errCanceled := cons.Wait(canceled, h)
	tookCanceled := time.Since(start)

	ctx, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	start = time.Now()
	errTimeout := cons.Wait(ctx, h)
	tookTimeout := time.Since(start)

	t.Logf("canceled ctx: %v after %v; 20ms ctx: %v after %v", errCanceled, tookCanceled, errTimeout, tookTimeout)
	require.ErrorIs(t, errCanceled, context.Canceled)
	require.ErrorIs(t, errTimeout, context.DeadlineExceeded)
	require.Less(t, tookCanceled, 5*time.Second, "Wait with a canceled ctx returned after %v", tookCanceled)
	require.Less(t, tookTimeout, 5*time.Second, "Wait with a 20ms ctx returned after %v", tookTimeout)
}

// A peer name of megabytes (no agent name has more than 256 bytes) given
// to RemoveRemotePeer or PostRead is an unknown peer whose error quotes
// 256 bytes of it and says how long it was: the whole name used to be
// quoted, tens of megabytes per error.
func TestHugePeerNameErrorsAreShort(t *testing.T) {
	leakcheck.Check(t)
	tr, err := New(Config{AgentName: uniqueName("hn"), Backend: "loopback", BlockSize: 64, NumBlocks: 4})
	require.NoError(t, err)
	defer tr.Deregister()
	name := strings.Repeat("\x01", 10<<20)
	for what, err := range map[string]error{
		"RemoveRemotePeer": tr.RemoveRemotePeer(name),
		"PostRead":         func() error { _, err := tr.PostRead([]int{0}, name, []int{0}, nil); return err }(),
	} {
		require.ErrorIs(t, err, ErrUnknownPeer, what)
		require.Contains(t, err.Error(), fmt.Sprintf("(%d bytes)", len(name)), what)
		require.Less(t, len(err.Error()), 2048, what)
	}
}

// A nil ctx given to Wait or WaitNotifs is context.Background(): Wait
// spins, sleeps (the READ is held in the engine for 50 ms) and returns
// when the READ is DONE, and WaitNotifs blocks until the notification
// comes. Both used to dereference the nil ctx.
func TestNilContextIsBackground(t *testing.T) {
	prod, cons, pname := loopbackPair(t, 512, 8)
	engine(t, cons).SetDelay(50 * time.Millisecond)
	h, err := cons.PostRead([]int{0}, pname, []int{1}, []byte("nil ctx"))
	require.NoError(t, err)
	blocks := cons.Stats().WaitBlocks
	//lint:ignore SA1012 a nil ctx is what this tests
	require.NoError(t, cons.Wait(nil, h))
	require.Greater(t, cons.Stats().WaitBlocks, blocks, "Wait returned before it slept: the nil ctx was never looked at")
	require.NoError(t, cons.ReleaseXferHandle(h))
	//lint:ignore SA1012 a nil ctx is what this tests
	m, err := prod.WaitNotifs(nil)
	require.NoError(t, err)
	require.Equal(t, map[string][][]byte{cons.AgentName(): {[]byte("nil ctx")}}, m)
}
