package leakcheck

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDetectsLeakedFD(t *testing.T) {
	s := Take()
	f, err := os.Open("/dev/null")
	require.NoError(t, err)
	err = s.Wait(50 * time.Millisecond)
	require.Error(t, err)
	require.True(t, strings.Contains(err.Error(), "/dev/null"), err.Error())
	require.NoError(t, f.Close())
	require.NoError(t, s.Wait(time.Second))
}

func TestDetectsLeakedGoroutine(t *testing.T) {
	s := Take()
	stop := make(chan struct{})
	go func() { <-stop }()
	require.Error(t, s.Wait(50*time.Millisecond))
	close(stop)
	require.NoError(t, s.Wait(time.Second))
}

// A goroutine of the baseline that exits must not hide a new one: the count
// stays the same, the goroutines do not.
func TestDetectsLeakReplacingExitedGoroutine(t *testing.T) {
	oldStop, oldDone := make(chan struct{}), make(chan struct{})
	go func() { <-oldStop; close(oldDone) }()
	s := Take()
	close(oldStop)
	<-oldDone
	stop := make(chan struct{})
	go func() { <-stop }()
	err := s.Wait(50 * time.Millisecond)
	require.Error(t, err)
	require.Contains(t, err.Error(), "TestDetectsLeakReplacingExitedGoroutine")
	close(stop)
	require.NoError(t, s.Wait(time.Second))
}

func TestFDCount(t *testing.T) {
	before := FDCount()
	f, err := os.Open("/dev/null")
	require.NoError(t, err)
	require.Equal(t, before+1, FDCount())
	require.NoError(t, f.Close())
}
