package ecxfer

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// The read-duration histogram (Stats().Latency, ecxfer_read_duration_seconds)
// counts every READ that ended DONE, on every path, with the time from the
// start of its PostRead to DONE: never more than the caller saw between
// calling PostRead and Wait returning, never nothing.
func TestReadDurationMeasured(t *testing.T) {
	const bs, nb, reads = 4096, 16, 40
	for _, c := range []struct {
		name, path string
		cfg        func(*Config)
	}{
		{"engine", "engine", func(c *Config) { c.Direct = DirectOff }},
		{"inline", "direct-sysv", func(c *Config) {}},
		{"copy-workers", "direct-sysv", func(c *Config) { c.InlineBytes = -1 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			leakcheck.Check(t)
			e := env{t: t, backend: "ucx"}
			prod := e.transport(uniqueName("prod"), bs, nb)
			cons := e.transport(uniqueName("cons"), bs, nb, c.cfg)
			pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
			require.Equal(t, c.path, cons.PeerPath(pname))
			before := cons.Stats().Latency
			var seen time.Duration
			for i := range reads {
				t0 := time.Now()
				h, err := cons.PostRead([]int{i % nb}, pname, []int{(i + 1) % nb}, []byte("n"))
				require.NoError(t, err)
				require.NoError(t, cons.Wait(context.Background(), h))
				seen += time.Since(t0)
				require.NoError(t, cons.ReleaseXferHandle(h))
			}
			// The reactor counts a READ right after it publishes it DONE:
			// the last one may be counted a moment after Wait returned.
			after := cons.Stats().Latency
			require.Eventually(t, func() bool {
				after = cons.Stats().Latency
				return after.Count()-before.Count() >= uint64(reads)
			}, 10*time.Second, time.Millisecond, "READs counted")
			require.Equal(t, uint64(reads), after.Count()-before.Count(), "READs counted")
			got := after.Sum() - before.Sum()
			require.Positive(t, got)
			require.LessOrEqual(t, got, seen, "measured more than the caller saw")
			// A READ takes at least a copy of its block and the atomic
			// publication of its state: none is recorded as nothing.
			require.Equal(t, before.CountBelow(64), after.CountBelow(64), "READs recorded under 64 ns")
		})
	}
}
