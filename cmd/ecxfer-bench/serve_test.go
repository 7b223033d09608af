package main

import (
	"bytes"
	"encoding/json"
	"net"
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

// startServe starts `serve --listen 127.0.0.1:0` with args as its own
// process, killed at the end of the test if still running.
func startServe(t *testing.T, args ...string) (*exec.Cmd, *syncBuf) {
	t.Helper()
	serveErr := &syncBuf{}
	cmd := exec.Command(os.Args[0], append([]string{"serve", "--listen", "127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	cmd.Stderr = serveErr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd, serveErr
}

// TestServeMetrics starts `serve --metrics-addr` as its own process,
// reads from it with `run --connect` over real UCX, and scrapes the
// producer's metrics over HTTP before and after.
func TestServeMetrics(t *testing.T) {
	cmd, serveErr := startServe(t, "--metrics-addr", "127.0.0.1:0")
	maddr := waitFor(t, serveErr, regexp.MustCompile(`metrics on http://(\S+)/metrics`))
	laddr := waitFor(t, serveErr, regexp.MustCompile(`listening on (\S+)`))
	url := "http://" + maddr + "/metrics"

	before := scrapeURL(t, url)
	require.Nil(t, before["ecxfer_reads_done_total"], "no transport before the first run")

	// Fan-in READs carry notifications, which the producer counts.
	var out, errOut syncBuf
	jsonFile := t.TempDir() + "/run.json"
	rc := run([]string{"run", "--connect", laddr, "--workloads", "fanin", "--modes", "reactor",
		"--duration", "200ms", "--warmup", "20ms", "--no-refs", "--quiet", "--json", jsonFile}, &out, &errOut)
	require.Equal(t, 0, rc, "run: %s\n%s\nserve: %s", out.String(), errOut.String(), serveErr.String())

	// The producer is another process on this kernel: its CPU time is
	// the run's own, reported apart and not counted as other processes'.
	var rep struct {
		Machine struct {
			ProducerCPU float64 `json:"producer_cpu_seconds"`
		} `json:"machine"`
	}
	j, err := os.ReadFile(jsonFile)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(j, &rep))
	require.Greater(t, rep.Machine.ProducerCPU, 0.0, "the producer served READs")
	require.Contains(t, out.String(), "the producer at --connect, on this kernel, used")

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

// TestServeHandshake: serve runs one client at a time, so a client that
// connects and sends nothing, one that sends half a frame, and a stray
// connection that closes at once do not hold it (dropped after
// --handshake-wait, or when they close) nor, with --once, end it: the run
// that follows them is served, and serve exits 0 after it. (An idle
// connection used to hold serve for ever: the next run gave up after its
// one-minute wait for "hello".)
func TestServeHandshake(t *testing.T) {
	cmd, serveErr := startServe(t, "--once", "--handshake-wait", "300ms")
	laddr := waitFor(t, serveErr, regexp.MustCompile(`listening on (\S+)`))

	stray, err := net.Dial("tcp", laddr)
	require.NoError(t, err)
	require.NoError(t, stray.Close())
	idle, err := net.Dial("tcp", laddr)
	require.NoError(t, err)
	defer idle.Close()
	half, err := net.Dial("tcp", laddr)
	require.NoError(t, err)
	defer half.Close()
	_, err = half.Write([]byte{0, 0, 1, 0, 0x81}) // a 256-byte frame, 1 byte of it
	require.NoError(t, err)

	var out, errOut syncBuf
	rc := run([]string{"run", "--connect", laddr, "--workloads", "latency", "--modes", "raw",
		"--duration", "100ms", "--warmup", "10ms", "--rounds", "1", "--no-refs", "--quiet"}, &out, &errOut)
	require.Equal(t, 0, rc, "run: %s\n%s\nserve: %s", out.String(), errOut.String(), serveErr.String())
	require.NoError(t, cmd.Wait(), "serve --once: %s", serveErr.String())
	require.Contains(t, serveErr.String(), "i/o timeout", "the idle clients were dropped by the deadline")
}

// A handshakeConn clears its deadline once the first frame is in, however
// the frame arrives in pieces: a client may then stay quiet as long as its
// run needs.
func TestHandshakeConnClearsDeadline(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	hc := newHandshakeConn(a, 200*time.Millisecond)
	frame := []byte{0, 0, 0, 3, 'x', 'y', 'z'}
	go func() {
		for _, c := range frame {
			_, _ = b.Write([]byte{c})
		}
		time.Sleep(400 * time.Millisecond) // longer than the handshake wait
		_, _ = b.Write([]byte("later"))
	}()
	buf := make([]byte, 16)
	got := 0
	for got < len(frame) {
		n, err := hc.Read(buf[:len(frame)-got])
		require.NoError(t, err)
		got += n
	}
	require.True(t, hc.done)
	n, err := hc.Read(buf)
	require.NoError(t, err, "read after the handshake timed out")
	require.Equal(t, "later", string(buf[:n]))

	// Nothing sent: the read times out.
	c, d := net.Pipe()
	defer c.Close()
	defer d.Close()
	_, err = newHandshakeConn(c, 50*time.Millisecond).Read(buf)
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout())
}
