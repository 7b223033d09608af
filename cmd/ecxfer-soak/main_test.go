package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/scrape"
)

// mainEnv makes the test binary run the soak instead of the tests.
const mainEnv = "ECXFER_SOAK_TEST_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) == "1" || os.Getenv(roleEnv) != "" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func scrapeURL(t *testing.T, url string) map[string]*scrape.Family {
	t.Helper()
	fams, err := scrape.Get(url)
	require.NoError(t, err)
	return fams
}

func one(t *testing.T, fams map[string]*scrape.Family, name, typ string) float64 {
	t.Helper()
	f := fams[name]
	require.NotNil(t, f, "%s missing", name)
	require.Equal(t, typ, f.Type, name)
	require.Len(t, f.Samples, 1, name)
	return f.Samples[0].Value
}

// TestSoakMetrics runs a short soak as its own process with --metrics-addr
// and --events, scrapes the consumer's metrics over HTTP while it reads,
// and checks names, types, that the counters move, and that a producer
// restart shows up as an event.
func TestSoakMetrics(t *testing.T) {
	cmd := exec.Command(os.Args[0], "--duration", "4s", "--producers", "1", "--workers", "2", "--restart", "1s",
		"--metrics-addr", "127.0.0.1:0", "--events", "--notif-bytes", "80")
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	var stderr syncBuf
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	var out syncBuf
	urlc := make(chan string, 1)
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		re := regexp.MustCompile(`metrics on (http://\S+)`)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			_, _ = out.Write(append(sc.Bytes(), '\n'))
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				urlc <- m[1]
			}
		}
	}()
	var url string
	select {
	case url = <-urlc:
	case <-time.After(30 * time.Second):
		t.Fatalf("no metrics address:\n%s\n%s", out.String(), stderr.String())
	}

	// Scrape until READs have been counted, then once more to see them move.
	var first map[string]*scrape.Family
	require.Eventually(t, func() bool {
		first = scrapeURL(t, url)
		return first["ecxfer_reads_done_total"] != nil && first["ecxfer_reads_done_total"].Samples[0].Value > 0
	}, 30*time.Second, 20*time.Millisecond, "no READ counted:\n%s", out.String())
	done0 := one(t, first, "ecxfer_reads_done_total", "counter")
	bytes0 := one(t, first, "ecxfer_read_bytes_total", "counter")
	var second map[string]*scrape.Family
	require.Eventually(t, func() bool {
		second = scrapeURL(t, url)
		return one(t, second, "ecxfer_reads_done_total", "counter") > done0
	}, 30*time.Second, 20*time.Millisecond, "reads_done did not move")
	require.Greater(t, one(t, second, "ecxfer_read_bytes_total", "counter"), bytes0)
	require.Greater(t, one(t, second, "ecxfer_reads_posted_total", "counter"), 0.0)
	one(t, second, "ecxfer_reads_in_flight", "gauge")
	one(t, second, "ecxfer_handles_live", "gauge")
	require.Equal(t, "histogram", second["ecxfer_read_duration_seconds"].Type)
	var count float64
	for _, s := range second["ecxfer_read_duration_seconds"].Samples {
		if s.Name == "ecxfer_read_duration_seconds_count" {
			count = s.Value
		}
	}
	require.GreaterOrEqual(t, count, done0)
	require.Equal(t, "counter", second["ecxfer_reads_failed_total"].Type)
	peers := second["ecxfer_peer_reads_done_total"]
	require.NotNil(t, peers)
	require.Len(t, peers.Samples, 1, "one producer")

	<-copied // all of stdout, before Wait closes the pipe
	require.NoError(t, cmd.Wait(), "soak:\n%s\n%s", out.String(), stderr.String())
	require.Contains(t, out.String(), "ecxfer-soak: ok")
	ev := stderr.String()
	require.Contains(t, ev, ecxfer.EventReactorStart)
	require.Contains(t, ev, ecxfer.EventPeerAdded)
	require.Contains(t, ev, ecxfer.EventReactorStop)
	require.True(t, strings.Contains(ev, ecxfer.EventPeerReplaced), "a restart every second replaces the producer:\n%s", ev)
}

// shmSoak starts a soak of two producers with shm regions and restarts
// every restart ("0": none) as its own process, and returns once both
// producers have created their /dev/shm files, with the glob that finds
// them. The test's end kills it and removes what it left.
func shmSoak(t *testing.T, restart string) (cmd *exec.Cmd, out *syncBuf, pat string) {
	t.Helper()
	cmd = exec.Command(os.Args[0], "--regions", "shm", "--duration", "5m", "--producers", "2", "--workers", "2", "--restart", restart)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	var stderr syncBuf
	out = &syncBuf{}
	cmd.Stdout, cmd.Stderr = out, &stderr
	require.NoError(t, cmd.Start())
	pat = fmt.Sprintf("/dev/shm/soak-producer-%d-*.mmap", cmd.Process.Pid)
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		m, _ := filepath.Glob(pat)
		for _, f := range m {
			_ = os.Remove(f)
		}
	})
	require.Eventually(t, func() bool { m, _ := filepath.Glob(pat); return len(m) == 2 },
		60*time.Second, 10*time.Millisecond, "each producer maps a /dev/shm file:\n%s\n%s", out.String(), stderr.String())
	return cmd, out, pat
}

// TestSoakSignalTearsDown stops a soak with SIGTERM: it tears down as at
// the end of a run (its producers' /dev/shm region files are removed),
// says it was interrupted and exits non-zero. The restarter's next
// replacement is a minute away: the soak stops at once all the same (it
// used to wait for the tick).
func TestSoakSignalTearsDown(t *testing.T) {
	cmd, out, pat := shmSoak(t, "1m")
	time.Sleep(300 * time.Millisecond) // let the workers read
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	signaled := time.Now()
	err := cmd.Wait()
	require.Less(t, time.Since(signaled), 45*time.Second, "the soak waited for its restarter's next tick")
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "an interrupted soak is not a pass:\n%s", out.String())
	require.Equal(t, 1, ee.ExitCode())
	require.Contains(t, out.String(), "ecxfer-soak: interrupted by terminated")
	require.NotContains(t, out.String(), "leak after", "the teardown left something behind")
	left, _ := filepath.Glob(pat)
	require.Empty(t, left, "the producers' region files are left behind")
}

// A soak killed outright leaves no region files: its producers see their
// stdin close and remove their own.
func TestSoakKilledLeavesNoFiles(t *testing.T) {
	cmd, _, pat := shmSoak(t, "0")
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	require.Eventually(t, func() bool { m, _ := filepath.Glob(pat); return len(m) == 0 },
		30*time.Second, 10*time.Millisecond, "the producers' region files are left behind")
}

// TestSoakHungRunEnds: a run that does not end hangLimit after its
// duration prints its goroutines and exits 3 on its own, and its
// producers go with it (their region files removed).
func TestSoakHungRunEnds(t *testing.T) {
	cmd := exec.Command(os.Args[0], "--regions", "shm", "--duration", "1s", "--hang-limit", "2s",
		"--producers", "2", "--workers", "2", "--restart", "0")
	cmd.Env = append(os.Environ(), mainEnv+"=1", "ECX_SOAK_HANG_FOR_TEST=1")
	var out syncBuf
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	pat := fmt.Sprintf("/dev/shm/soak-producer-%d-*.mmap", cmd.Process.Pid)
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		m, _ := filepath.Glob(pat)
		for _, f := range m {
			_ = os.Remove(f)
		}
	})
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the hung soak did not end:\n%s", out.String())
	}
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, out.String())
	require.Equal(t, 3, ee.ExitCode(), out.String())
	require.Contains(t, out.String(), "ecxfer-soak: still running 2s after --duration 1s ended: hung")
	require.Contains(t, out.String(), "goroutine ", "its goroutines are printed")
	require.Eventually(t, func() bool { m, _ := filepath.Glob(pat); return len(m) == 0 },
		30*time.Second, 10*time.Millisecond, "the producers' region files are left behind")
}

// Flags the soak cannot honour are refused before it starts (exit 2): a
// notification longer than the transports take (PostRead refused every
// READ and the run passed anyway; above 1,000,000 bytes it panicked), a
// negative one, and arguments that are not flags.
func TestSoakRefusesBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--notif-bytes", "1000001"},
		{"--notif-bytes", "65537"},
		{"--notif-bytes", "-1"},
		{"bogus-arg"},
		{"--hang-limit", "0s"},
	} {
		cmd := exec.Command(os.Args[0], append([]string{"--duration", "1s"}, args...)...)
		cmd.Env = append(os.Environ(), mainEnv+"=1")
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "%v: %s", args, out)
		require.Equal(t, 2, ee.ExitCode(), "%v: %s", args, out)
		require.NotContains(t, string(out), "panic", "%v", args)
	}
}
