package ucx

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/nixl"
)

// TestLyingMetadata: metadata re-encoded with a valid checksum but regions
// larger than (or shifted off) the memory behind them is refused at
// LoadRemoteMetadata, both for UCX-allocated memory (checked against the
// segment mapped here) and for caller memory in a shared file (checked
// against the peer's own mappings). The truthful blob still loads.
func TestLyingMetadata(t *testing.T) {
	cons := newTestAgent(t, Config{Name: "cons"})

	alloc := newTestAgent(t, Config{Name: "prod-alloc"})
	_, _, err := alloc.AllocMem(1<<20, nixl.DRAM, 0)
	require.NoError(t, err)

	caller := newTestAgent(t, Config{Name: "prod-caller"})
	fd, err := unix.MemfdCreate("ecxfer-truth", 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, 1<<20))
	buf, err := unix.Mmap(fd, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer func() { _ = unix.Munmap(buf) }()
	_, err = caller.RegisterMem(buf, nixl.DRAM, 0)
	require.NoError(t, err)

	for _, prod := range []*Agent{alloc, caller} {
		md, err := prod.LocalMetadata()
		require.NoError(t, err)
		for name, lie := range map[string]func(r *region){
			"4 MiB longer": func(r *region) { r.Len += 4 << 20 },
			"1 GiB longer": func(r *region) { r.Len += 1 << 30 },
			"starts 1 MiB early": func(r *region) {
				r.Addr -= 1 << 20
				r.Len += 1 << 20
			},
		} {
			m, err := decodeMetadata(md)
			require.NoError(t, err)
			lie(&m.Region[0])
			forged, err := encodeMetadata(m)
			require.NoError(t, err)
			_, err = cons.LoadRemoteMetadata(forged)
			require.ErrorIs(t, err, nixl.ErrInvalidParam, "%s: %s", prod.Name(), name)
		}
		got, err := cons.LoadRemoteMetadata(md)
		require.NoError(t, err, prod.Name())
		require.Equal(t, prod.Name(), got)
	}
}
