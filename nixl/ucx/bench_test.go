package ucx

import (
	"math/rand"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/nixl"
)

// The benchmarks drive one agent directly from the benchmark goroutine (no
// reactor) against a producer process that owns UCX-allocated memory: the
// floor a reactor is measured against. UCX_TLS is passed through.

// spinXfer posts id and spins Progress/PollCompletions until it completes.
func spinXfer(b *testing.B, a *Agent, id nixl.XferID, comp []nixl.Completion) {
	if err := a.PostXfer(id); err != nil {
		b.Fatal(err)
	}
	for {
		if _, err := a.Progress(); err != nil {
			b.Fatal(err)
		}
		n := a.PollCompletions(comp)
		for _, c := range comp[:n] {
			if c.ID == id {
				if c.Err != nil {
					b.Fatal(c.Err)
				}
				return
			}
		}
	}
}

func p50(d []time.Duration) time.Duration {
	slices.Sort(d)
	return d[len(d)/2]
}

func BenchmarkRead8KiB(b *testing.B) {
	const block, blocks = 8192, 64
	ch := startChild(b, childOpts{name: "prod", seed: 1, block: block, blocks: blocks, alloc: true, quiet: true})
	c := newConsumer(b, Config{Name: "cons"}, blocks, block)
	c.connect(b, ch)
	id, err := c.a.MakeXfer(nixl.Read, c.local, []int{0}, c.remote, []int{5}, nil)
	require.NoError(b, err)
	comp := make([]nixl.Completion, 16)
	for i := 0; i < 100; i++ { // warm up: connection, page faults
		spinXfer(b, c.a, id, comp)
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		spinXfer(b, c.a, id, comp)
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	b.ReportMetric(float64(p50(lat).Nanoseconds())/1e3, "p50_us")
	b.SetBytes(block)
	c.verify(b, 1, []int{0}, []int{5})
}

func BenchmarkRead880Scattered(b *testing.B) {
	const block, blocks, n = 5120, 1024, 880
	ch := startChild(b, childOpts{name: "prod", seed: 2, block: block, blocks: blocks, alloc: true, quiet: true})
	c := newConsumer(b, Config{Name: "cons"}, blocks, block)
	c.connect(b, ch)
	rng := rand.New(rand.NewSource(1))
	remote := rng.Perm(blocks)[:n]
	local := rng.Perm(blocks)[:n]
	id, err := c.a.MakeXfer(nixl.Read, c.local, local, c.remote, remote, []byte("image done"))
	require.NoError(b, err)
	comp := make([]nixl.Completion, 16)
	for i := 0; i < 10; i++ {
		spinXfer(b, c.a, id, comp)
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		spinXfer(b, c.a, id, comp)
		lat = append(lat, time.Since(t0))
	}
	el := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(n*block)*float64(b.N)/el.Seconds()/1e9, "GB/s")
	b.ReportMetric(float64(p50(lat).Nanoseconds())/1e3, "p50_us")
	c.verify(b, 2, local, remote)
}

// BenchmarkNotifRoundTrip sends one notification at a time between two
// agents in this process (over shared memory) and waits for the receiver
// to hand it out: vLLM's size (101 bytes: with the sender's 8-character
// name past UCX's short path, so in fragments), one under the short path
// and one of 1,000 bytes.
func BenchmarkNotifRoundTrip(b *testing.B) {
	for _, n := range []int{16, 101, 1000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			recv := newTestAgent(b, Config{Name: "receiver"})
			send := newTestAgent(b, Config{Name: "consumer"})
			md, err := recv.LocalMetadata()
			require.NoError(b, err)
			_, err = send.LoadRemoteMetadata(md)
			require.NoError(b, err)
			msg := make([]byte, n)
			got := map[string][][]byte{}
			b.ResetTimer()
			for range b.N {
				require.NoError(b, send.SendNotif("receiver", msg))
				for recv.GetNotifs(got) == 0 {
					_, _ = send.Progress()
					_, _ = recv.Progress()
				}
				clear(got)
			}
		})
	}
}

// BenchmarkProgressIdle is one Progress of a connected agent with nothing
// in flight: what a spinning reactor's turn and a stepping caller's check
// pay for the engine when there is nothing to do.
func BenchmarkProgressIdle(b *testing.B) {
	ch := startChild(b, childOpts{name: "prod", seed: 1, block: 4096, blocks: 16, alloc: true, quiet: true})
	c := newConsumer(b, Config{Name: "cons"}, 16, 4096)
	c.connect(b, ch)
	b.ResetTimer()
	for b.Loop() {
		if _, err := c.a.Progress(); err != nil {
			b.Fatal(err)
		}
	}
}
