package reactor

import (
	"bufio"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/internal/procinfo"
	"github.com/ecxfer/ecxfer/internal/shmview"
)

// stackOf returns the start of process pid's stack mapping.
func stackOf(t *testing.T, pid int) uint64 {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "[stack]") {
			lo, _, _ := strings.Cut(strings.Fields(sc.Text())[0], "-")
			v, err := strconv.ParseUint(lo, 16, 64)
			require.NoError(t, err)
			return v
		}
	}
	t.Fatal("no stack mapping")
	return 0
}

// A producer's lifeword that says alive for ever (a foreign or broken
// producer's: a sealed "ecxfer-life" memfd with a thread id in it, never
// registered for the kernel to mark at exit) hid the producer's exit: the
// direct path trusted the word and never polled the pidfd, which stayed
// readable in the epoll set, and the reactor thread took turns back to
// back for ever instead of parking (266,393 turns in 300 ms against 6).
// A pidfd that wakes the thread is now polled whatever the word says: the
// peer is declared dead, its pidfd leaves the set, and the thread parks.
func TestLifewordThatLiesAlive(t *testing.T) {
	leakcheck.Check(t)
	p := directPair(t, DirectOptions{})
	r := p.cons

	fd, err := unix.MemfdCreate("ecxfer-life", unix.MFD_ALLOW_SEALING|unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, 4096))
	mem, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	*(*uint32)(unsafe.Pointer(&mem[128])) = 12345 // a thread id, no robust list
	require.NoError(t, unix.Munmap(mem))
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	require.NoError(t, err)
	life := os.NewFile(uintptr(fd), "life")
	cmd := exec.Command("sleep", "30")
	cmd.ExtraFiles = []*os.File{life} // its fd 3
	require.NoError(t, cmd.Start())
	require.NoError(t, life.Close())
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	pid := cmd.Process.Pid
	var start uint64
	require.Eventually(t, func() bool {
		// Once exec has replaced the forked Go image.
		s, err := procinfo.StartTime(pid)
		start = s
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
		return err == nil && strings.TrimSpace(string(b)) == "sleep"
	}, 5*time.Second, time.Millisecond)
	h, err := shmview.LocalHost()
	require.NoError(t, err)
	adv := shmview.Advert{Kind: shmview.KindProc, Host: h, PID: uint32(pid), Start: start,
		Base: stackOf(t, pid), Size: 4096, Notify: shmview.LifeToken(0, 3)}
	adv.NotifyKey[0] = 1
	d, err := OpenDirect(&adv, nil)
	require.NoError(t, err)
	require.Equal(t, "lifeword", d.Liveness(), "the lying word is taken")
	md := loopbackMD(t, p.prod, p.prodEng)
	require.NoError(t, r.RemovePeer(p.pname))
	_, err = r.AddPeerDirect(md, p.prod.loc.Load().descs, d)
	require.NoError(t, err)

	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	require.Eventually(t, func() bool { return d.dead.Load() }, 5*time.Second, time.Millisecond,
		"the producer's exit is seen though its word says alive")
	// And the thread parks again: a few turns a second, not a spin.
	time.Sleep(50 * time.Millisecond)
	before := r.Stats().LoopTurns
	time.Sleep(300 * time.Millisecond)
	require.Less(t, r.Stats().LoopTurns-before, uint64(10_000), "loop turns in 300 ms after the exit")
}
