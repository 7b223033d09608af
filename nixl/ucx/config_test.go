package ucx

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTLSHasTCP(t *testing.T) {
	for tls, want := range map[string]bool{
		"":             true,
		"all":          true,
		"tcp":          true,
		"shm,tcp":      true,
		"tcp,cma":      true,
		"shm":          false,
		"shm,cma":      false,
		"posix,sysv":   false,
		"^shm":         true,
		"^tcp":         false,
		"^cma,tcp":     false,
		"^all":         true, // "all" is no transport's name in an exclusion
		"tcpx":         false,
		"xtcp,shm":     false,
		",,tcp,":       true,
		"^":            true,
		"shm,":         false,
		"sm,self,cuda": false,
	} {
		require.Equal(t, want, tlsHasTCP(tls), "UCX_TLS=%q", tls)
	}
}

// UCX prints an "invalid configuration" warning for every context whose
// configuration sets a key for a transport it does not open. New sets
// tcp's TX_SEG_SIZE only when UCX_TLS lets tcp in, so a process limited
// to shared memory makes agents without that line; with tcp allowed the
// key is taken, and no warning either.
func TestNoConfigWarnings(t *testing.T) {
	self, err := os.Executable()
	require.NoError(t, err)
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "UCX_TLS=") && !strings.HasPrefix(kv, "UCX_LOG_LEVEL=") {
			env = append(env, kv)
		}
	}
	env = append(env, roleEnv+"=new-agent", "UCX_LOG_LEVEL=warn")
	// "" stands for UCX_TLS unset (UCX refuses an empty list).
	for _, tls := range []string{"shm", "tcp", "shm,tcp", "^tcp", ""} {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = env
		if tls != "" {
			cmd.Env = append(slices.Clone(env), "UCX_TLS="+tls)
		}
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "UCX_TLS=%q: %s", tls, out)
		require.NotContains(t, string(out), "invalid configuration", "UCX_TLS=%q", tls)
		require.NotContains(t, string(out), "TX_SEG_SIZE", "UCX_TLS=%q", tls)
	}
}
