package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Result is one workload×mode cell.
type Result struct {
	Workload      string  `json:"workload"`
	Mode          string  `json:"mode"`
	Backend       string  `json:"backend"`
	BlockSize     int     `json:"block_size"`
	BlocksPerRead float64 `json:"blocks_per_read"` // mean for fanin
	Contiguous    bool    `json:"contiguous"`
	Submitters    int     `json:"submitters"`
	Reads         int64   `json:"reads"`
	Seconds       float64 `json:"seconds"`
	ReadsPerSec   float64 `json:"reads_per_sec"`
	GBPerSec      float64 `json:"gb_per_sec"`
	P50us         float64 `json:"p50_us"`
	P99us         float64 `json:"p99_us"`
	P999us        float64 `json:"p999_us"`
	AllocsPerRead float64 `json:"allocs_per_read"`
	// Early counts notif READs whose notification the producer saw before
	// the reader saw DONE.
	Early int64 `json:"early,omitempty"`
	// RoundReadsPerSec is each round's reads/s, in round order, for a row
	// measured in more than one round (nil for one).
	RoundReadsPerSec []float64 `json:"round_reads_per_sec,omitempty"`

	// Samples is how many latencies the percentiles come from.
	Samples int `json:"samples"`
	// Latencies are the sorted samples behind the percentiles, for the
	// CDF charts. Not written to JSON.
	Latencies []time.Duration `json:"-"`
}

// Key names the cell without its mode: rows with the same key compare.
func (r *Result) Key() string {
	bpr := r.BlocksPerRead
	if r.Workload == "fanin" {
		bpr = 0 // random sizes: the measured mean differs a little per mode
	}
	return fmt.Sprintf("%s/%d/%g/%v/%d", r.Workload, r.BlockSize, bpr, r.Contiguous, r.Submitters)
}

// Layout is "contig", "scatter" or "-" for one-block reads.
func (r *Result) Layout() string {
	switch {
	case r.Workload == "fanin":
		return "random"
	case r.BlocksPerRead <= 1:
		return "-"
	case r.Contiguous:
		return "contig"
	}
	return "scatter"
}

// Reference is a physical or third-party yardstick.
type Reference struct {
	Name      string  `json:"name"`
	BlockSize int     `json:"block_size"`
	GBPerSec  float64 `json:"gb_per_sec"`
	P50us     float64 `json:"p50_us"`
	Note      string  `json:"note,omitempty"`
}

// Machine describes where the numbers were measured.
type Machine struct {
	CPUModel   string  `json:"cpu_model"`
	Cores      int     `json:"cores"`
	GoVersion  string  `json:"go_version"`
	UCXVersion string  `json:"ucx_version"`
	Kernel     string  `json:"kernel"`
	Hostname   string  `json:"hostname"`
	Backend    string  `json:"backend"`
	Idle       string  `json:"idle"`
	ReactorCPU int     `json:"reactor_cpu"` // -1: not pinned
	Duration   string  `json:"duration"`
	Warmup     string  `json:"warmup"`
	Rounds     int     `json:"rounds"`
	Started    string  `json:"started"`
	WallSecs   float64 `json:"wall_seconds"`
	// OtherCPU is the CPU time other processes used during the run, in
	// core-seconds: when it is large, the numbers were disturbed.
	OtherCPU float64 `json:"other_cpu_seconds"`
	// ProducerCPU is the CPU time of the producer at --connect between its
	// first and last cell, when it runs on this machine's kernel in
	// another process (make bench-hosts), in core-seconds: the run's own,
	// not counted in OtherCPU. 0 otherwise (a forked producer is counted
	// with this process's children).
	ProducerCPU float64 `json:"producer_cpu_seconds"`
}

// Report is a whole run.
type Report struct {
	Machine    Machine     `json:"machine"`
	Results    []Result    `json:"results"`
	References []Reference `json:"references"`
	Notes      []string    `json:"notes"`
}

// mergeRounds merges the rows of one cell and mode from different rounds
// into one, in the order each row first appears: reads, blocks, seconds,
// early notifications and samples add up, allocations are per READ over
// all of them.
func mergeRounds(rs []Result) []Result {
	var out []Result
	at := map[string]int{}
	for _, r := range rs {
		k := r.Mode + "|" + r.Key()
		i, ok := at[k]
		if !ok {
			at[k] = len(out)
			out = append(out, r)
			continue
		}
		m := &out[i]
		if len(m.RoundReadsPerSec) == 0 {
			m.RoundReadsPerSec = []float64{m.ReadsPerSec}
		}
		if len(r.RoundReadsPerSec) > 0 {
			m.RoundReadsPerSec = append(m.RoundReadsPerSec, r.RoundReadsPerSec...)
		} else {
			m.RoundReadsPerSec = append(m.RoundReadsPerSec, r.ReadsPerSec)
		}
		blocks := m.BlocksPerRead*float64(m.Reads) + r.BlocksPerRead*float64(r.Reads)
		bytes := m.GBPerSec*m.Seconds + r.GBPerSec*r.Seconds
		allocs := m.AllocsPerRead*float64(m.Reads) + r.AllocsPerRead*float64(r.Reads)
		m.Reads += r.Reads
		m.Seconds += r.Seconds
		m.Early += r.Early
		m.ReadsPerSec = float64(m.Reads) / m.Seconds
		m.GBPerSec = bytes / m.Seconds
		m.BlocksPerRead = blocks / float64(m.Reads)
		m.AllocsPerRead = allocs / float64(m.Reads)
		summarize(m, append(m.Latencies, r.Latencies...))
	}
	return out
}

// percentile returns the q-quantile (0..1) of sorted samples by the
// nearest-rank method: the smallest sample with at least q of all samples
// at or below it. Zero for no samples.
func percentile(sorted []time.Duration, q float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(q * float64(n)))
	if rank < 1 {
		rank = 1
	}
	if rank > n {
		rank = n
	}
	return sorted[rank-1]
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// hasQuantile reports whether r has enough samples for its q quantile to
// be more than its largest one: at least 1/(1-q) (100 for p99, 1,000 for
// p99.9). Fewer are shown as "-".
func hasQuantile(r *Result, q float64) bool {
	return float64(r.Samples) >= 1/(1-q)-1e-9
}

// summarize sorts lat and fills the latency fields of r.
func summarize(r *Result, lat []time.Duration) {
	slices.Sort(lat)
	r.Latencies = lat
	r.Samples = len(lat)
	r.P50us = us(percentile(lat, 0.50))
	r.P99us = us(percentile(lat, 0.99))
	r.P999us = us(percentile(lat, 0.999))
}

// memcpyRef returns the memcpy reference a result is compared with: of the
// references of its block size and block pattern (one copy per run for
// contiguous and one-block READs, block by block for scattered and random
// ones), with one thread or with the copy workers' count, the faster; nil
// when there is none.
func (rep *Report) memcpyRef(r *Result) *Reference {
	perBlock := r.Layout() == "scatter" || r.Layout() == "random"
	var best *Reference
	for i := range rep.References {
		ref := &rep.References[i]
		if ref.BlockSize != r.BlockSize || !strings.HasPrefix(ref.Name, "memcpy") ||
			strings.Contains(ref.Name, "per block") != perBlock {
			continue
		}
		if best == nil || ref.GBPerSec > best.GBPerSec {
			best = ref
		}
	}
	return best
}

// locked returns the locked-mode row comparable with r, or nil.
func (rep *Report) locked(r *Result) *Result {
	for i := range rep.Results {
		o := &rep.Results[i]
		if o.Mode == "locked" && o.Key() == r.Key() {
			return o
		}
	}
	return nil
}

func fnum(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func fcount(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e4:
		return fmt.Sprintf("%.1fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

// roundsAhead is how many of r's rounds had reads/s at least l's in the
// same round, as "k/n"; "-" for a row of one round or rounds that do not
// pair up. Within a round the modes run one after the other, so a pair
// meets the same state of the machine, which on a noisy one moves more
// between rounds than between modes: the count says whether a ratio of
// the whole run holds round by round or comes from a few rounds.
func roundsAhead(r, l *Result) string {
	n := len(r.RoundReadsPerSec)
	if n < 2 || n != len(l.RoundReadsPerSec) {
		return "-"
	}
	k := 0
	for i, v := range r.RoundReadsPerSec {
		if v >= l.RoundReadsPerSec[i] {
			k++
		}
	}
	return fmt.Sprintf("%d/%d", k, n)
}

// WriteTable prints the results as an aligned table with the ratio columns,
// then the references and the notes.
func WriteTable(w io.Writer, rep *Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workload\tmode\tblock B\tblk/read\tlayout\tsubm\treads/s\tGB/s\tp50 µs\tp99 µs\tp99.9 µs\tr/s vs locked\trounds ≥ locked\tp99 vs locked\t% memcpy\tallocs/read\t")
	for i := range rep.Results {
		r := &rep.Results[i]
		// A notif READ includes a random wait and a control round trip:
		// its rate is not throughput, so neither it nor its ratio is shown.
		notif := r.Workload == "notif"
		ratio, ahead, p99ratio := "-", "-", "-"
		// Rows of an interrupted run may merge different numbers of
		// rounds: those are not set against each other.
		if l := rep.locked(r); l != nil && r.Mode != "locked" && len(l.RoundReadsPerSec) == len(r.RoundReadsPerSec) {
			if l.ReadsPerSec > 0 && !notif {
				ratio = fmt.Sprintf("%.2fx", r.ReadsPerSec/l.ReadsPerSec)
				ahead = roundsAhead(r, l)
			}
			if l.P99us > 0 && hasQuantile(r, 0.99) && hasQuantile(l, 0.99) {
				p99ratio = fmt.Sprintf("%.2f", r.P99us/l.P99us)
			}
		}
		rps, gbps := fcount(r.ReadsPerSec), fnum(r.GBPerSec)
		if notif {
			rps, gbps = "-", "-"
		}
		p99, p999 := "-", "-"
		if hasQuantile(r, 0.99) {
			p99 = fnum(r.P99us)
		}
		if hasQuantile(r, 0.999) {
			p999 = fnum(r.P999us)
		}
		pct := "-"
		if m := rep.memcpyRef(r); m != nil && m.GBPerSec > 0 && r.Workload != "notif" {
			pct = fmt.Sprintf("%.0f%%", 100*r.GBPerSec/m.GBPerSec)
		}
		bpr := fmt.Sprintf("%g", r.BlocksPerRead)
		if r.Workload == "fanin" {
			bpr = fmt.Sprintf("1-%d", FaninMaxBlocks)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.2f\t\n",
			r.Workload, r.Mode, r.BlockSize, bpr, r.Layout(), r.Submitters,
			rps, gbps, fnum(r.P50us), p99, p999,
			ratio, ahead, p99ratio, pct, r.AllocsPerRead)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(rep.References) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "reference\tblock B\tGB/s\tp50 µs\tnote\t")
		for _, ref := range rep.References {
			p50 := "-" // none: a pipelined test's
			if ref.P50us > 0 {
				p50 = fnum(ref.P50us)
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t\n", ref.Name, ref.BlockSize, fnum(ref.GBPerSec), p50, ref.Note)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	return nil
}

// WriteJSON writes the report as indented JSON.
func WriteJSON(w io.Writer, rep *Report) error {
	out := *rep
	if out.Results == nil {
		out.Results = []Result{}
	}
	if out.References == nil {
		out.References = []Reference{}
	}
	if out.Notes == nil {
		out.Notes = []string{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(&out)
}

// writeFile creates path and writes it with fn.
func writeFile(path string, fn func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := fn(f); err != nil {
		f.Close()
		return fmt.Errorf("%s: %w", path, err)
	}
	return f.Close()
}

// shortLabel names a result for charts.
func shortLabel(r *Result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %dB", r.Workload, r.BlockSize)
	switch r.Workload {
	case "image":
		fmt.Fprintf(&b, " %s", r.Layout())
	case "fanin":
		fmt.Fprintf(&b, " %dg", r.Submitters)
	}
	return b.String()
}
