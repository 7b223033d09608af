package fleet

import (
	"context"
	"encoding/binary"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) {
	if code, ok := Child(); ok {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// TestPeers: one consumer, 256 producer agents in 8 processes (the size
// the fleet asks for; about 15 s under the race detector here);
// every agent is read from with its bytes verified, and once they are all
// removed nothing is left (Peers checks descriptors and goroutines; here
// the shared memory mapped).
func TestPeers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const agents = 256
	res, err := Peers(ctx, PeersConfig{Agents: agents, Procs: 8})
	require.NoError(t, err)
	require.Equal(t, agents, res.PeersSeen)
	require.Equal(t, agents, res.ReadsVerified)
	require.Equal(t, agents*4, res.BlocksRead)
	require.NoError(t, res.LeakErr)
	require.LessOrEqual(t, res.Removed.FDs, res.Base.FDs, "descriptors left after removing every peer")
	require.LessOrEqual(t, res.Removed.SharedMaps, res.Base.SharedMaps, "shared memory left mapped after removing every peer")
	require.LessOrEqual(t, res.Removed.SharedSize, res.Base.SharedSize, "shared memory left mapped after removing every peer")
	require.Greater(t, res.AddP50, time.Duration(0))
	t.Logf("AddRemotePeer p50 %v p99 %v; RSS/peer added %.0f B, read %.0f B; shared maps %d→%d→%d→%d",
		res.AddP50, res.AddP99, res.PerPeer(res.Base.RSS, res.Added.RSS), res.PerPeer(res.Base.RSS, res.Read.RSS),
		res.Base.SharedMaps, res.Added.SharedMaps, res.Read.SharedMaps, res.Removed.SharedMaps)
}

// TestConsumers: one producer process, three consumer processes reading
// with notifications; every notification reaches the producer.
func TestConsumers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := Consumers(ctx, ConsumersConfig{Consumers: 3, BlockSize: 4096, NumBlocks: 256, BlocksPerRead: 8, Duration: 300 * time.Millisecond})
	require.NoError(t, err)
	require.Greater(t, res.Reads, uint64(0))
	require.Greater(t, res.Verified, uint64(0))
	require.Equal(t, int(res.Reads), res.Notifs, "every READ's notification reached the producer")
	require.Greater(t, res.ProducerCPU, time.Duration(0))
	t.Logf("%d reads, %.2f GB/s, notif p50 %v p99 %v (%d early), producer CPU %v (%v/GB)",
		res.Reads, res.GBps(), res.NotifP50, res.NotifP99, res.Early, res.ProducerCPU, res.ProducerCPUPerGB)
}

// An interrupted run (the tool's SIGINT or SIGTERM cancels its context)
// ends at once with the context's error, its children gone, instead of
// running to its end and reporting success.
func TestConsumersInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { time.Sleep(time.Second); cancel() }()
	t0 := time.Now()
	_, err := Consumers(ctx, ConsumersConfig{Consumers: 2, BlockSize: 4096, NumBlocks: 256, BlocksPerRead: 8, Duration: time.Minute})
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, time.Since(t0), 30*time.Second, "the run went on after it was interrupted")
}

// UCX (and anything else) printing to a child's stdout does not reach the
// control stream: the child's Conn is on a descriptor of its own.
func TestChildStdoutIsNotTheControlStream(t *testing.T) {
	t.Setenv("UCX_LOG_LEVEL", "debug") // UCX prints its debug log to stdout
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := Consumers(ctx, ConsumersConfig{Consumers: 1, BlockSize: 4096, NumBlocks: 64, BlocksPerRead: 8, Duration: 200 * time.Millisecond})
	require.NoError(t, err)
	require.Greater(t, res.Verified, uint64(0))
}

// quantile is the nearest rank: the smallest value with at least q of the
// values at or below it (p99 of 256 values is the 254th, not the 253rd).
func TestQuantile(t *testing.T) {
	s := make([]time.Duration, 256)
	for i := range s {
		s[i] = time.Duration(i + 1)
	}
	require.Equal(t, time.Duration(128), quantile(s, 0.5))
	require.Equal(t, time.Duration(254), quantile(s, 0.99))
	require.Equal(t, time.Duration(256), quantile(s, 1))
	require.Equal(t, time.Duration(1), quantile(s, 0))
	require.Equal(t, time.Duration(7), quantile([]time.Duration{7}, 0.99))
	require.Zero(t, quantile(nil, 0.5))
}

// A child that fails reports why and exits. The report can be read after
// the exit has been seen: Spawn's goroutine waits for the child, and Wait
// must not take the child's last message with the pipe.
func TestChildErrorReadAfterExit(t *testing.T) {
	p, err := Spawn("agents", nil, nil)
	require.NoError(t, err)
	defer func() { _ = p.Stop(10 * time.Second) }()
	require.NoError(t, p.C.Send(ctrl.Message{Kind: "setup", Ints: map[string]int64{"n": 1, "bs": 4096, "nb": -1}}))
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("the child did not exit")
	}
	m, err := p.C.Recv()
	require.NoError(t, err, "reading the child's report after its exit")
	require.Equal(t, "error", m.Kind)
	require.Contains(t, m.Strs["error"], "NumBlocks", "the child's own reason")
}

// FuzzNotifLatencies: the producer's notification records and the
// consumers' DONE times, as the children send them back, matched in any
// shape: no panic, and counts and quantiles that agree with each other.
func FuzzNotifLatencies(f *testing.F) {
	rec := func(id, seq uint32, at uint64) []byte {
		b := binary.LittleEndian.AppendUint32(nil, id)
		b = binary.LittleEndian.AppendUint32(b, seq)
		return binary.LittleEndian.AppendUint64(b, at)
	}
	f.Add(append(rec(0, 1, 100), rec(0, 2, 50)...), []byte{1, 0, 0, 0, 90, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{}, []byte{})
	f.Add(rec(0, 0, 1<<63), rec(0, 0, 1<<63)[4:])
	f.Fuzz(func(t *testing.T, recs, times []byte) {
		done := map[[2]uint32]int64{}
		for b := times; len(b) >= 12; b = b[12:] {
			done[[2]uint32{0, binary.LittleEndian.Uint32(b)}] = int64(binary.LittleEndian.Uint64(b[4:]))
		}
		var res ConsumersResult
		notifLatencies(recs, done, &res)
		if res.Notifs > len(recs)/16 || res.Early > res.Notifs || res.NotifP50 > res.NotifP99 || res.NotifP50 < 0 {
			t.Fatalf("%d notifications (%d early) from %d records, p50 %v p99 %v",
				res.Notifs, res.Early, len(recs)/16, res.NotifP50, res.NotifP99)
		}
	})
}

// An agents child told to stop (its stdin closed) while it is still making
// its agents stops between two and exits cleanly, having deregistered
// those it made, instead of making all of them first (and, for an
// interrupted run, being killed in the middle of UCX's setup, which left
// shared-memory files in /dev/shm).
func TestAgentsChildStopsWhileMaking(t *testing.T) {
	p, err := Spawn("agents", nil, nil)
	require.NoError(t, err)
	const n = 500
	require.NoError(t, p.C.Send(ctrl.Message{Kind: "setup", Ints: map[string]int64{"proc": 0, "n": n, "bs": 4096, "nb": 16}}))
	_, err = p.C.Expect("agent")
	require.NoError(t, err)
	made := make(chan int, 1)
	go func() {
		k := 1
		for {
			m, err := p.C.Recv()
			if err != nil || m.Kind != "agent" {
				made <- k
				return
			}
			k++
		}
	}()
	require.NoError(t, p.stdin.Close())
	select {
	case <-p.exited:
	case <-time.After(time.Minute):
		_ = p.cmd.Process.Kill()
		t.Fatal("the child did not stop")
	}
	require.NoError(t, p.err, "the child's exit")
	require.Less(t, <-made, n, "the child made every agent before it stopped")
	_ = p.stdout.Close()
}

// A probe of a far end that accepts and then says nothing ends when its
// context does (the tool's SIGINT), with the context's error: it used to
// wait for as long as the far end kept the connection.
func TestTCPProbeInterrupted(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	conns := make(chan net.Conn, 16)
	defer func() {
		_ = l.Close()
		for c := range conns {
			_ = c.Close()
		}
	}()
	go func() {
		defer close(conns)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns <- c // never read, never answered
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	t0 := time.Now()
	_, err = TCPProbe(ctx, l.Addr().String(), time.Hour)
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, time.Since(t0), 9*time.Second, "the probe outlived its context")
}

// A probe longer than probeSlack works: its second connection used to be
// dialed with the first one's context, whose time had run out by then, so
// `ecxfer-fleet tcp-probe --duration 10s` and longer always failed.
func TestTCPProbeLongerThanSlack(t *testing.T) {
	defer func(s time.Duration) { probeSlack = s }(probeSlack)
	probeSlack = 200 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addrs := make(chan string, 1)
	log := writerFunc(func(b []byte) (int, error) {
		if a, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "tcp-serve: listening on "); ok {
			addrs <- a
		}
		return len(b), nil
	})
	served := make(chan error, 1)
	go func() { served <- TCPServe(ctx, "127.0.0.1:0", log) }()
	r, err := TCPProbe(ctx, <-addrs, 3*probeSlack)
	require.NoError(t, err)
	require.Positive(t, r.Bytes)
	cancel()
	<-served
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
