package reactor

import (
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/lifeword"
	"github.com/ecxfer/ecxfer/internal/shmview"
	"github.com/ecxfer/ecxfer/internal/testhook"
)

// countPidfdPolls counts the direct path's polls of producers' pidfds
// after copies until the test ends.
func countPidfdPolls(t *testing.T) *atomic.Int64 {
	n, stop := testhook.Count(&testhook.PidfdPoll)
	t.Cleanup(stop)
	return n
}

// selfAdvert advertises a /dev/shm region of this process, with the token
// naming descriptor lifeFD, of the holder whose id is lifeID (0: any).
func selfAdvert(t *testing.T, lifeFD int, lifeID uint32) *shmview.Advert {
	t.Helper()
	path := filepath.Join("/dev/shm", fmt.Sprintf("ecxfer_lifeword_%d_%s.mmap", os.Getpid(), t.Name()))
	region, err := shmview.MapNewFile(path, 1<<16)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = unix.Munmap(region)
		_ = os.Remove(path)
	})
	adv, err := shmview.Describe(region)
	require.NoError(t, err)
	require.Equal(t, shmview.KindFile, adv.Kind)
	adv.Notify = shmview.LifeToken(uint64(lifeID)<<32|0x9abc_def0, lifeFD)
	adv.NotifyKey[0] = 1
	return &adv
}

// TestDirectLifewordAnswers: with the producer's lifeword watched, the
// check after each copy polls nothing while the word says Alive; once the
// producer stops its word (it closed its transport and lives on) the word
// says so, and READs of it fail, though its process is alive.
func TestDirectLifewordAnswers(t *testing.T) {
	leakcheck.Check(t)
	polls := countPidfdPolls(t)
	h, err := lifeword.Hold()
	require.NoError(t, err)
	defer h.Stop()
	d, err := OpenDirect(selfAdvert(t, h.FD(), h.ID()), nil)
	require.NoError(t, err)
	defer d.Close()
	require.Equal(t, "lifeword", d.Liveness())
	for range 1000 {
		require.NoError(t, d.gone())
	}
	require.Zero(t, polls.Load(), "a watched word was not trusted")
	require.NoError(t, h.Stop())
	require.ErrorIs(t, d.gone(), errPeerRetired, "a READ ended after the producer closed its transport")
	require.ErrorIs(t, d.gone(), errPeerRetired, "and every one after it")
	require.Zero(t, polls.Load(), "the retired word answers without the pidfd")
}

// TestDirectLifewordRefusedFallsBack: a token that names a descriptor
// that is no lifeword (an older producer's random token can match the tag)
// leaves the pidfd to answer.
func TestDirectLifewordRefusedFallsBack(t *testing.T) {
	leakcheck.Check(t)
	polls := countPidfdPolls(t)
	for name, fd := range map[string]int{"stdin": 0, "closed": 4000, "none": -1} {
		adv := selfAdvert(t, fd, 0)
		_, tagged := adv.LifeFD()
		require.Equal(t, fd >= 0, tagged, name)
		d, err := OpenDirect(adv, nil)
		require.NoError(t, err, name)
		require.Equal(t, "pidfd", d.Liveness(), name)
		before := polls.Load()
		require.NoError(t, d.gone(), name)
		require.Equal(t, before+1, polls.Load(), name)
		d.Close()
	}
}

// TestDirectLifewordOfAnotherHolder: a token whose descriptor now holds
// another holder's word (the producer's transport closed, and a new one
// of that process took the number) is the closed transport's: READs of
// it fail as retired, though the word there says alive.
func TestDirectLifewordOfAnotherHolder(t *testing.T) {
	leakcheck.Check(t)
	h, err := lifeword.Hold()
	require.NoError(t, err)
	defer h.Stop()
	d, err := OpenDirect(selfAdvert(t, h.FD(), h.ID()^0x100), nil)
	require.NoError(t, err)
	defer d.Close()
	require.Equal(t, lifeword.Alive, h.State())
	require.ErrorIs(t, d.gone(), errPeerRetired)
}
