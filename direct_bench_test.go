package ecxfer

import (
	"context"
	"math/rand"
	"testing"
)

// BenchmarkDirectImage reads an 880 x 32 KiB image (scattered blocks)
// from a producer in this process: on the engine path, and on the direct
// path with 1, 2 and 4 copy workers. GB/s is what matters; compare the
// rows of one run (benchstat), never across runs on a noisy machine.
func BenchmarkDirectImage(b *testing.B) {
	const bs, nb, n = 32768, 1024, 880
	cases := []struct {
		name    string
		mode    DirectMode
		workers int
	}{
		{"engine", DirectOff, 0},
		{"direct/workers=1", DirectOn, 1},
		{"direct/workers=2", DirectOn, 2},
		{"direct/workers=4", DirectOn, 4},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			prod, err := New(Config{AgentName: uniqueName("ip"), BlockSize: bs, NumBlocks: nb, Direct: c.mode})
			if err != nil {
				b.Fatal(err)
			}
			defer prod.Deregister()
			rand.New(rand.NewSource(1)).Read(prod.Region())
			cons, err := New(Config{AgentName: uniqueName("ic"), BlockSize: bs, NumBlocks: nb, Direct: c.mode, CopyWorkers: c.workers})
			if err != nil {
				b.Fatal(err)
			}
			defer cons.Deregister()
			pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			if err != nil {
				b.Fatal(err)
			}
			rng := rand.New(rand.NewSource(2))
			local, remote := rng.Perm(nb)[:n], rng.Perm(nb)[:n]
			read := func() {
				h, err := cons.PostRead(local, pname, remote, nil)
				if err != nil {
					b.Fatal(err)
				}
				if err := cons.Wait(context.Background(), h); err != nil {
					b.Fatal(err)
				}
				if err := cons.ReleaseXferHandle(h); err != nil {
					b.Fatal(err)
				}
			}
			read()
			b.SetBytes(n * bs)
			b.ReportAllocs()
			for b.Loop() {
				read()
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/read")
		})
	}
}
