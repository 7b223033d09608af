package main

import (
	"bytes"
	"os"
	"os/exec"
	"regexp"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/scrape"
)

// mainEnv makes the test binary run the command instead of the tests.
const mainEnv = "ECXFER_BENCH_TEST_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) == "1" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// syncBuf collects a process's stderr while the test reads it.
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

func waitFor(t *testing.T, buf *syncBuf, re *regexp.Regexp) string {
	t.Helper()
	var m []string
	require.Eventually(t, func() bool { m = re.FindStringSubmatch(buf.String()); return m != nil },
		30*time.Second, 5*time.Millisecond, "want %s in:\n%s", re, buf)
	return m[1]
}

func scrapeURL(t *testing.T, url string) map[string]*scrape.Family {
	t.Helper()
	fams, err := scrape.Get(url)
	require.NoError(t, err)
	return fams
}

func only(t *testing.T, f *scrape.Family, name string) float64 {
	t.Helper()
	require.NotNil(t, f, "%s missing", name)
	n, v := 0, 0.0
	for _, s := range f.Samples {
		if s.Name == name {
			n++
			v = s.Value
		}
	}
	require.Equal(t, 1, n, "samples of %s", name)
	return v
}

// TestServeMetrics starts `serve --metrics-addr` as its own process,
// reads from it with `run --connect` over real UCX, and scrapes the
// producer's metrics over HTTP before and after.
func TestServeMetrics(t *testing.T) {
	var serveErr syncBuf
	cmd := exec.Command(os.Args[0], "serve", "--listen", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	cmd.Stderr = &serveErr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	maddr := waitFor(t, &serveErr, regexp.MustCompile(`metrics on http://(\S+)/metrics`))
	laddr := waitFor(t, &serveErr, regexp.MustCompile(`listening on (\S+)`))
	url := "http://" + maddr + "/metrics"

	before := scrapeURL(t, url)
	require.Nil(t, before["ecxfer_reads_done_total"], "no transport before the first run")

	// Fan-in READs carry notifications, which the producer counts.
	var out, errOut syncBuf
	rc := run([]string{"run", "--connect", laddr, "--workloads", "fanin", "--modes", "reactor",
		"--duration", "200ms", "--warmup", "20ms", "--no-refs", "--quiet"}, &out, &errOut)
	require.Equal(t, 0, rc, "run: %s\n%s\nserve: %s", out.String(), errOut.String(), serveErr.String())

	after := scrapeURL(t, url)
	for name, typ := range map[string]string{
		"ecxfer_reads_done_total":             "counter",
		"ecxfer_read_bytes_total":             "counter",
		"ecxfer_reads_in_flight":              "gauge",
		"ecxfer_notifications_received_total": "counter",
		"ecxfer_reactor_loop_turns_total":     "counter",
		"ecxfer_reactor_cpu_seconds_total":    "counter",
		"ecxfer_read_duration_seconds":        "histogram",
		"ecxfer_peers":                        "gauge",
	} {
		require.NotNil(t, after[name], "%s missing", name)
		require.Equal(t, typ, after[name].Type, name)
	}
	// The last cell's producer: it served READs, so it received their
	// notifications, and its loop turned.
	require.Greater(t, only(t, after["ecxfer_notifications_received_total"], "ecxfer_notifications_received_total"), 0.0)
	require.Greater(t, only(t, after["ecxfer_reactor_loop_turns_total"], "ecxfer_reactor_loop_turns_total"), 0.0)
	require.Greater(t, only(t, after["ecxfer_reactor_cpu_seconds_total"], "ecxfer_reactor_cpu_seconds_total"), 0.0)
	require.Zero(t, only(t, after["ecxfer_reads_done_total"], "ecxfer_reads_done_total"), "a producer reads nothing")

	// SIGTERM ends serve cleanly: it closes its listener and exporter and
	// exits 0.
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "serve: %s", serveErr.String())
	require.Contains(t, serveErr.String(), "ecxfer-bench serve: interrupted")
}
