package reactor

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// Reactors on the loopback engine, for tests of the reactor alone.

var nameSeq atomic.Int64

func uniqueName(prefix string) string { return fmt.Sprintf("%s-%d", prefix, nameSeq.Add(1)) }

// blockSetup registers nb blocks of bs bytes, allocated by the engine.
func blockSetup(bs, nb int) Setup {
	return func(a nixl.Agent) (descriptors.List, nixl.DlistID, error) {
		_, region, err := a.AllocMem(bs*nb, nixl.DRAM, 0)
		if err != nil {
			return nil, 0, err
		}
		descs := descriptors.BuildBlockDescs(nixl.Addr(region), nb, uint64(bs), 0)
		dl, err := a.PrepDlist("", descs, nixl.DRAM)
		return descs, dl, err
	}
}

// startLoopback starts a reactor on a fresh loopback agent; the test's
// cleanup closes it.
func startLoopback(t testing.TB, prefix string, nb int, opts Options) (*Reactor, *loopback.Agent) {
	t.Helper()
	a, err := loopback.New(uniqueName(prefix))
	require.NoError(t, err)
	r, err := Start(a, opts, blockSetup(64, nb))
	if err != nil {
		_ = a.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r, a
}

// testPair is a producer reactor and a consumer reactor that knows it.
type testPair struct {
	prod, cons   *Reactor
	pname        string
	prodEng      *loopback.Agent
	consEng      *loopback.Agent
	prodBlocks   int
	remoteBlocks int
}

func newPair(t testing.TB, nb int, consOpts Options) *testPair {
	t.Helper()
	p := &testPair{prodBlocks: nb, remoteBlocks: nb}
	p.prod, p.prodEng = startLoopback(t, "prod", nb, Options{})
	p.cons, p.consEng = startLoopback(t, "cons", nb, consOpts)
	md := loopbackMD(t, p.prod, p.prodEng)
	name, err := p.cons.AddPeer(md, p.prod.loc.Load().descs)
	require.NoError(t, err)
	p.pname = name
	return p
}

// loopbackMD is the metadata of prod, a loopback reactor, as a consumer
// adds it.
func loopbackMD(t testing.TB, prod *Reactor, eng *loopback.Agent) []byte {
	t.Helper()
	var md []byte
	require.NoError(t, prod.do(func() error {
		var err error
		md, err = eng.LocalMetadata()
		return err
	}))
	return md
}
