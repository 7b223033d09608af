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

func TestFDCount(t *testing.T) {
	before := FDCount()
	f, err := os.Open("/dev/null")
	require.NoError(t, err)
	require.Equal(t, before+1, FDCount())
	require.NoError(t, f.Close())
}
