package reactor

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// releaseCounter counts an engine's ReleaseXfer calls.
type releaseCounter struct {
	*loopback.Agent
	posts, releases atomic.Int64
}

func (a *releaseCounter) PostXfer(id nixl.XferID) error {
	a.posts.Add(1)
	return a.Agent.PostXfer(id)
}

func (a *releaseCounter) ReleaseXfer(id nixl.XferID) error {
	a.releases.Add(1)
	return a.Agent.ReleaseXfer(id)
}

// Release of an engine READ in flight returns once the loop has released
// it in the engine, whatever the engine (here one that fences nothing):
// a READ the caller posts next into the same blocks reaches the engine
// after that release, so an engine that holds READs into the memory of
// one released with requests outstanding (NIXL's) sees the released one
// first. Release used to push its cancel and return, and a Post right
// after could be submitted in the loop turn before the cancel was taken
// (the loop drained cancels, then submissions).
func TestReleaseWaitsForTheEngineRelease(t *testing.T) {
	prod, prodEng := startLoopback(t, "prod", 16, Options{})
	la, err := loopback.New(uniqueName("cons"))
	require.NoError(t, err)
	eng := &releaseCounter{Agent: la}
	r, err := Start(eng, Options{}, blockSetup(64, 16))
	if err != nil {
		_ = la.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	md := loopbackMD(t, prod, prodEng)
	pname, err := r.AddPeer(md, prod.loc.Load().descs)
	require.NoError(t, err)
	la.SetDelay(time.Hour) // READs stay in flight
	for i := range 50 {
		h, err := r.Post(pname, []int{0}, []int{1}, nil)
		require.NoError(t, err)
		for deadline := time.Now().Add(5 * time.Second); eng.posts.Load() <= int64(i); {
			require.True(t, time.Now().Before(deadline), "the READ never reached the engine")
			time.Sleep(10 * time.Microsecond)
		}
		before := eng.releases.Load()
		require.NoError(t, r.Release(h))
		require.Equal(t, before+1, eng.releases.Load(), "Release returned before the engine released READ %d", i)
	}
}
