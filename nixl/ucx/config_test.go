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

func TestDevicesHaveTCP(t *testing.T) {
	for devs, want := range map[string]bool{
		"":                    true,
		"all":                 true,
		"eth0":                true,
		"lo":                  true,
		"mlx5_0:1,eth0":       true,
		"mlx5_0:1":            false,
		"mlx5_0:1,mlx5_1:1":   false,
		",mlx5_0:1,":          false,
		"mlx5_0:1,all":        true,
		"allx:1":              false,
		"memory,mlx5_0:1":     true, // "memory" counts: no port
		"mlx5_0:1,,mlx5_2:1,": false,
	} {
		require.Equal(t, want, devicesHaveTCP(devs), "UCX_NET_DEVICES=%q", devs)
	}
}

// UCX prints an "invalid configuration" warning for every context whose
// configuration sets a key for a transport it does not open. New sets
// tcp's TX_SEG_SIZE only when UCX_TLS lets tcp in and UCX_NET_DEVICES
// leaves it a device, so a process limited to shared memory (or to RDMA
// ports) makes agents without that line; with tcp in use the key is
// taken, and no warning either.
func TestNoConfigWarnings(t *testing.T) {
	self, err := os.Executable()
	require.NoError(t, err)
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "UCX_TLS=") && !strings.HasPrefix(kv, "UCX_NET_DEVICES=") &&
			!strings.HasPrefix(kv, "UCX_LOG_LEVEL=") {
			env = append(env, kv)
		}
	}
	env = append(env, roleEnv+"=new-agent", "UCX_LOG_LEVEL=warn")
	for _, set := range [][]string{
		{"UCX_TLS=shm"}, {"UCX_TLS=tcp"}, {"UCX_TLS=shm,tcp"}, {"UCX_TLS=^tcp"},
		nil, // neither set (UCX refuses an empty UCX_TLS)
		// No such port here: UCX warns that it is missing, and tcp
		// has no device.
		{"UCX_NET_DEVICES=mlx5_0:1"},
		{"UCX_NET_DEVICES=lo", "UCX_TLS=tcp"},
	} {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(slices.Clone(env), set...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%v: %s", set, out)
		require.NotContains(t, string(out), "invalid configuration", "%v", set)
		require.NotContains(t, string(out), "TX_SEG_SIZE", "%v", set)
	}
}
