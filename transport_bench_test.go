package ecxfer

import (
	"runtime"
	"testing"

	"github.com/ecxfer/ecxfer/reactor"
)

// BenchmarkRead measures one PostRead -> DONE -> Release round trip of a
// one-block READ, with both transports in this process: for loopback that
// is the reactor's own cost, for ucx-engine the reactor plus UCX over
// shared memory, for ucx (the default) the direct path's copy inside
// PostRead. allocs/op is the steady-state allocation count of the whole
// process (both reactors included).
func BenchmarkRead(b *testing.B) {
	for _, c := range []struct {
		name, backend string
		direct        DirectMode
	}{{"loopback", "loopback", DirectAuto}, {"ucx-engine", "ucx", DirectOff}, {"ucx", "ucx", DirectAuto}} {
		b.Run(c.name, func(b *testing.B) { benchRead(b, c.backend, c.direct) })
	}
}

// benchPair makes a producer from pc and a consumer from cc (each named
// afresh), deregistered when the benchmark ends, and returns them with the
// consumer's name for the producer.
func benchPair(b *testing.B, pc, cc Config) (prod, cons *Transport, pname string) {
	b.Helper()
	var err error
	pc.AgentName, cc.AgentName = uniqueName("bp"), uniqueName("bc")
	if prod, err = New(pc); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = prod.Deregister() })
	if cons, err = New(cc); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cons.Deregister() })
	if pname, err = cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor()); err != nil {
		b.Fatal(err)
	}
	return prod, cons, pname
}

func benchRead(b *testing.B, backend string, direct DirectMode) {
	_, cons, pname := benchPair(b, Config{Backend: backend, BlockSize: 5120, NumBlocks: 64, Direct: direct},
		Config{Backend: backend, BlockSize: 5120, NumBlocks: 64, Direct: direct,
			Reactor: reactor.Options{Idle: reactor.IdleSpin, Handles: 256}})
	local, remote := []int{1}, []int{2}
	one := func() {
		h, err := cons.PostRead(local, pname, remote, nil)
		if err != nil {
			b.Fatal(err)
		}
		for {
			st, err := cons.CheckXferState(h)
			if err != nil {
				b.Fatal(err)
			}
			if st == StateDone {
				break
			}
			runtime.Gosched()
		}
		if err := cons.ReleaseXferHandle(h); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < 5000; i++ { // warm every table slot's buffers
		one()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		one()
	}
}
