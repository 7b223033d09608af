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

func benchRead(b *testing.B, backend string, direct DirectMode) {
	prod, err := New(Config{AgentName: uniqueName("bp"), Backend: backend, BlockSize: 5120, NumBlocks: 64, Direct: direct})
	if err != nil {
		b.Fatal(err)
	}
	defer prod.Deregister()
	cons, err := New(Config{AgentName: uniqueName("bc"), Backend: backend, BlockSize: 5120, NumBlocks: 64, Direct: direct,
		Reactor: reactor.Options{Idle: reactor.IdleSpin, Handles: 256}})
	if err != nil {
		b.Fatal(err)
	}
	defer cons.Deregister()
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	if err != nil {
		b.Fatal(err)
	}
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
