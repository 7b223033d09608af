package main

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// abiTransport makes a loopback transport of 16 blocks of 64 bytes through
// the registry, with extra JSON options ("" or `,"key":value...`),
// deregistered when the test ends; it returns its id, metadata and memory
// descriptor.
func abiTransport(t *testing.T, name, extra string) (id uint64, md, desc []byte) {
	t.Helper()
	id, err := newTransport(fmt.Appendf(nil, `{"agent_name":%q,"backend":"loopback","block_size":64,"num_blocks":16%s}`, name, extra), nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, deregister(id)) })
	md, err = blob(id, blobAgentMetadata)
	require.NoError(t, err)
	desc, err = blob(id, blobMemDescriptor)
	require.NoError(t, err)
	return id, md, desc
}

// abiPair is a producer and a consumer (abiTransport) and the consumer's
// id for the producer.
func abiPair(t *testing.T, prefix, extra string) (cons, pid uint64) {
	t.Helper()
	_, md, desc := abiTransport(t, prefix+"prod", extra)
	cons, _, _ = abiTransport(t, prefix+"cons", extra)
	_, pid, err := addPeer(cons, md, desc)
	require.NoError(t, err)
	return cons, pid
}

// Every entry point behind the ABI called while deregister runs, as a C or
// Python caller with several threads does: calls blocked without a time
// limit (ecx_wait and ecx_notifs with a negative timeout) return as soon
// as the transport is gone, every call returns a code a caller can act on
// (closed, unknown transport, or what its own input explains), and nothing
// is left: no transport in the registry, no goroutine, no descriptor.
func TestRegistryCallsRacingDeregister(t *testing.T) {
	leakcheck.Check(t)
	opts := func(name string) []byte {
		return fmt.Appendf(nil, `{"agent_name":%q,"backend":"loopback","block_size":64,"num_blocks":16}`, name)
	}
	_, md, desc := abiTransport(t, "rdprod", "")
	// A second producer, the one the racing calls read, remove and add:
	// the first one's stuck READ is never canceled by a removal.
	_, md2, desc2 := abiTransport(t, "rdprod2", "")
	closedOr := func(what string, err error, allowed ...int) error {
		code := codeOf(err)
		for _, a := range append(allowed, codeOK, codeClosed, codeUnknownTransport) {
			if code == a {
				return nil
			}
		}
		return fmt.Errorf("%s: code %d (%v)", what, code, err)
	}
	for round := 0; round < 10; round++ {
		c, err := newTransport(opts(fmt.Sprintf("rdcons-%d", round)), nil)
		require.NoError(t, err)
		_, pid, err := addPeer(c, md, desc)
		require.NoError(t, err)
		_, pid2, err := addPeer(c, md2, desc2)
		require.NoError(t, err)
		loopback.Find(fmt.Sprintf("rdcons-%d", round)).SetDelay(time.Hour)
		stuck, err := postRead(c, []int{0}, pid, []int{1}, []byte("n"))
		require.NoError(t, err)

		var stop atomic.Bool
		var wg sync.WaitGroup
		errs := make(chan error, 32)
		report := func(err error) {
			if err != nil {
				select {
				case errs <- err:
				default:
				}
			}
		}
		// Blocked with no time limit: only the teardown ends them.
		blocked := make(chan error, 2)
		go func() {
			st, err := wait(c, uint64(stuck), -1)
			if err == nil {
				err = fmt.Errorf("wait returned state %d", st)
			}
			blocked <- err
		}()
		go func() {
			b, err := notifs(c, -1)
			if err == nil {
				err = fmt.Errorf("notifs returned %d bytes", len(b))
			}
			blocked <- err
		}()
		run := func(f func(i int)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; !stop.Load(); i++ {
					f(i)
				}
			}()
		}
		run(func(i int) {
			h, err := postRead(c, []int{i % 16}, pid2, []int{(i + 1) % 16}, nil)
			report(closedOr("postRead", err, codeUnknownPeer, codeBusy))
			if err == nil {
				_, err = checkState(c, uint64(h))
				report(closedOr("checkState", err, codeCanceled))
				_, err = wait(c, uint64(h), time.Millisecond)
				report(closedOr("wait", err, codeCanceled))
				report(closedOr("release", release(c, uint64(h))))
			}
		})
		run(func(i int) {
			if i%2 == 0 {
				report(closedOr("removePeer", removePeer(c, "rdprod2"), codeUnknownPeer))
			} else {
				_, _, err := addPeer(c, md2, desc2)
				report(closedOr("addPeer", err))
			}
			time.Sleep(500 * time.Microsecond)
		})
		run(func(i int) {
			_, err := blob(c, blobAgentMetadata)
			report(closedOr("blob", err))
			_, err = stats(c)
			report(closedOr("stats", err))
			_, err = notifs(c, 0)
			report(closedOr("notifs", err))
		})
		time.Sleep(time.Duration(5+round) * time.Millisecond)
		done := make(chan error, 2)
		go func() { done <- deregister(c) }()
		go func() { done <- deregister(c) }() // a second caller at once
		for range 2 {
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(20 * time.Second):
				t.Fatalf("round %d: deregister did not return", round)
			}
		}
		for range 2 {
			select {
			case err := <-blocked:
				// Closed if it was blocked when deregister came; a call
				// its goroutine had not made by then finds the id gone.
				require.Contains(t, []int{codeClosed, codeUnknownTransport}, codeOf(err), "round %d: %v", round, err)
				require.Error(t, err)
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: a call blocked without a time limit did not return after deregister", round)
			}
		}
		stop.Store(true)
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err, "round %d", round)
		}
		_, err = checkState(c, uint64(stuck))
		require.Equal(t, codeUnknownTransport, codeOf(err))
		require.Equal(t, 2, liveTransports(), "round %d: only the producers are left", round)
	}
}

// ecx_wait's timeout bounds the call whatever wait_spin_us says (an option
// ecx_new and ECXFER_OPTIONS take, up to any valid duration): a Python
// wait(h, 0.02) on a READ still in flight returns PROC after about 20 ms.
func TestWaitTimeoutWithLongWaitSpin(t *testing.T) {
	leakcheck.Check(t)
	c, pid := abiPair(t, "ws", `,"wait_spin_us":20000000`)
	loopback.Find("wscons").SetDelay(time.Hour)
	h, err := postRead(c, []int{0}, pid, []int{1}, nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, release(c, uint64(h))) }()
	for _, timeout := range []time.Duration{0, 20 * time.Millisecond} {
		start := time.Now()
		st, err := wait(c, uint64(h), timeout)
		took := time.Since(start)
		require.NoError(t, err)
		require.Equal(t, stateProc, st)
		require.Less(t, took, timeout+5*time.Second, "ecx_wait with a timeout of %v returned after %v", timeout, took)
	}
}

// A count above the transport's blocks is refused before the caller's
// array is read: here the arrays claim 2^30 indices over one page of memory
// from outside the Go heap, as a C caller's would be, which a copy would
// fault on (or allocate 8 GiB for).
func TestPostCountRefusedBeforeCopy(t *testing.T) {
	leakcheck.Check(t)
	c, pid := abiPair(t, "pc", "")
	page, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(page)) }()
	one := unsafe.Slice((*int)(unsafe.Pointer(&page[0])), 1)
	huge := unsafe.Slice(&one[0], 1<<30)
	for _, lr := range [][2][]int{{huge, one}, {one, huge}, {huge, huge}} {
		_, err := postReadCopy(c, lr[0], pid, lr[1], nil)
		require.Equal(t, codeIndexRange, codeOf(err), "%v", err)
	}
	// Counts at the limit still post (and are checked index by index).
	full := make([]int, 16)
	for i := range full {
		full[i] = i
	}
	h, err := postReadCopy(c, full, pid, full, nil)
	require.NoError(t, err)
	_, err = wait(c, uint64(h), 10*time.Second)
	require.NoError(t, err)
	require.NoError(t, release(c, uint64(h)))
}

// TestLastErrTableFull: once the table of last messages is full (threads
// that failed and never asked), a new thread's message evicts one entry,
// not all of them: the messages other live threads have not read yet stay
// (the whole table used to be dropped), and the caller gets its own.
func TestLastErrTableFull(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	me := unix.Gettid()
	lastErr.mu.Lock()
	saved := lastErr.m
	lastErr.m = map[int]string{}
	for i := 0; len(lastErr.m) < maxLastErr; i++ {
		if tid := -1 - i; tid != me { // no real thread has a negative id
			lastErr.m[tid] = "unread"
		}
	}
	lastErr.mu.Unlock()
	defer func() {
		lastErr.mu.Lock()
		lastErr.m = saved
		lastErr.mu.Unlock()
	}()
	fail(fmt.Errorf("%w: mine", errBadArg))
	lastErr.mu.Lock()
	n := len(lastErr.m)
	lastErr.mu.Unlock()
	require.Equal(t, maxLastErr, n, "one entry evicted, the rest kept")
	require.Contains(t, takeLastErr(), "mine")
	// A thread with an entry already replaces it, evicting nothing.
	fail(fmt.Errorf("%w: first", errBadArg))
	fail(fmt.Errorf("%w: second", errBadArg))
	lastErr.mu.Lock()
	n = len(lastErr.m)
	lastErr.mu.Unlock()
	require.Equal(t, maxLastErr, n)
	require.Contains(t, takeLastErr(), "second")
}
