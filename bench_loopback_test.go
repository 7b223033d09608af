package ecxfer

import (
	"runtime"
	"testing"

	"github.com/ecxfer/ecxfer/reactor"
)

// BenchmarkLoopbackRead measures one PostRead -> DONE -> Release round trip
// through the reactor with the in-process engine: the reactor's own cost.
func BenchmarkLoopbackRead(b *testing.B) {
	prod, err := New(Config{AgentName: uniqueName("bp"), Backend: "loopback", BlockSize: 5120, NumBlocks: 64})
	if err != nil {
		b.Fatal(err)
	}
	defer prod.Deregister()
	cons, err := New(Config{AgentName: uniqueName("bc"), Backend: "loopback", BlockSize: 5120, NumBlocks: 64,
		Reactor: reactor.Options{Idle: reactor.IdleSpin}})
	if err != nil {
		b.Fatal(err)
	}
	defer cons.Deregister()
	pname, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	if err != nil {
		b.Fatal(err)
	}
	local, remote := []int{1}, []int{2}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
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
}
