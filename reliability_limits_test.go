package ecxfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// Limits a caller or a peer cannot cross: regions that cannot fit, READs
// larger than the region, peer block lists no READ could use.

// hugeRegionResult is what the "hugeregion" role reports.
type hugeRegionResult struct {
	Errs    []string // per case: "" when New succeeded
	Config  []bool   // per case: errors.Is(err, ErrConfig)
	Engine  []bool   // per case: errors.Is(err, ErrEngine)
	ShmLeft []string // entries in the role's private /dev/shm at the end
	ShmErr  string   // why the private /dev/shm could not be mounted
}

// runHugeRegion is the "hugeregion" role: it moves itself into the memory
// cgroup ECX_CGROUP, mounts a private tmpfs of ECX_SHM_SIZE on /dev/shm
// (its mount namespace is its own), then calls New for each
// BlockSize:NumBlocks of ECX_CASES and reports the errors.
func runHugeRegion() int {
	var res hugeRegionResult
	if cg := os.Getenv("ECX_CGROUP"); cg != "" {
		if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
			fmt.Fprintln(os.Stderr, "joining the cgroup:", err)
			return 2
		}
	}
	if m := os.Getenv("ECX_SHMMAX"); m != "" {
		// This IPC namespace is the role's own: lower its System V limit,
		// so that UCX would have to fall back to a /dev/shm file.
		if err := os.WriteFile("/proc/sys/kernel/shmmax", []byte(m), 0); err != nil {
			res.ShmErr = err.Error()
		}
	}
	if sz := os.Getenv("ECX_SHM_SIZE"); sz != "" {
		if err := unix.Mount("tmpfs", "/dev/shm", "tmpfs", 0, "size="+sz); err != nil {
			res.ShmErr = err.Error()
		}
	}
	if extra := os.Getenv("ECX_AS_EXTRA"); extra != "" {
		// Address space for extra more bytes than the process has now: a
		// region beyond it passes New's checks, which look at memory, and
		// the engine's allocation fails.
		n, _ := strconv.ParseUint(extra, 10, 64)
		vm, err := vmSize()
		if err != nil {
			fmt.Fprintln(os.Stderr, "VmSize:", err)
			return 2
		}
		if err := unix.Setrlimit(unix.RLIMIT_AS, &unix.Rlimit{Cur: vm + n, Max: vm + n}); err != nil {
			fmt.Fprintln(os.Stderr, "RLIMIT_AS:", err)
			return 2
		}
	}
	for i, c := range strings.Split(os.Getenv("ECX_CASES"), ",") {
		bs, nb, _ := strings.Cut(c, ":")
		b, _ := strconv.Atoi(bs)
		n, _ := strconv.Atoi(nb)
		tr, err := New(Config{AgentName: fmt.Sprintf("huge-%d", i), BlockSize: b, NumBlocks: n,
			Backend: os.Getenv("ECX_BACKEND")})
		if err == nil {
			res.Errs = append(res.Errs, "")
			_ = tr.Deregister()
		} else {
			res.Errs = append(res.Errs, err.Error())
		}
		res.Config = append(res.Config, errors.Is(err, ErrConfig))
		res.Engine = append(res.Engine, errors.Is(err, ErrEngine))
	}
	if ents, err := os.ReadDir("/dev/shm"); err == nil {
		for _, e := range ents {
			res.ShmLeft = append(res.ShmLeft, e.Name())
		}
	}
	if err := json.NewEncoder(ctrlOut).Encode(res); err != nil {
		return 1
	}
	return 0
}

// hugeRegion runs the "hugeregion" role in a child process, unshared by
// the CLONE_ flags in unshare, with env added, and returns its report.
func hugeRegion(t *testing.T, unshare uintptr, env ...string) hugeRegionResult {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(append(os.Environ(), roleEnv+"=hugeregion"), env...)
	if unshare != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: unshare}
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "the child died: %s", stderr.String())
	var res hugeRegionResult
	require.NoError(t, json.Unmarshal(out, &res), "child said %q", out)
	return res
}

// vmSize is this process's address space in bytes (VmSize).
func vmSize() (uint64, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmSize:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmSize in /proc/self/status")
}

// A region New's checks let through (it fits the machine's memory) but
// that the engine cannot allocate (the process's address space is
// limited) fails New with ErrEngine, as the API documents, not with a
// bare system error. Both backends, in a child process.
func TestNewEngineFailureIsErrEngine(t *testing.T) {
	for _, backend := range []string{"loopback", "ucx"} {
		res := hugeRegion(t, 0, "ECX_BACKEND="+backend, "ECX_AS_EXTRA="+strconv.Itoa(256<<20), "ECX_CASES=536870912:1")
		require.Len(t, res.Errs, 1)
		require.NotEmpty(t, res.Errs[0], "%s: 512 MiB fit in 256 MiB of address space", backend)
		require.True(t, res.Engine[0], "%s: want ErrEngine, got %q", backend, res.Errs[0])
	}
}

// memCgroupDir makes a memory cgroup below this process's own, limited to
// limit bytes, and removes it when the test ends.
func memCgroupDir(t *testing.T, limit uint64) string {
	t.Helper()
	var base cgroupDir
	for _, d := range cgroupDirs() {
		if _, err := os.Stat(filepath.Join(d.dir, d.limit)); err == nil {
			base = d // the first is the process's own cgroup
			break
		}
	}
	if base.dir == "" {
		t.Skip("no memory cgroup controller is mounted")
	}
	dir := filepath.Join(base.dir, fmt.Sprintf("ecxfer-test-%d-%d", os.Getpid(), nameSeq.Add(1)))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("cannot make a memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		// The cgroup is empty once the role has exited; its charges may take
		// a moment to go.
		for i := 0; i < 50; i++ {
			if err := os.Remove(dir); err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("cgroup %s could not be removed", dir)
	})
	require.NoError(t, os.WriteFile(filepath.Join(dir, base.limit), []byte(strconv.FormatUint(limit, 10)), 0))
	return dir
}

// TestHugeRegionRefused: engine-allocated regions that cannot fit are
// refused with ErrConfig before anything is allocated. New runs in a child
// process inside a 384 MiB memory cgroup, with a private 96 MiB /dev/shm
// and its own IPC namespace whose System V limit is 64 MiB, so a regression
// kills only that child: a 1 GiB region (beyond the cgroup), a 1 TiB one
// (beyond the machine) and a 128 MiB one (beyond System V, so it would go
// to /dev/shm, and beyond that too) are refused; an 8 MiB one works;
// nothing is left in /dev/shm.
func TestHugeRegionRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: makes a memory cgroup and mounts a tmpfs")
	}
	cg := memCgroupDir(t, 384<<20)
	res := hugeRegion(t, syscall.CLONE_NEWNS|syscall.CLONE_NEWIPC, "ECX_CGROUP="+cg, "ECX_SHM_SIZE=96m", "ECX_SHMMAX=67108864",
		"ECX_CASES="+strings.Join([]string{"1073741824:1", "1099511627776:1", "134217728:1", "8388608:1"}, ","))
	require.Len(t, res.Errs, 4)
	for i, what := range []string{"cgroup", "MemAvailable", "/dev/shm"} {
		if i == 2 && res.ShmErr != "" {
			t.Logf("no private /dev/shm (%s): the 128 MiB case is not checked", res.ShmErr)
			continue
		}
		require.True(t, res.Config[i], "case %d: want ErrConfig, got %q", i, res.Errs[i])
		require.Contains(t, res.Errs[i], what, "case %d", i)
	}
	require.Empty(t, res.Errs[3], "an 8 MiB region must fit")
	if res.ShmErr == "" {
		require.Empty(t, res.ShmLeft, "files left in /dev/shm")
	}

	// With System V at its usual limits the same 128 MiB region goes to a
	// System V segment: a /dev/shm smaller than the region (a container's
	// 96 MiB, say) does not refuse it.
	res = hugeRegion(t, syscall.CLONE_NEWNS, "ECX_CGROUP="+cg, "ECX_SHM_SIZE=96m", "ECX_CASES=134217728:1")
	if res.ShmErr != "" {
		t.Skipf("no private /dev/shm: %s", res.ShmErr)
	}
	require.Equal(t, []string{""}, res.Errs, "a region System V can hold is refused for /dev/shm's size")
}

// TestReadIndexLimit: a READ with more indices than the region has blocks
// is refused with ErrIndexRange before anything is copied or posted.
func TestReadIndexLimit(t *testing.T) {
	_, cons, pname := loopbackPair(t, 64, 16)
	big := make([]int, 1<<24) // every index is block 0: in range
	_, err := cons.PostRead(big, pname, big, nil)
	require.ErrorIs(t, err, ErrIndexRange)
	_, err = cons.PostRead(big[:16], pname, big, nil)
	require.ErrorIs(t, err, ErrIndexRange)
	_, err = cons.PostRead(big[:17], pname, big[:17], nil)
	require.ErrorIs(t, err, ErrIndexRange)
	s := cons.Stats()
	require.Zero(t, s.ReadsPosted)
	require.Zero(t, s.LiveHandles)
	// NumBlocks indices are allowed.
	h, err := cons.PostRead(big[:16], pname, big[:16], nil)
	require.NoError(t, err)
	st, err := wait(t, cons, h)
	require.NoError(t, err)
	require.Equal(t, StateDone, st)
	require.NoError(t, cons.ReleaseXferHandle(h))
}

// TestPeerDescriptorChecks: AddRemotePeer refuses block lists whose
// descriptors are not one block long or name an out-of-range device.
func TestPeerDescriptorChecks(t *testing.T) {
	for _, backend := range []string{"loopback", "ucx"} {
		t.Run(backend, func(t *testing.T) {
			e := env{t: t, backend: backend}
			prod := e.transport(uniqueName("prod"), 64, 8)
			cons := e.transport(uniqueName("cons"), 64, 8)
			good, err := descriptors.Decode(prod.MemDescriptor())
			require.NoError(t, err)
			for name, mut := range map[string]func(l descriptors.List){
				"short":     func(l descriptors.List) { l[3].Len = 32 },
				"long":      func(l descriptors.List) { l[0].Len = 128 },
				"dev max":   func(l descriptors.List) { l[5].DevID = 1<<64 - 1 },
				"dev 2^31":  func(l descriptors.List) { l[5].DevID = 1 << 31 },
				"all short": func(l descriptors.List) { l[7].Len = 1 },
			} {
				l := append(descriptors.List(nil), good...)
				mut(l)
				b, err := descriptors.Encode(l)
				require.NoError(t, err)
				_, err = cons.AddRemotePeer(prod.AgentMetadata(), b)
				require.ErrorIs(t, err, ErrBadDescriptor, name)
			}
			require.Zero(t, cons.Stats().Peers)
			_, err = cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
			require.NoError(t, err)
		})
	}
}

// TestNoStaleSuccessAfterDeath: a same-host producer is killed and reaped
// while the consumer's reactor is busy with READs to it. Every READ posted
// after that fails with ErrRemoteDisconnect: none reads the memory the dead
// producer left behind. On the engine path with engine-allocated memory
// (UCX's segment outlives the process) and on the direct path for every
// region kind it reads (a System V segment, a /dev/shm file, anonymous
// memory through kernel copies).
func TestNoStaleSuccessAfterDeath(t *testing.T) {
	for _, tc := range []struct {
		name, region string
		opt          func(*Config)
	}{
		{"engine-alloc", "alloc", enginePath},
		{"direct-alloc", "alloc", direct},
		{"direct-shm", "shm", direct},
		{"direct-mmap", "mmap", direct},
	} {
		t.Run(tc.name, func(t *testing.T) { testNoStaleSuccess(t, tc.region, tc.opt) })
	}
}

func testNoStaleSuccess(t *testing.T, region string, opt func(*Config)) {
	leakcheck.Check(t)
	cons := env{t: t, backend: "ucx"}.transport(uniqueName("cons"), relBS, relNB, opt)
	for round := 0; round < 5; round++ {
		name := uniqueName("victim")
		var penv []string
		if region == "shm" {
			penv = []string{"ECX_SHM_PATH=" + filepath.Join("/dev/shm", name+".mmap")}
			t.Cleanup(func() { _ = os.Remove(penv[0][len("ECX_SHM_PATH="):]) })
		}
		pv := startTestProducer(t, nil, name, relBS, relNB, 41, region, penv...)
		_, err := cons.AddRemotePeer(pv.hello.Metadata, pv.hello.MemDesc)
		require.NoError(t, err)
		wantPath := map[string]string{"alloc": "direct-sysv", "shm": "direct-file", "mmap": "direct-proc"}[region]
		if cons.cfg.Direct == DirectOff {
			wantPath = "engine"
		}
		require.Equal(t, wantPath, cons.PeerPath(name))
		// Keep the reactor busy (spinning, not parked) with READs.
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				h, err := cons.PostRead([]int{i % relNB}, name, []int{i % relNB}, nil)
				if err != nil {
					continue
				}
				// Not wait(): no require outside the test's goroutine.
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				_ = cons.Wait(ctx, h)
				cancel()
				_ = cons.ReleaseXferHandle(h)
			}
		}()
		time.Sleep(20 * time.Millisecond)
		pv.kill() // returns once the process is reaped
		stale := 0
		for i := 0; i < 8; i++ {
			h, err := cons.PostRead([]int{relNB - 1 - i}, name, []int{i}, nil)
			if err != nil {
				require.ErrorIs(t, err, ErrUnknownPeer) // dropped already: fine
				continue
			}
			st, err := wait(t, cons, h)
			if st == StateDone {
				stale++
			} else {
				require.ErrorIs(t, err, ErrRemoteDisconnect)
			}
			require.NoError(t, cons.ReleaseXferHandle(h))
		}
		close(stop)
		wg.Wait()
		require.Zero(t, stale, "round %d: READs posted after the producer was reaped ended DONE", round)
		_ = cons.RemoveRemotePeer(name)
	}
}

// TestLargeReadIsExecutedInPieces: a READ of the whole 256 MiB region goes
// to the engine a few MiB per loop turn. A one-block READ posted right
// after it is DONE while the large one is still running (on one piece the
// large READ would be DONE first: its copy alone takes milliseconds), and
// an XferTimeout of 1 ms ends a large READ that is still running with
// ErrTimeout (copying 256 MiB takes several milliseconds at any speed this
// machine has).
func TestLargeReadIsExecutedInPieces(t *testing.T) {
	const bs, nb = 64 << 10, 4096 // 256 MiB
	e := ucxEnv(t)
	pname := uniqueName("prod")
	prod := e.transport(pname, bs, nb)
	cons := e.transport(uniqueName("cons"), bs, nb)
	_, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	all := make([]int, nb)
	for i := range all {
		all[i] = i
	}
	conclusive := 0
	for trial := 0; trial < 5 && conclusive < 2; trial++ {
		big, err := cons.PostRead(all, pname, all, nil)
		require.NoError(t, err)
		small, err := cons.PostRead([]int{0}, pname, []int{1}, nil)
		require.NoError(t, err)
		// Watch both; the first state seen with one of them DONE decides.
		for {
			sb, _ := cons.CheckXferState(big)
			ss, _ := cons.CheckXferState(small)
			if sb == StateProc && ss == StateProc {
				continue
			}
			require.NotEqual(t, StateErr, sb)
			require.NotEqual(t, StateErr, ss)
			switch {
			case ss == StateDone && sb == StateProc:
				conclusive++
			case sb == StateDone && ss == StateProc:
				t.Fatalf("trial %d: the maximum READ finished before the one-block READ posted after it", trial)
			default:
				t.Logf("trial %d: both seen DONE at once (the watcher was descheduled): inconclusive", trial)
			}
			break
		}
		for _, h := range []Handle{big, small} {
			st, err := wait(t, cons, h)
			require.NoError(t, err)
			require.Equal(t, StateDone, st)
			require.NoError(t, cons.ReleaseXferHandle(h))
		}
	}
	require.Positive(t, conclusive, "no trial was conclusive")

	short := e.transport(uniqueName("cons"), bs, nb, func(c *Config) { c.XferTimeout = time.Millisecond })
	_, err = short.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	require.NoError(t, err)
	h, err := short.PostRead(all, pname, all, nil)
	require.NoError(t, err)
	st, err := wait(t, short, h)
	require.Equal(t, StateErr, st)
	require.ErrorIs(t, err, ErrTimeout)
	require.NoError(t, short.ReleaseXferHandle(h))
	require.Equal(t, int64(0), short.Stats().InFlight)
}
