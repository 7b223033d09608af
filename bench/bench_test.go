package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/ctrl"
	"github.com/ecxfer/ecxfer/reactor"
)

// perftestChildEnv makes the test binary run one ucx_perftest reference
// (TestPerftestDiesWithHarness).
const perftestChildEnv = "ECXFER_BENCH_PERFTEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(RoleEnv) == "producer" {
		os.Exit(ProducerMain())
	}
	if os.Getenv(perftestChildEnv) == "1" {
		_, err := perftestRef(context.Background(), SmallBlock, 10)
		fmt.Fprintln(os.Stderr, err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func durs(vs ...int) []time.Duration {
	out := make([]time.Duration, len(vs))
	for i, v := range vs {
		out[i] = time.Duration(v)
	}
	return out
}

func TestPercentile(t *testing.T) {
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = time.Duration(i + 1)
	}
	thousand := make([]time.Duration, 1000)
	for i := range thousand {
		thousand[i] = time.Duration(i + 1)
	}
	for _, c := range []struct {
		name   string
		sorted []time.Duration
		q      float64
		want   time.Duration
	}{
		{"empty", nil, 0.5, 0},
		{"one", durs(7), 0.5, 7},
		{"one p99.9", durs(7), 0.999, 7},
		{"q0 is the minimum", durs(1, 2, 3), 0, 1},
		{"q1 is the maximum", durs(1, 2, 3), 1, 3},
		{"median of odd", durs(1, 2, 3), 0.5, 2},
		{"median of even is the lower", durs(1, 2, 3, 4), 0.5, 2},
		{"p50 of 1..100", hundred, 0.5, 50},
		{"p99 of 1..100", hundred, 0.99, 99},
		{"p99.9 of 1..100", hundred, 0.999, 100},
		{"p99.9 of 1..1000", thousand, 0.999, 999},
		{"p99 of 1..1000", thousand, 0.99, 990},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, percentile(c.sorted, c.q))
		})
	}
}

func TestSummarizeSorts(t *testing.T) {
	var r Result
	summarize(&r, durs(3000, 1000, 2000))
	require.Equal(t, durs(1000, 2000, 3000), r.Latencies)
	require.InDelta(t, 2.0, r.P50us, 1e-9)
	require.InDelta(t, 3.0, r.P99us, 1e-9)
	require.InDelta(t, 3.0, r.P999us, 1e-9)
}

func TestParseRunFlags(t *testing.T) {
	for _, c := range []struct {
		name  string
		args  []string
		err   string
		check func(t *testing.T, c Config)
	}{
		{name: "defaults", args: nil, check: func(t *testing.T, c Config) {
			require.Equal(t, AllWorkloads, c.Workloads)
			require.Equal(t, AllModes, c.Modes)
			require.Equal(t, "ucx", c.Backend)
			require.Equal(t, time.Second, c.Duration)
			require.False(t, c.Reactor.PinCPU)
			require.Equal(t, reactor.IdleHybrid, c.Reactor.Idle)
			require.Equal(t, reactor.IdleHybrid, c.ProducerIdle)
			require.True(t, c.References)
			require.Empty(t, c.Producer)
			require.Equal(t, "reactor", c.producerFor("reactor"))
			require.Equal(t, "poll", c.Wait)
			require.Equal(t, 2, c.Rounds)
		}},
		{name: "rounds", args: []string{"--rounds", "3"}, check: func(t *testing.T, c Config) {
			require.Equal(t, 3, c.Rounds)
		}},
		{name: "no rounds", args: []string{"--rounds", "0"}, err: "--rounds 0 out of range"},
		{name: "too many rounds", args: []string{"--rounds", "101"}, err: "--rounds 101 out of range"},
		{name: "rounds too short", args: []string{"--rounds", "4", "--duration", "3ms"}, err: "less than 1ms per round"},
		{name: "everything", args: []string{"--workloads", "fanin,latency,fanin", "--modes", "raw", "--backend", "loopback",
			"--duration", "2s", "--warmup", "0s", "--reactor-cpu", "0", "--idle", "spin", "--batch", "32",
			"--json", "x.json", "--svg", "x.svg", "--quiet", "--no-refs"}, check: func(t *testing.T, c Config) {
			require.Equal(t, []string{"fanin", "latency"}, c.Workloads)
			require.Equal(t, []string{"raw"}, c.Modes)
			require.Equal(t, "loopback", c.Backend)
			require.Equal(t, 2*time.Second, c.Duration)
			require.Equal(t, time.Duration(0), c.Warmup)
			require.True(t, c.Reactor.PinCPU)
			require.Equal(t, 0, c.Reactor.CPU)
			require.Equal(t, reactor.IdleSpin, c.Reactor.Idle)
			require.Equal(t, 32, c.Reactor.BatchSize)
			require.Equal(t, "x.json", c.JSONFile)
			require.Equal(t, "x.svg", c.SVGFile)
			require.True(t, c.Quiet)
			require.False(t, c.References)
		}},
		{name: "wait spin", args: []string{"--wait", "block", "--wait-spin", "150us"}, check: func(t *testing.T, c Config) {
			require.Equal(t, "block", c.Wait)
			require.Equal(t, 150*time.Microsecond, c.Reactor.WaitSpin)
		}},
		{name: "producer", args: []string{"--producer", "raw"}, check: func(t *testing.T, c Config) {
			require.Equal(t, "raw", c.Producer)
			require.Equal(t, "raw", c.producerFor("reactor"))
			require.Equal(t, "direct", c.producerFor("direct"))
		}},
		{name: "bad producer", args: []string{"--producer", "direct"}, err: `--producer "direct" (want reactor, locked, raw)`},
		{name: "connect", args: []string{"--connect", "10.0.0.2:7000"}, check: func(t *testing.T, c Config) {
			require.Equal(t, "10.0.0.2:7000", c.Connect)
		}},
		{name: "unknown workload", args: []string{"--workloads", "latency,bogus"}, err: `unknown workload "bogus"`},
		{name: "empty workloads", args: []string{"--workloads", ","}, err: "no workload given"},
		{name: "unknown mode", args: []string{"--modes", "fast"}, err: `unknown mode "fast"`},
		{name: "unknown backend", args: []string{"--backend", "rdma"}, err: `unknown backend "rdma"`},
		{name: "zero duration", args: []string{"--duration", "0s"}, err: "--duration 0s must be positive"},
		{name: "negative warmup", args: []string{"--warmup", "-1s"}, err: "--warmup -1s must not be negative"},
		{name: "bad duration", args: []string{"--duration", "soon"}, err: "invalid value"},
		{name: "bad idle", args: []string{"--idle", "nap"}, err: `--idle "nap"`},
		{name: "bad producer idle", args: []string{"--producer-idle", "nap"}, err: `--producer-idle "nap"`},
		{name: "cpu out of range", args: []string{"--reactor-cpu", "4096"}, err: "--reactor-cpu 4096 out of range"},
		{name: "cpu negative", args: []string{"--reactor-cpu", "-2"}, err: "--reactor-cpu -2"},
		{name: "numa negative", args: []string{"--numa-node", "-3"}, err: "--numa-node -3"},
		{name: "numa node missing", args: []string{"--numa-node", "4095", "--modes", "locked"}, err: "--numa-node 4095:"},
		{name: "batch too big", args: []string{"--batch", "100000"}, err: "--batch 100000 out of range"},
		{name: "connect loopback", args: []string{"--backend", "loopback", "--connect", "h:1"}, err: "--connect needs --backend ucx"},
		{name: "connect no port", args: []string{"--connect", "host"}, err: `--connect "host"`},
		{name: "bad wait", args: []string{"--wait", "sleep"}, err: `--wait "sleep"`},
		{name: "negative wait spin", args: []string{"--wait", "block", "--wait-spin", "-1us"}, err: "--wait-spin -1µs out of range"},
		{name: "wait spin too long", args: []string{"--wait", "block", "--wait-spin", "2s"}, err: "--wait-spin 2s out of range"},
		{name: "wait spin while polling", args: []string{"--wait-spin", "100us"}, err: "--wait-spin is for --wait block"},
		{name: "stray argument", args: []string{"latency"}, err: `unexpected argument "latency"`},
		{name: "json in a missing directory", args: []string{"--json", "/nonexistent-dir/x.json"}, err: "--json /nonexistent-dir/x.json"},
		{name: "svg is a directory", args: []string{"--svg", "/tmp"}, err: "--svg /tmp: is a directory"},
		{name: "memprofile under a file", args: []string{"--memprofile", "/etc/hostname/x"}, err: "is not a directory"},
		{name: "negative batch", args: []string{"--batch", "-5"}, err: "--batch -5 out of range 0..65536"},
		{name: "unknown flag", args: []string{"--fast"}, err: "flag provided but not defined"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, err := ParseRunFlags(c.args, io.Discard)
			if c.err != "" {
				require.Error(t, err)
				require.True(t, errors.Is(err, ErrUsage), "%v does not wrap ErrUsage", err)
				require.Contains(t, err.Error(), c.err)
				return
			}
			require.NoError(t, err)
			c.check(t, cfg)
		})
	}
}

// Rounds of one row add up into one row; rows of other cells or modes
// stay apart, in the order they first came.
func TestMergeRounds(t *testing.T) {
	a := Result{Workload: "image", Mode: "reactor", BlockSize: 5120, BlocksPerRead: 880, Submitters: 1,
		Reads: 100, Seconds: 1, ReadsPerSec: 100, GBPerSec: 100 * 880 * 5120 / 1e9, AllocsPerRead: 1}
	summarize(&a, durs(1000, 2000, 3000))
	b := a
	b.Reads, b.Seconds, b.ReadsPerSec, b.GBPerSec, b.AllocsPerRead = 300, 2, 150, 300*880*5120/2/1e9, 3
	summarize(&b, durs(7000, 8000, 9000, 10000))
	other := a
	other.Mode = "locked"
	f1 := Result{Workload: "fanin", Mode: "reactor", BlockSize: 5120, BlocksPerRead: 8, Submitters: 4, Reads: 10, Seconds: 1,
		ReadsPerSec: 10, GBPerSec: 10 * 8 * 5120 / 1e9}
	f2 := f1
	f2.BlocksPerRead, f2.Reads, f2.Seconds, f2.ReadsPerSec, f2.GBPerSec, f2.Early = 10, 30, 1, 30, 30*10*5120/1e9, 2
	got := mergeRounds([]Result{a, other, f1, b, f2})
	require.Len(t, got, 3)
	require.Equal(t, "reactor", got[0].Mode)
	require.Equal(t, "locked", got[1].Mode)
	require.Equal(t, "fanin", got[2].Workload)
	m := got[0]
	require.Equal(t, int64(400), m.Reads)
	require.InDelta(t, 3.0, m.Seconds, 1e-9)
	require.InDelta(t, 400.0/3, m.ReadsPerSec, 1e-9)
	require.InDelta(t, 400*880*5120/3/1e9, m.GBPerSec, 1e-9)
	require.InDelta(t, 880, m.BlocksPerRead, 1e-9)
	require.InDelta(t, (100*1+300*3)/400.0, m.AllocsPerRead, 1e-9)
	require.Len(t, m.Latencies, 7)
	require.InDelta(t, 7.0, m.P50us, 1e-9) // the samples of both rounds, sorted
	f := got[2]
	require.Equal(t, int64(40), f.Reads)
	require.InDelta(t, (10*8+30*10)/40.0, f.BlocksPerRead, 1e-9)
	require.InDelta(t, float64(10*8+30*10)*5120/2/1e9, f.GBPerSec, 1e-9)
	require.Equal(t, int64(2), f.Early)
	require.Equal(t, []float64{100, 150}, m.RoundReadsPerSec)
	require.Equal(t, []float64{10, 30}, f.RoundReadsPerSec)
	require.Equal(t, other, got[1], "a row of one round is kept as it is")
	require.Nil(t, got[1].RoundReadsPerSec)
	// Merged rows merge on: their rounds follow each other.
	c := a
	c.Reads, c.Seconds, c.ReadsPerSec = 50, 1, 50
	again := mergeRounds([]Result{m, c})
	require.Len(t, again, 1)
	require.Equal(t, []float64{100, 150, 50}, again[0].RoundReadsPerSec)
}

func TestRoundsAhead(t *testing.T) {
	r := &Result{RoundReadsPerSec: []float64{3, 1, 5, 7}}
	l := &Result{RoundReadsPerSec: []float64{2, 2, 5, 8}}
	require.Equal(t, "2/4", roundsAhead(r, l), "ahead in round 1, level in round 3")
	require.Equal(t, "3/4", roundsAhead(l, r), "a level round counts for both")
	require.Equal(t, "-", roundsAhead(&Result{RoundReadsPerSec: []float64{3}}, &Result{RoundReadsPerSec: []float64{2}}), "one round")
	require.Equal(t, "-", roundsAhead(r, &Result{RoundReadsPerSec: []float64{1, 1}}), "rounds that do not pair up")
	require.Equal(t, "-", roundsAhead(&Result{}, &Result{}))
}

func sampleReport() *Report {
	rep := &Report{Machine: Machine{CPUModel: "cpu", Cores: 2, GoVersion: "go", UCXVersion: "1.13.1", Kernel: "Linux", Backend: "ucx"}}
	for _, m := range []struct {
		mode   string
		rps    float64
		p99    float64
		rounds []float64
	}{{"reactor", 300000, 10, []float64{350000, 250000, 300000}}, {"locked", 100000, 40, []float64{100000, 300000, 100000}},
		{"raw", 400000, 8, []float64{400000, 400000, 400000}}} {
		r := Result{Workload: "fanin", Mode: m.mode, Backend: "ucx", BlockSize: 5120, BlocksPerRead: 8.5, Submitters: 16,
			Reads: int64(m.rps), Seconds: 1, ReadsPerSec: m.rps, GBPerSec: m.rps * 8.5 * 5120 / 1e9, P50us: 2, P99us: m.p99, P999us: m.p99 * 2}
		summarize(&r, durs(1000, 2000, 3000, 40000))
		r.RoundReadsPerSec = m.rounds
		r.P99us = m.p99
		r.Samples = 100 // enough for a p99 (the image rows' 3 are not)
		rep.Results = append(rep.Results, r)
		img := Result{Workload: "image", Mode: m.mode, Backend: "ucx", BlockSize: 32768, BlocksPerRead: 880, Contiguous: true, Submitters: 1,
			Reads: 100, Seconds: 1, ReadsPerSec: 100, GBPerSec: 2.88, P50us: 9000, P99us: 12000, P999us: 13000}
		summarize(&img, durs(9000000, 9100000, 12000000))
		rep.Results = append(rep.Results, img)
	}
	rep.References = []Reference{{Name: "memcpy", BlockSize: 32768, GBPerSec: 14.4, P50us: 1.5}, {Name: "memcpy", BlockSize: 5120, GBPerSec: 12, P50us: 0.4}}
	rep.Notes = []string{"a note"}
	sortResults(rep.Results)
	return rep
}

func TestWriteTable(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, WriteTable(&buf, sampleReport()))
	out := buf.String()
	lines := strings.Split(out, "\n")
	require.Contains(t, lines[0], "workload")
	require.Contains(t, lines[0], "r/s vs locked")
	require.Contains(t, lines[0], "p99 vs locked")
	require.Contains(t, lines[0], "rounds ≥ locked")
	require.Contains(t, lines[0], "% memcpy")
	// Rows are right-aligned: the table's lines all have the same width.
	w := len([]rune(lines[0]))
	for _, l := range lines[1:7] {
		require.Equal(t, w, len([]rune(l)), "misaligned: %q", l)
	}
	// Image rows come first (workload order), then fanin; modes in order.
	require.Contains(t, lines[1], "image")
	require.Contains(t, lines[1], "reactor")
	require.Contains(t, lines[2], "locked")
	require.Contains(t, lines[4], "fanin")
	// Ratios against locked, and % of memcpy for the same block size.
	require.Contains(t, lines[4], "3.00x")
	require.Contains(t, lines[4], "0.25") // p99 10/40
	require.Contains(t, lines[6], "4.00x")
	// Round by round: the reactor behind locked in the second of three.
	require.Contains(t, lines[4], " 2/3 ")

	// An interrupted run: the reactor's row has a round fewer than
	// locked's, and no ratio is set between them.
	rep := sampleReport()
	for i := range rep.Results {
		if r := &rep.Results[i]; r.Mode == "reactor" && r.Workload == "fanin" {
			r.RoundReadsPerSec = r.RoundReadsPerSec[:2]
		}
	}
	buf.Reset()
	require.NoError(t, WriteTable(&buf, rep))
	lines = strings.Split(buf.String(), "\n")
	require.Contains(t, lines[4], "reactor")
	require.NotContains(t, lines[4], "3.00x")
	require.Contains(t, lines[6], "4.00x", "raw's rounds match locked's")
	require.Contains(t, lines[6], " 3/3 ")
	require.NotContains(t, lines[5], "/3", "locked is not compared with itself")
	require.Contains(t, lines[1], "20%") // 2.88/14.4
	// Three samples make no p99 or p99.9 (nor a p99 ratio); 100 make no
	// p99.9.
	require.Equal(t, 4, strings.Count(lines[1], " - "), "%q", lines[1]) // p99, p99.9, rounds (one), p99 vs locked
	require.NotContains(t, lines[4], " 20 ", "a p99.9 from 100 samples: %q", lines[4])
	require.Contains(t, out, "memcpy")
	require.Contains(t, out, "note: a note")
}

func TestWriteJSONFields(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, WriteJSON(&buf, sampleReport()))
	var doc map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &doc))
	mach := doc["machine"].(map[string]any)
	for _, k := range []string{"cpu_model", "cores", "go_version", "ucx_version", "kernel"} {
		require.Contains(t, mach, k)
	}
	results := doc["results"].([]any)
	require.Len(t, results, 6)
	for _, r := range results {
		m := r.(map[string]any)
		for _, k := range []string{"workload", "mode", "backend", "block_size", "blocks_per_read", "contiguous", "submitters",
			"reads", "seconds", "reads_per_sec", "gb_per_sec", "p50_us", "p99_us", "p999_us", "allocs_per_read"} {
			require.Contains(t, m, k)
		}
		require.NotContains(t, m, "Latencies")
	}
	for _, r := range doc["references"].([]any) {
		m := r.(map[string]any)
		for _, k := range []string{"name", "block_size", "gb_per_sec", "p50_us"} {
			require.Contains(t, m, k)
		}
	}
	// Empty lists are written as [], never null.
	buf.Reset()
	require.NoError(t, WriteJSON(&buf, &Report{}))
	require.Contains(t, buf.String(), `"results": []`)
	require.Contains(t, buf.String(), `"references": []`)
}

func checkXML(t *testing.T, b []byte) {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(b))
	for {
		_, err := dec.Token()
		if err == io.EOF {
			return
		}
		require.NoError(t, err)
	}
}

func TestWriteSVGWellFormed(t *testing.T) {
	var buf bytes.Buffer
	rep := sampleReport()
	rep.Results[0].Workload = "lat<ency>&"
	require.NoError(t, WriteSVG(&buf, rep))
	checkXML(t, buf.Bytes())
	s := buf.String()
	require.Contains(t, s, "<polyline")
	require.Contains(t, s, "log scale")
	require.Contains(t, s, "reads per second")
	require.Contains(t, s, ">reactor")
	// The legend gives a p99 only where the table does: the fan-in rows'
	// 100 samples, not the image rows' 3.
	require.Contains(t, s, "reactor (p99 10.0 µs)")
	require.Contains(t, s, "reactor (3 samples: no p99)")
	require.NotContains(t, s, "p99 12000")
	// No results at all is still a valid picture.
	buf.Reset()
	require.NoError(t, WriteSVG(&buf, &Report{}))
	checkXML(t, buf.Bytes())
}

func TestParsePerftest(t *testing.T) {
	out := `+--------------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
Final:                 20000      0.221     0.296     0.296   105503.28  105503.28     3376105     3376105
`
	ref, err := parsePerftest(out, 32768)
	require.NoError(t, err)
	require.Equal(t, 32768, ref.BlockSize)
	require.Zero(t, ref.P50us, "a pipelined test's per-get time is not a latency")
	require.InDelta(t, 105503.28*(1<<20)/1e9, ref.GBPerSec, 1e-6)
	_, err = parsePerftest("garbage", 5120)
	require.Error(t, err)
}

func TestCells(t *testing.T) {
	cfg := DefaultConfig()
	n := map[string]int{}
	for _, bs := range blockSizes {
		for _, m := range cfg.Modes {
			n[m] += len(cellsFor(&cfg, bs, m))
		}
	}
	// latency×2, image×4, fanin×4 (raw: 1), notif×1.
	require.Equal(t, map[string]int{"reactor": 11, "direct": 11, "locked": 11, "raw": 8}, n)
	cfg.Connect = "h:1"
	for _, c := range cellsFor(&cfg, SmallBlock, "reactor") {
		require.NotEqual(t, "notif", c.workload, "notif needs one host's clock")
	}
	cfg.sharedClock = true
	require.True(t, slices.ContainsFunc(cellsFor(&cfg, SmallBlock, "reactor"), func(c cell) bool { return c.workload == "notif" }),
		"a producer on this machine's clock runs notif across --connect")
}

// A producer served over TCP by a process on this machine's kernel (here
// this process: in make bench-hosts, another network namespace) shares
// its CLOCK_MONOTONIC: the run finds it out and measures notif.
func TestConnectSharedClockRunsNotif(t *testing.T) {
	require.NotEmpty(t, clockID())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		served <- Serve(ctrl.New(c, c), "ucx")
	}()
	cfg := DefaultConfig()
	cfg.Connect = ln.Addr().String()
	cfg.Modes = []string{"reactor"}
	cfg.Workloads = []string{"notif"}
	cfg.Duration = 100 * time.Millisecond
	cfg.Warmup = 10 * time.Millisecond
	cfg.References = false
	cfg.RemoteRegion = 0
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, cfg)
	require.NoError(t, err)
	require.Len(t, rep.Results, 1)
	require.Equal(t, "notif", rep.Results[0].Workload)
	require.Greater(t, rep.Results[0].Reads, int64(0))
	require.True(t, slices.ContainsFunc(rep.Notes, func(n string) bool { return strings.Contains(n, "same boot id") }))
	// The producer runs in this process: its CPU is this process's
	// already, and is not taken out twice.
	require.Zero(t, rep.Machine.ProducerCPU)
	require.NoError(t, <-served)
}

// A producer at --connect on this kernel, in another process, tells its
// CPU time in its hellos and byes; the run counts it as its own from the
// first hello to the last bye, and nothing else: not a producer on
// another kernel, not one of an older build that says nothing, not a
// bye from another process.
func TestNotePeerCPU(t *testing.T) {
	other := int64(os.Getpid()) + 1
	msg := func(clock string, pid, cpu int64) ctrl.Message {
		return ctrl.Message{Strs: map[string]string{"clock": clock}, Ints: map[string]int64{"pid": pid, "cpu_ns": cpu}}
	}
	run := func(connect string, ms ...ctrl.Message) float64 {
		s := newSession(Config{Connect: connect})
		for i, m := range ms {
			s.notePeerCPU(m, i%2 == 0)
		}
		return float64(s.peer.cpu1-s.peer.cpu0) / 1e9
	}
	me := clockID()
	require.NotEmpty(t, me)
	require.InDelta(t, 2.5, run("h:1", msg(me, other, 1e9), msg("", other, 2e9), msg(me, other, 2.2e9), msg("", other, 3.5e9)), 1e-9)
	require.Zero(t, run("h:1", msg("another-kernel", other, 1e9), msg("", other, 2e9)), "another kernel's CPU is not this machine's")
	require.Zero(t, run("h:1", ctrl.Message{}, ctrl.Message{}), "an older producer says nothing")
	require.Zero(t, run("h:1", msg(me, int64(os.Getpid()), 1e9), msg("", int64(os.Getpid()), 2e9)), "a producer in this process")
	require.InDelta(t, 1.0, run("h:1", msg(me, other, 1e9), msg("", other, 2e9), msg(me, other, 2e9), msg("", other+1, 9e9)), 1e-9,
		"a bye from another process is not the producer's")
	require.Zero(t, run("", msg(me, other, 1e9), msg("", other, 2e9)), "a forked producer counts as a child")
}

func runShort(t *testing.T, backend string, workloads ...string) *Report {
	t.Helper()
	return runShortModes(t, backend, AllModes, workloads...)
}

func runShortModes(t *testing.T, backend string, modes []string, workloads ...string) *Report {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Modes = modes
	cfg.Backend = backend
	cfg.Workloads = workloads
	cfg.Duration = 50 * time.Millisecond
	cfg.Warmup = 10 * time.Millisecond
	cfg.References = false
	cfg.RemoteRegion = 0 // the smallest region: filling it is slow under -race
	dir := t.TempDir()
	cfg.JSONFile = dir + "/r.json"
	cfg.SVGFile = dir + "/r.svg"
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, cfg)
	require.NoError(t, err)
	for _, r := range rep.Results {
		require.Greater(t, r.Reads, int64(0), "%s %s: no reads", r.Workload, r.Mode)
		require.Greater(t, r.ReadsPerSec, 0.0)
		require.Greater(t, r.P50us, 0.0)
	}
	j, err := os.ReadFile(cfg.JSONFile)
	require.NoError(t, err)
	require.True(t, json.Valid(j))
	svg, err := os.ReadFile(cfg.SVGFile)
	require.NoError(t, err)
	checkXML(t, svg)
	return rep
}

func modesOf(rep *Report) map[string]int {
	m := map[string]int{}
	for _, r := range rep.Results {
		m[r.Mode]++
	}
	return m
}

// A run interrupted in its last cell or in its references (ecxfer-bench
// turns SIGINT and SIGTERM into a canceled context) fails: it used to
// report a full table and exit 0.
// An interrupt in the middle of a long cell ends the run at once, as
// interrupted: the cell's submitters stop (they used to run out the
// cell's whole duration, up to an hour).
func TestRunInterruptedMidCell(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Modes = []string{"raw"}
	cfg.Backend = "loopback"
	cfg.Workloads = []string{"latency"}
	cfg.Rounds = 1
	cfg.Duration = time.Minute
	cfg.Warmup = 10 * time.Millisecond
	cfg.References = false
	cfg.RemoteRegion = 0
	cfg.JSONFile, cfg.SVGFile = "", ""
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(500*time.Millisecond, cancel)
	t0 := time.Now()
	_, err := Run(ctx, cfg)
	require.ErrorIs(t, err, context.Canceled)
	require.Contains(t, err.Error(), "bench: interrupted")
	require.Less(t, time.Since(t0), 30*time.Second, "the run went on after the interrupt")
}

func TestRunInterrupted(t *testing.T) {
	for _, refs := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Modes = []string{"raw"}
		cfg.Backend = "loopback"
		cfg.Workloads = []string{"latency"}
		cfg.Rounds = 1
		cfg.Duration = 2 * time.Second
		cfg.Warmup = 10 * time.Millisecond
		cfg.References = refs
		cfg.RemoteRegion = 0
		cfg.JSONFile, cfg.SVGFile = "", ""
		if refs {
			cfg.Duration = 100 * time.Millisecond
		}
		ctx, cancel := context.WithCancel(context.Background())
		// Into the second (last) cell, or past both cells (about 0.4 s
		// here) into the references (about a second). Wherever it lands,
		// the run must fail; it must only land before the run ends.
		at := 3 * time.Second
		if refs {
			at = 700 * time.Millisecond
		}
		time.AfterFunc(at, cancel)
		_, err := Run(ctx, cfg)
		cancel()
		require.ErrorIs(t, err, context.Canceled, "references %v", refs)
	}
}

// A producer whose consumer goes away between setup and teardown (killed
// in the middle of a run) reports it: ecxfer-bench serve --once used to
// say "done" and exit 0.
func TestServeConsumerGoneMidRun(t *testing.T) {
	setup := ctrl.Message{Kind: "setup", Strs: map[string]string{"mode": "raw"},
		Ints: map[string]int64{"block": SmallBlock, "blocks": 64, "seed": 1}}
	cons, stop := inProcessProducer()
	require.NoError(t, cons.Send(setup))
	_, err := cons.Expect("hello")
	require.NoError(t, err)
	err = stop() // gone, no teardown
	require.Error(t, err)
	require.Contains(t, err.Error(), "went away")

	// A consumer that tears down before it leaves ends the serve cleanly.
	cons, stop = inProcessProducer()
	require.NoError(t, cons.Send(setup))
	_, err = cons.Expect("hello")
	require.NoError(t, err)
	require.NoError(t, cons.Send(ctrl.Message{Kind: "teardown"}))
	_, err = cons.Expect("bye")
	require.NoError(t, err)
	require.NoError(t, stop())
}

// A setup whose region sizes no mode can have (more blocks than any
// transport takes; a block size times count that wraps to a small
// product) gets an error reply, and the producer serves the next setup:
// the raw and locked modes used to build a list of that many block
// descriptors first (48 GiB for 2^31 blocks: out of memory, the process
// died).
func TestServeRefusesImpossibleRegions(t *testing.T) {
	cons, stop := inProcessProducer()
	for _, mode := range []string{"raw", "locked", "reactor"} {
		for _, sz := range [][2]int64{{1, 1 << 31}, {3074456367797372246, 2147483651}, {1 << 40, 1}, {SmallBlock, -1}} {
			require.NoError(t, cons.Send(ctrl.Message{Kind: "setup", Strs: map[string]string{"mode": mode},
				Ints: map[string]int64{"block": sz[0], "blocks": sz[1], "seed": 1}}))
			m, err := cons.Recv()
			require.NoError(t, err)
			require.Equal(t, "error", m.Kind, "%s %v", mode, sz)
			require.Contains(t, m.Strs["error"], "bad region", "%s %v", mode, sz)
		}
	}
	require.NoError(t, cons.Send(ctrl.Message{Kind: "setup", Strs: map[string]string{"mode": "raw"},
		Ints: map[string]int64{"block": SmallBlock, "blocks": 64, "seed": 1}}))
	_, err := cons.Expect("hello")
	require.NoError(t, err)
	require.NoError(t, cons.Send(ctrl.Message{Kind: "teardown"}))
	_, err = cons.Expect("bye")
	require.NoError(t, err)
	require.NoError(t, stop())
}

// The producer a setup asks for is the one the serve opens and names in
// its hello; a kind it does not have, or one for direct READs, gets an
// error reply, and the serve goes on.
func TestServeOpensTheProducerAskedFor(t *testing.T) {
	cons, stop := inProcessProducer()
	setup := func(mode, kind string) ctrl.Message {
		strs := map[string]string{"mode": mode}
		if kind != "" {
			strs["producer"] = kind
		}
		require.NoError(t, cons.Send(ctrl.Message{Kind: "setup", Strs: strs,
			Ints: map[string]int64{"block": SmallBlock, "blocks": 64, "seed": 1}}))
		m, err := cons.Recv()
		require.NoError(t, err)
		return m
	}
	for _, c := range [][3]string{{"reactor", "", "reactor"}, {"reactor", "raw", "raw"}, {"raw", "reactor", "reactor"},
		{"locked", "raw", "raw"}, {"raw", "locked", "locked"}} {
		m := setup(c[0], c[1])
		require.Equal(t, "hello", m.Kind, "%v: %v", c, m.Strs)
		require.Equal(t, c[2], m.Name, "%v", c)
		require.NotEmpty(t, m.Metadata)
		require.NoError(t, cons.Send(ctrl.Message{Kind: "teardown"}))
		_, err := cons.Expect("bye")
		require.NoError(t, err)
	}
	for _, c := range [][2]string{{"reactor", "direct"}, {"reactor", "fast"}, {"direct", "raw"}} {
		m := setup(c[0], c[1])
		require.Equal(t, "error", m.Kind, "%v", c)
		require.Contains(t, m.Strs["error"], "want one of reactor, locked, raw", "%v", c)
	}
	require.NoError(t, stop())
}

// With --producer every reactor, locked and raw row reads from that
// producer, and the report says so.
func TestRunWithOneProducer(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Modes = []string{"reactor", "locked", "raw"}
	cfg.Backend = "loopback"
	cfg.Workloads = []string{"latency"}
	cfg.Duration = 50 * time.Millisecond
	cfg.Warmup = 10 * time.Millisecond
	cfg.References = false
	cfg.RemoteRegion = 0
	cfg.Producer = "raw"
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"reactor": 2, "locked": 2, "raw": 2}, modesOf(rep))
	for _, r := range rep.Results {
		require.Greater(t, r.Reads, int64(0), "%s %s: no reads", r.Workload, r.Mode)
	}
	require.Contains(t, rep.Notes, "producer: every reactor, locked and raw row read from a raw producer (--producer); direct rows from their own")
}

func TestRunLoopback(t *testing.T) {
	rep := runShort(t, "loopback", "latency", "notif")
	// latency at two block sizes, notif at one, for four modes.
	require.Equal(t, map[string]int{"reactor": 3, "direct": 3, "locked": 3, "raw": 3}, modesOf(rep))
}

func TestRunUCX(t *testing.T) {
	rep := runShort(t, "ucx", "latency")
	require.Equal(t, map[string]int{"reactor": 2, "direct": 2, "locked": 2, "raw": 2}, modesOf(rep))
}

// % memcpy compares a row with the faster memcpy reference of its block
// size and block pattern, one thread or the copy workers' count.
func TestMemcpyRefChoice(t *testing.T) {
	rep := &Report{References: []Reference{
		{Name: "memcpy", BlockSize: 5120, GBPerSec: 10},
		{Name: "memcpy per block", BlockSize: 5120, GBPerSec: 8},
		{Name: "memcpy 2T", BlockSize: 5120, GBPerSec: 14},
		{Name: "memcpy per block 2T", BlockSize: 5120, GBPerSec: 7},
		{Name: "memcpy", BlockSize: 32768, GBPerSec: 20},
		{Name: "ucx_perftest ucp_get", BlockSize: 5120, GBPerSec: 60},
	}}
	contig := &Result{Workload: "image", BlockSize: 5120, BlocksPerRead: 880, Contiguous: true}
	scatter := &Result{Workload: "image", BlockSize: 5120, BlocksPerRead: 880}
	fanin := &Result{Workload: "fanin", BlockSize: 5120}
	one := &Result{Workload: "latency", BlockSize: 32768, BlocksPerRead: 1}
	require.Equal(t, "memcpy 2T", rep.memcpyRef(contig).Name)
	require.Equal(t, "memcpy per block", rep.memcpyRef(scatter).Name)
	require.Equal(t, "memcpy per block", rep.memcpyRef(fanin).Name)
	require.Equal(t, 20.0, rep.memcpyRef(one).GBPerSec)
	require.Nil(t, rep.memcpyRef(&Result{Workload: "image", BlockSize: 4096}))
}

func TestMemcpyRefsThreads(t *testing.T) {
	refs, err := memcpyRefs(SmallBlock, 20*time.Millisecond, 2)
	require.NoError(t, err)
	names := map[string]bool{}
	for _, r := range refs {
		names[r.Name] = true
		require.Greater(t, r.GBPerSec, 0.0, r.Name)
	}
	require.Equal(t, map[string]bool{"memcpy": true, "memcpy per block": true, "memcpy 2T": true, "memcpy per block 2T": true}, names)
}

// The direct mode's image cells: 880-block READs copied by the copy
// workers out of the producer child's mapped region, bytes verified.
func TestRunUCXDirectImage(t *testing.T) {
	rep := runShortModes(t, "ucx", []string{"direct"}, "image")
	require.Equal(t, map[string]int{"direct": 4}, modesOf(rep))
}

// The report says how the reactor's callers waited.
func TestNotesSayHowCallersWait(t *testing.T) {
	for wait, want := range map[string]string{
		"poll":  "callers poll the READ's state",
		"block": "reactor and direct callers block in Transport.Wait;",
		"spin":  "reactor and direct callers block in Transport.Wait (checking for 150µs before they sleep);",
	} {
		cfg := DefaultConfig()
		cfg.Wait = wait
		if wait == "spin" {
			cfg.Wait, cfg.Reactor.WaitSpin = "block", 150*time.Microsecond
		}
		s := newSession(cfg)
		s.addNotes()
		require.True(t, slices.ContainsFunc(s.rep.Notes, func(n string) bool { return strings.HasPrefix(n, want) }),
			"wait %s: notes %q", wait, s.rep.Notes)
	}
}

// The report says which modes count the notification's send in a READ's
// time, and how notif READs are phased against the locked producer's step.
func TestNotesSayWhatDONEIncludes(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Workloads = []string{"latency"}
	s := newSession(cfg)
	s.addNotes()
	has := func(s *session, prefix string) bool {
		return slices.ContainsFunc(s.rep.Notes, func(n string) bool { return strings.HasPrefix(n, prefix) })
	}
	require.False(t, has(s, "DONE:"), "latency READs carry no notification")
	cfg.Workloads = []string{"image", "notif"}
	s = newSession(cfg)
	s.rep.Results = []Result{{Workload: "notif", Mode: "raw", Reads: 10, Early: 3}, {Workload: "notif", Mode: "reactor", Reads: 10}}
	s.addNotes()
	require.True(t, has(s, "DONE: reactor and direct READs are DONE once their data has landed"))
	require.True(t, has(s, "notif: each READ is posted at a random point"))
	require.True(t, has(s, "notif: seen by the producer before the reader saw DONE: raw 3 of 10"), "%q", s.rep.Notes)
	// Not measured across hosts: no notif notes then but the one saying so.
	cfg.Connect = "192.0.2.1:7100"
	s = newSession(cfg)
	s.addNotes()
	require.False(t, has(s, "notif: each READ"), "%q", s.rep.Notes)
	require.True(t, has(s, "notif skipped"), "%q", s.rep.Notes)
}

// FuzzParsePerftest: ucx_perftest's output, whatever its shape, gives a
// reference for the asked block size or an error, never a panic.
func FuzzParsePerftest(f *testing.F) {
	f.Add("Final:                 20000      0.221     0.296     0.296   105503.28  105503.28     3376105     3376105\n")
	f.Add("garbage")
	f.Add("Final: 1 2 3 4 5 NaN 7 8\n")
	f.Fuzz(func(t *testing.T, out string) {
		ref, err := parsePerftest(out, 5120)
		if err == nil && (ref.BlockSize != 5120 || ref.P50us != 0 || !strings.Contains(out, "Final:")) {
			t.Fatalf("%+v from %q", ref, out)
		}
	})
}

// A harness killed during the ucx_perftest reference (SIGKILL: no chance
// to clean up) takes the perftest processes it started with it: a fake
// ucx_perftest that records its pid and sleeps is gone once the harness
// is. (The server used to stay, listening on every interface.)
func TestPerftestDiesWithHarness(t *testing.T) {
	dir := t.TempDir()
	pids := filepath.Join(dir, "pids")
	fake := "#!/bin/sh\necho $$ >> " + pids + "\nexec sleep 60\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ucx_perftest"), []byte(fake), 0o755))
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), perftestChildEnv+"=1", "PATH="+dir+":"+os.Getenv("PATH"))
	require.NoError(t, cmd.Start())
	var started []int
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(pids)
		started = started[:0]
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			require.NoError(t, err)
			started = append(started, pid)
		}
		return len(started) >= 2 // the server and a client
	}, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	for _, pid := range started {
		require.Eventually(t, func() bool { return !alive(pid) }, 10*time.Second, 10*time.Millisecond,
			"ucx_perftest (pid %d) outlived the harness", pid)
	}
}

// alive reports whether pid names a process that has not exited (a zombie
// waiting for a parent to reap it has).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}
