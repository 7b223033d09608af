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
			prod, cons, pname := benchPair(b, Config{BlockSize: bs, NumBlocks: nb, Direct: c.mode},
				Config{BlockSize: bs, NumBlocks: nb, Direct: c.mode, CopyWorkers: c.workers})
			rand.New(rand.NewSource(1)).Read(prod.Region())
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

// BenchmarkDirectInline posts one-block READs of 5,120 B, copied inline in
// PostRead, and checks each once (DONE when PostRead returns), with and
// without a vLLM-sized notification to the producer (in this process,
// through its socket; the producer's reactor drains it). The cost of a
// READ on the path a vLLM step takes for a small request.
func BenchmarkDirectInline(b *testing.B) {
	const bs, nb = 5120, 4096
	for _, c := range []struct {
		name  string
		notif []byte
	}{
		{"notif=none", nil},
		{"notif=80B", make([]byte, 80)},
	} {
		b.Run(c.name, func(b *testing.B) {
			prod, cons, pname := benchPair(b, Config{BlockSize: bs, NumBlocks: nb}, Config{BlockSize: bs, NumBlocks: nb})
			if cons.PeerPath(pname) == "engine" {
				b.Fatal("the producer is not read directly")
			}
			local, remote := []int{0}, []int{0}
			i := 0
			b.SetBytes(bs)
			b.ReportAllocs()
			for b.Loop() {
				local[0], remote[0] = i%nb, (i*7)%nb
				i++
				h, err := cons.PostRead(local, pname, remote, c.notif)
				if err != nil {
					b.Fatal(err)
				}
				if st, err := cons.CheckXferState(h); st != StateDone {
					b.Fatalf("state %v (%v): not copied inline", st, err)
				}
				if err := cons.ReleaseXferHandle(h); err != nil {
					b.Fatal(err)
				}
				if i%1024 == 0 {
					prod.NewNotifs()
				}
			}
		})
	}
}
