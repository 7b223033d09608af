package main

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/reactor"
	"github.com/stretchr/testify/require"
)

func TestParseOptions(t *testing.T) {
	cfg, err := parseOptions([]byte(`{"agent_name":"a","backend":"loopback","block_size":64,"num_blocks":8,
		"xfer_timeout_s":1.5,"pin_cpu":0,"numa_node":0,"idle":"park","spin_for_us":10,"yield_for_us":20,
		"park_timeout_us":30,"wait_spin_us":40,"batch_size":16,"submit_ring":128,"handles":256,
		"wait_when_busy":true,"max_notif":99,"direct":"on","inline_bytes":-1,"copy_workers":3,
		"reactor_only":true,"no_gather":true,"large_tcp_segments":true}`))
	require.NoError(t, err)
	r := cfg.Reactor
	require.Equal(t, "a", cfg.AgentName)
	require.Equal(t, "loopback", cfg.Backend)
	require.Equal(t, 64, cfg.BlockSize)
	require.Equal(t, 8, cfg.NumBlocks)
	require.Equal(t, 1500*time.Millisecond, cfg.XferTimeout)
	require.True(t, r.PinCPU)
	require.Equal(t, 0, r.CPU)
	require.True(t, r.BindNUMA)
	require.Equal(t, reactor.IdlePark, r.Idle)
	require.Equal(t, 10*time.Microsecond, r.SpinFor)
	require.Equal(t, 20*time.Microsecond, r.YieldFor)
	require.Equal(t, 30*time.Microsecond, r.ParkTimeout)
	require.Equal(t, 40*time.Microsecond, r.WaitSpin)
	require.Equal(t, 16, r.BatchSize)
	require.Equal(t, 128, r.SubmitRing)
	require.Equal(t, 256, r.Handles)
	require.True(t, r.WaitWhenBusy)
	require.True(t, r.ReactorOnly)
	require.Equal(t, 99, r.MaxNotif)
	require.Equal(t, ecxfer.DirectOn, cfg.Direct)
	require.Equal(t, -1, cfg.InlineBytes)
	require.Equal(t, 3, cfg.CopyWorkers)
	require.True(t, cfg.NoGather)
	require.True(t, cfg.LargeTCPSegments)

	cfg, err = parseOptions([]byte(`{"agent_name":"a","block_size":1,"num_blocks":1,"xfer_timeout_s":-1}`))
	require.NoError(t, err)
	require.Negative(t, cfg.XferTimeout)
	require.False(t, cfg.Reactor.PinCPU)

	// Any negative value, however large (it was refused as out of range).
	cfg, err = parseOptions([]byte(`{"xfer_timeout_s":-1e300}`))
	require.NoError(t, err)
	require.Negative(t, cfg.XferTimeout)

	cfg, err = parseOptions([]byte(`{"xfer_timeout_s":1e-15}`))
	require.NoError(t, err)
	require.Positive(t, cfg.XferTimeout, "a positive timeout must not turn into the default")
}

func TestParseOptionsHostile(t *testing.T) {
	for _, in := range []string{
		``, `null x`, `[]`, `"a"`, `{`, `{"agent_name":1}`, `{"bogus":1}`, `{"Agent_Name":"a","x":1}`,
		`{"idle":"sometimes"}`, `{"spin_for_us":-1}`, `{"wait_spin_us":1e300}`, `{"xfer_timeout_s":1e300}`,
		`{"batch_size":-1}`, `{"direct":"maybe"}`, `{"direct":1}`, `{"copy_workers":-1}`, `{"handles":-5}`, `{"max_notif":-1}`, `{"submit_ring":-1}`, `{} {}`, `{"pin_cpu":"0"}`,
	} {
		_, err := parseOptions([]byte(in))
		require.ErrorIs(t, err, ecxfer.ErrConfig, "input %q", in)
		require.Equal(t, codeConfig, codeOf(err), "input %q", in)
	}
}

func TestCodes(t *testing.T) {
	require.Equal(t, codeOK, codeOf(nil))
	require.Equal(t, codeOther, codeOf(errors.New("x")))
	seen := map[int]int{}
	for _, c := range codeTable {
		require.Negative(t, c.code)
		require.Equal(t, c.code, codeOf(fmt.Errorf("wrapped: %w", c.err)), "%v", c.err)
		seen[c.code]++
	}
	for code, n := range seen {
		// Only the context errors share a code with ecxfer's own.
		if code != codeTimeout && code != codeCanceled {
			require.Equal(t, 1, n, "code %d used %d times", code, n)
		}
	}
	// A missing backend is reported as such even though New wraps it.
	require.Equal(t, codeNoBackend, codeOf(fmt.Errorf("%w: nixl: %w", ecxfer.ErrNoBackend, ecxfer.ErrConfig)))
}

// decodeNotifs is the reference decoder of encodeNotifs' layout.
func decodeNotifs(b []byte) (map[string][][]byte, error) {
	out := map[string][][]byte{}
	if len(b) == 0 {
		return out, nil
	}
	u32 := func() (int, error) {
		if len(b) < 4 {
			return 0, errors.New("truncated")
		}
		v := binary.LittleEndian.Uint32(b)
		b = b[4:]
		return int(v), nil
	}
	take := func(n int) ([]byte, error) {
		if len(b) < n {
			return nil, errors.New("truncated")
		}
		v := b[:n]
		b = b[n:]
		return v, nil
	}
	ns, err := u32()
	if err != nil {
		return nil, err
	}
	for range ns {
		nl, err := u32()
		if err != nil {
			return nil, err
		}
		name, err := take(nl)
		if err != nil {
			return nil, err
		}
		nm, err := u32()
		if err != nil {
			return nil, err
		}
		for range nm {
			ml, err := u32()
			if err != nil {
				return nil, err
			}
			m, err := take(ml)
			if err != nil {
				return nil, err
			}
			out[string(name)] = append(out[string(name)], append([]byte{}, m...))
		}
	}
	if len(b) != 0 {
		return nil, errors.New("trailing bytes")
	}
	return out, nil
}

func TestEncodeNotifs(t *testing.T) {
	require.Nil(t, encodeNotifs(nil))
	require.Nil(t, encodeNotifs(map[string][][]byte{}))
	in := map[string][][]byte{
		"a":                      {[]byte("s:1"), {}, []byte("s:2")},
		strings.Repeat("x", 256): {make([]byte, 70000)},
	}
	b := encodeNotifs(in)
	out, err := decodeNotifs(b)
	require.NoError(t, err)
	require.Len(t, out, 2)
	require.Equal(t, [][]byte{[]byte("s:1"), {}, []byte("s:2")}, out["a"])
	require.Equal(t, in[strings.Repeat("x", 256)], out[strings.Repeat("x", 256)])
}

// TestRegistryLoopback drives every entry point behind the ABI on the
// loopback backend, including the calls a hostile or confused caller
// makes, and checks nothing is left behind.
func TestRegistryLoopback(t *testing.T) {
	leakcheck.Check(t)
	opts := func(name string) []byte {
		return fmt.Appendf(nil, `{"agent_name":%q,"backend":"loopback","block_size":64,"num_blocks":16}`, name)
	}
	p, err := newTransport(opts("prod"), nil)
	require.NoError(t, err)
	c, err := newTransport(opts("cons"), nil)
	require.NoError(t, err)
	require.NotEqual(t, p, c)
	require.Equal(t, 2, liveTransports())

	md, err := blob(p, blobAgentMetadata)
	require.NoError(t, err)
	require.NotEmpty(t, md)
	desc, err := blob(p, blobMemDescriptor)
	require.NoError(t, err)
	require.NotEmpty(t, desc)
	_, err = blob(p, 3)
	require.Equal(t, codeBadArg, codeOf(err))

	name, pid, err := addPeer(c, md, desc)
	require.NoError(t, err)
	require.Equal(t, "prod", name)
	name2, pid2, err := addPeer(c, md, desc)
	require.NoError(t, err)
	require.Equal(t, name, name2)
	require.Equal(t, pid, pid2, "the same peer keeps its id")
	_, _, err = addPeer(c, []byte("junk"), desc)
	require.Equal(t, codeBadMetadata, codeOf(err))
	_, _, err = addPeer(c, md, []byte{0xc1})
	require.Equal(t, codeBadDescriptor, codeOf(err))

	h, err := postRead(c, []int{1, 2}, pid, []int{3, 4}, []byte("sess:hash"))
	require.NoError(t, err)
	require.Positive(t, h)
	st, err := wait(c, uint64(h), 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, stateDone, st)
	st, err = checkState(c, uint64(h))
	require.NoError(t, err)
	require.Equal(t, stateDone, st)
	require.NoError(t, release(c, uint64(h)))
	require.Equal(t, codeBadHandle, codeOf(release(c, uint64(h))))
	_, err = checkState(c, uint64(h))
	require.Equal(t, codeBadHandle, codeOf(err))
	_, err = wait(c, uint64(h), time.Second)
	require.Equal(t, codeBadHandle, codeOf(err))

	b, err := notifs(p, 10*time.Second)
	require.NoError(t, err)
	got, err := decodeNotifs(b)
	require.NoError(t, err)
	require.Equal(t, map[string][][]byte{"cons": {[]byte("sess:hash")}}, got)
	b, err = notifs(p, 0)
	require.NoError(t, err)
	require.Nil(t, b, "each notification is handed out once")
	b, err = notifs(p, time.Millisecond)
	require.NoError(t, err)
	require.Nil(t, b, "a wait that times out is not an error")

	_, err = postRead(c, []int{1}, pid, []int{1, 2}, nil)
	require.Equal(t, codeIndexMismatch, codeOf(err))
	_, err = postRead(c, []int{16}, pid, []int{1}, nil)
	require.Equal(t, codeIndexRange, codeOf(err))
	_, err = postRead(c, []int{-1}, pid, []int{1}, nil)
	require.Equal(t, codeIndexRange, codeOf(err))
	_, err = postRead(c, []int{1}, pid+100, []int{1}, nil)
	require.Equal(t, codeUnknownPeer, codeOf(err))
	_, err = postRead(c, []int{1}, pid, []int{1}, make([]byte, 1<<20))
	require.Equal(t, codeBadNotif, codeOf(err))

	s, err := stats(c)
	require.NoError(t, err)
	require.Contains(t, string(s), `"reads_done":1`)

	require.NoError(t, removePeer(c, "prod"))
	require.Equal(t, codeUnknownPeer, codeOf(removePeer(c, "prod")))
	_, err = postRead(c, []int{1}, pid, []int{1}, nil)
	require.Equal(t, codeUnknownPeer, codeOf(err), "a removed peer's id is forgotten")

	require.NoError(t, deregister(c))
	require.NoError(t, deregister(c), "deregister twice")
	require.NoError(t, deregister(p))
	for _, err := range []error{
		func() error { _, err := blob(c, blobAgentMetadata); return err }(),
		func() error { _, _, err := addPeer(c, md, desc); return err }(),
		func() error { _, err := postRead(c, []int{1}, pid, []int{1}, nil); return err }(),
		func() error { _, err := checkState(c, uint64(h)); return err }(),
		release(c, uint64(h)),
		removePeer(c, "prod"),
		func() error { _, err := notifs(c, 0); return err }(),
		func() error { _, err := stats(c); return err }(),
		func() error { _, err := wait(c, 1, 0); return err }(),
	} {
		require.Equal(t, codeUnknownTransport, codeOf(err))
	}
	require.Equal(t, 0, liveTransports())
	_, err = newTransport([]byte(`{"agent_name":"x","backend":"loopback","block_size":0,"num_blocks":1}`), nil)
	require.Equal(t, codeConfig, codeOf(err))
	_, err = newTransport([]byte(`{"agent_name":"x","backend":"loopback","block_size":64,"num_blocks":4}`), make([]byte, 10))
	require.Equal(t, codeConfig, codeOf(err))
	_, err = newTransport([]byte(`{"agent_name":"has space","backend":"loopback","block_size":64,"num_blocks":4}`), nil)
	require.Equal(t, codeConfig, codeOf(err))
	_, err = newTransport([]byte(`{"agent_name":"x","backend":"carrier-pigeon","block_size":64,"num_blocks":4}`), nil)
	require.Equal(t, codeConfig, codeOf(err))
	require.Equal(t, 0, liveTransports())
}

func TestLastErrorPerThread(t *testing.T) {
	require.Equal(t, "", takeLastErr())
	require.Equal(t, codeBadArg, fail(fmt.Errorf("%w: here", errBadArg)))
	// The test goroutine may move between threads; lock it to take its
	// own message back.
	done := make(chan string)
	go func() {
		lockAndFail := func() string {
			fail(errors.New("mine"))
			return takeLastErr()
		}
		done <- runLocked(lockAndFail)
	}()
	require.Equal(t, "mine", <-done)
}

func TestDuration(t *testing.T) {
	for _, v := range []float64{math.NaN(), math.Inf(1), math.Inf(-1), 1e19} {
		_, err := duration("x", v, time.Second, true)
		require.ErrorIs(t, err, ecxfer.ErrConfig, "%v", v)
	}
}

// FuzzParseOptions: ecx_new's JSON decoder returns a Config or ErrConfig
// and never panics.
func FuzzParseOptions(f *testing.F) {
	f.Add([]byte(`{"agent_name":"a","block_size":64,"num_blocks":8,"idle":"spin","pin_cpu":1}`))
	f.Add([]byte(`{"xfer_timeout_s":-1,"wait_spin_us":1e9}`))
	f.Add([]byte(`{"bogus":true}`))
	f.Add([]byte(`[1,2]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := parseOptions(data)
		if err != nil {
			if !errors.Is(err, ecxfer.ErrConfig) {
				t.Fatalf("error %v is not ErrConfig", err)
			}
			return
		}
		for _, d := range []time.Duration{cfg.Reactor.SpinFor, cfg.Reactor.YieldFor, cfg.Reactor.ParkTimeout, cfg.Reactor.WaitSpin} {
			if d < 0 {
				t.Fatalf("negative duration %v accepted", d)
			}
		}
		// What is accepted is one JSON object, nothing after it, whose
		// keys are option names exactly as spelt.
		if !json.Valid(data) {
			t.Fatalf("accepted %q, which is not one JSON value", data)
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(data, &m); err != nil || m == nil {
			t.Fatalf("accepted %q, which is not a JSON object (%v)", data, err)
		}
		for k := range m {
			if !optionNames[k] {
				t.Fatalf("accepted key %q, which is no option as spelt", k)
			}
		}
	})
}

// Options are one JSON object with each option spelt exactly and given
// once: encoding/json alone takes keys regardless of case, lets the last
// of a repeated key win, and its More() passes a stray ] or } after the
// object.
func TestOptionsExactKeys(t *testing.T) {
	const base = `"agent_name":"a","block_size":64,"num_blocks":8`
	for _, s := range []string{
		`{` + base + `} x`,
		`{` + base + `}}`,
		`{` + base + `}]`,
		`{` + base + `}]]]garbage`,
		`{` + base + `}{}`,
		`{` + base + `,"backend":"ucx","BACKEND":"loopback"}`,
		`{` + base + `,"Backend":"loopback"}`,
		`{` + base + `,"backend":"ucx","backend":"loopback"}`,
		`{` + base + `,"block_size":64}`,
		`null`,
		`[{` + base + `}]`,
	} {
		_, err := parseOptions([]byte(s))
		require.ErrorIs(t, err, ecxfer.ErrConfig, "accepted %s", s)
	}
	cfg, err := parseOptions([]byte(" {" + base + `,"backend":"loopback"}` + "\n"))
	require.NoError(t, err, "white space around the object is fine")
	require.Equal(t, "loopback", cfg.Backend)
}

// runLocked runs f on one OS thread, as a call from C does.
func runLocked(f func() string) string {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return f()
}

// An add of a name from one thread while another thread removes it: the
// add runs inside the removal (between the transport's removal and the
// ids' update), the worst place. Whatever order they end in, a peer the
// transport holds has a working id. (The add used to find the old id,
// which the removal then forgot: the transport held the peer and
// post_read with the id the add returned said unknown peer.)
func TestAddDuringRemove(t *testing.T) {
	leakcheck.Check(t)
	opts := func(name string) []byte {
		return fmt.Appendf(nil, `{"agent_name":%q,"backend":"loopback","block_size":64,"num_blocks":16}`, name)
	}
	p, err := newTransport(opts("arprod"), nil)
	require.NoError(t, err)
	c, err := newTransport(opts("arcons"), nil)
	require.NoError(t, err)
	defer func() { require.NoError(t, deregister(p)) }()
	defer func() { require.NoError(t, deregister(c)) }()
	md, err := blob(p, blobAgentMetadata)
	require.NoError(t, err)
	desc, err := blob(p, blobMemDescriptor)
	require.NoError(t, err)
	_, _, err = addPeer(c, md, desc)
	require.NoError(t, err)

	var pid uint64
	var addErr error
	added := make(chan struct{})
	testHookRemoved = func() {
		testHookRemoved = nil
		go func() {
			defer close(added)
			_, pid, addErr = addPeer(c, md, desc)
		}()
		// Give the add time to finish here, were nothing holding it.
		select {
		case <-added:
		case <-time.After(50 * time.Millisecond):
		}
	}
	require.NoError(t, removePeer(c, "arprod"))
	<-added
	require.NoError(t, addErr)
	e, err := lookup(c)
	require.NoError(t, err)
	require.NotEmpty(t, e.t.PeerPath("arprod"), "the add came last: the transport holds the peer")
	h, err := postRead(c, []int{1}, pid, []int{1}, nil)
	require.NoError(t, err, "the id the add returned")
	st, err := wait(c, uint64(h), 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, stateDone, st)
	require.NoError(t, release(c, uint64(h)))
}
