package ecxfer

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/lifeword"
	"github.com/ecxfer/ecxfer/internal/pattern"
)

// TestAddDuringProducerDeregister: a consumer adds a same-host producer
// while the producer is in Deregister, its lifeword already retired and
// its teardown held up (here by a READ of its own on the copy workers;
// in life by up to a second of notifications to flush). The consumer
// must learn the producer retired: its READs end ERR once Deregister has
// returned and the caller reuses its memory. The lifeword's descriptor
// used to be closed first thing in Deregister; the consumer's look-up
// then failed, it fell back to the producer's pidfd, which never fires
// for a process that lives on, and every READ ended DONE with whatever
// the caller had written since.
func TestAddDuringProducerDeregister(t *testing.T) {
	for _, k := range regionKinds {
		if k.region == nil {
			continue
		}
		t.Run(k.name, func(t *testing.T) {
			e := env{t: t, backend: "ucx"}
			const bs, nb = 32768, 16
			name := uniqueName("closing")
			region := k.region(t, bs*nb)
			prod := e.transport(name, bs, nb, direct, func(c *Config) { c.Region = region })
			pattern.FillRegion(prod.Region(), 3, bs)
			require.NotNil(t, prod.life, "the producer holds a lifeword")
			// Watched as a consumer watches it: the mapping outlives
			// the descriptor.
			w, err := lifeword.Watch(os.Getpid(), prod.life.FD(), prod.life.ID())
			require.NoError(t, err)
			defer w.Close()
			q := e.transport(uniqueName("q"), bs, nb, direct)
			_, err = prod.AddRemotePeer(q.AgentMetadata(), q.MemDescriptor())
			require.NoError(t, err)
			entered, let := holdDirectChunks()
			defer let()
			idx := []int{0, 1, 2, 3, 4, 5, 6, 7}
			_, err = prod.PostRead(idx, q.cfg.AgentName, idx, nil) // 256 KiB: on the copy workers
			require.NoError(t, err)
			require.Eventually(t, func() bool { return entered.Load() > 0 }, 5*time.Second, 100*time.Microsecond)
			md, desc := prod.AgentMetadata(), prod.MemDescriptor()
			dereg := make(chan error, 1)
			go func() { dereg <- prod.Deregister() }()
			require.Eventually(t, func() bool { return w.State() == lifeword.Retired }, 5*time.Second, 100*time.Microsecond)

			cons := e.transport(uniqueName("cons"), bs, nb, direct)
			_, err = cons.AddRemotePeer(md, desc)
			require.NoError(t, err, "the producer's engine is still up")
			require.Equal(t, "lifeword", cons.r.PeerLiveness(name), "the retired word is found")
			let()
			require.NoError(t, <-dereg)
			for i := range region {
				region[i] = 0xab // the caller reuses its memory after Deregister
			}
			h, err := cons.PostRead([]int{0, 1}, name, []int{0, 1}, nil)
			require.NoError(t, err)
			st, err := wait(t, cons, h)
			require.Equal(t, StateErr, st, "a READ of a producer that closed its transport")
			require.ErrorIs(t, err, ErrRemoteDisconnect)
			require.NoError(t, cons.ReleaseXferHandle(h))
		})
	}
}
