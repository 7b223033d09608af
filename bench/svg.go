package bench

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
)

// Chart geometry, in SVG user units.
const (
	chartW   = 860
	chartH   = 320
	marginL  = 70
	marginR  = 250
	marginT  = 36
	marginB  = 48
	plotW    = chartW - marginL - marginR
	plotH    = chartH - marginT - marginB
	cdfSteps = 200
)

var modeColors = map[string]string{"reactor": "#1f77b4", "direct": "#9467bd", "locked": "#d62728", "raw": "#2ca02c"}

func modeColor(m string) string {
	if c, ok := modeColors[m]; ok {
		return c
	}
	return "#7f7f7f"
}

// WriteSVG draws, one under the other, a latency CDF per latency-type cell
// (one line per mode, log-scaled x) and a throughput bar chart per
// workload (one bar per mode and configuration). Standard library only.
func WriteSVG(w io.Writer, rep *Report) error {
	type group struct {
		title string
		rows  []*Result
	}
	var cdfs []group
	seen := map[string]int{}
	for i := range rep.Results {
		r := &rep.Results[i]
		if len(r.Latencies) == 0 || (r.Workload == "fanin" && r.Submitters != 16 && r.Submitters != 1) {
			continue
		}
		k := r.Key()
		if j, ok := seen[k]; ok {
			cdfs[j].rows = append(cdfs[j].rows, r)
			continue
		}
		seen[k] = len(cdfs)
		cdfs = append(cdfs, group{title: shortLabel(r), rows: []*Result{r}})
	}
	var bars []string // workloads with a bar chart
	for _, wl := range AllWorkloads {
		for i := range rep.Results {
			if rep.Results[i].Workload == wl {
				bars = append(bars, wl)
				break
			}
		}
	}
	total := (len(cdfs) + len(bars)) * chartH
	if total == 0 {
		total = chartH
	}
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(bw, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", chartW, total, chartW, total)
	fmt.Fprintf(bw, `<rect x="0" y="0" width="%d" height="%d" fill="white"/>`+"\n", chartW, total)
	y := 0
	for _, g := range cdfs {
		writeCDF(bw, y, "Latency CDF: "+g.title+" ("+rep.Machine.Backend+")", g.rows)
		y += chartH
	}
	for _, wl := range bars {
		var rows []*Result
		for i := range rep.Results {
			if rep.Results[i].Workload == wl {
				rows = append(rows, &rep.Results[i])
			}
		}
		writeBars(bw, y, "Throughput: "+wl+" ("+rep.Machine.Backend+")", rows)
		y += chartH
	}
	if len(cdfs)+len(bars) == 0 {
		fmt.Fprintf(bw, `<text x="%d" y="%d">no results</text>`+"\n", marginL, chartH/2)
	}
	fmt.Fprintln(bw, `</svg>`)
	return bw.Flush()
}

func esc(s string) string { return html.EscapeString(s) }

func frame(w io.Writer, y0 int, title, xlabel, ylabel string) {
	fmt.Fprintf(w, `<g transform="translate(0,%d)">`+"\n", y0)
	fmt.Fprintf(w, `<text x="%d" y="22" font-size="14" font-weight="bold">%s</text>`+"\n", marginL, esc(title))
	fmt.Fprintf(w, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>`+"\n", marginL, marginT, plotW, plotH)
	fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="middle">%s</text>`+"\n", marginL+plotW/2, chartH-10, esc(xlabel))
	fmt.Fprintf(w, `<text x="16" y="%d" text-anchor="middle" transform="rotate(-90 16 %d)">%s</text>`+"\n", marginT+plotH/2, marginT+plotH/2, esc(ylabel))
}

func legend(w io.Writer, items [][2]string) {
	for i, it := range items {
		ly := marginT + 10 + 18*i
		fmt.Fprintf(w, `<rect x="%d" y="%d" width="14" height="10" fill="%s"/>`+"\n", marginL+plotW+12, ly, it[1])
		fmt.Fprintf(w, `<text x="%d" y="%d">%s</text>`+"\n", marginL+plotW+32, ly+10, esc(it[0]))
	}
}

// writeCDF draws the latency CDFs of rows (one cell, several modes).
func writeCDF(w io.Writer, y0 int, title string, rows []*Result) {
	frame(w, y0, title, "latency (µs, log scale)", "fraction of READs")
	lo, hi := math.Inf(1), 0.0
	for _, r := range rows {
		for _, d := range r.Latencies {
			if v := us(d); v > 0 {
				lo = math.Min(lo, v)
				break
			}
		}
		if n := len(r.Latencies); n > 0 {
			hi = math.Max(hi, us(r.Latencies[n-1]))
		}
	}
	if math.IsInf(lo, 1) || hi <= 0 {
		lo, hi = 0.1, 1
	}
	llo, lhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if lhi <= llo {
		lhi = llo + 1
	}
	xOf := func(v float64) float64 {
		if v <= 0 {
			v = math.Pow(10, llo)
		}
		return marginL + (math.Log10(v)-llo)/(lhi-llo)*plotW
	}
	yOf := func(f float64) float64 { return marginT + (1-f)*plotH }
	// Grid: decades on x, quarters on y.
	for e := llo; e <= lhi; e++ {
		x := xOf(math.Pow(10, e))
		fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", x, marginT, x, marginT+plotH)
		fmt.Fprintf(w, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", x, marginT+plotH+16, fmtTick(math.Pow(10, e)))
	}
	for _, f := range []float64{0, 0.25, 0.5, 0.75, 1} {
		y := yOf(f)
		fmt.Fprintf(w, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", marginL, y, marginL+plotW, y)
		fmt.Fprintf(w, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", marginL-6, y+4, f)
	}
	var items [][2]string
	for _, r := range rows {
		n := len(r.Latencies)
		if n == 0 {
			continue
		}
		fmt.Fprintf(w, `<polyline fill="none" stroke-width="2" stroke="%s" points="`, modeColor(r.Mode))
		for i := 0; i <= cdfSteps; i++ {
			q := float64(i) / cdfSteps
			d := percentile(r.Latencies, q)
			fmt.Fprintf(w, "%.1f,%.1f ", xOf(us(d)), yOf(q))
		}
		fmt.Fprintln(w, `"/>`)
		label := fmt.Sprintf("%s (p99 %s µs)", r.Mode, fnum(r.P99us))
		if !hasQuantile(r, 0.99) {
			label = fmt.Sprintf("%s (%d samples: no p99)", r.Mode, r.Samples) // as the table's "-"
		}
		items = append(items, [2]string{label, modeColor(r.Mode)})
	}
	legend(w, items)
	fmt.Fprintln(w, `</g>`)
}

func fmtTick(v float64) string {
	if v >= 1 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%g", v)
}

// writeBars draws reads/s (and GB/s in the labels) per configuration, one
// bar per mode.
func writeBars(w io.Writer, y0 int, title string, rows []*Result) {
	frame(w, y0, title, "configuration", "reads per second")
	var keys []string
	labels := map[string]string{}
	var modes []string
	max := 0.0
	for _, r := range rows {
		k := r.Key()
		if _, ok := labels[k]; !ok {
			keys = append(keys, k)
			labels[k] = shortLabel(r)
		}
		if !slices.Contains(modes, r.Mode) {
			modes = append(modes, r.Mode)
		}
		max = math.Max(max, r.ReadsPerSec)
	}
	if max <= 0 {
		max = 1
	}
	top := niceCeil(max)
	for i := 0; i <= 4; i++ {
		v := top * float64(i) / 4
		y := marginT + plotH - v/top*plotH
		fmt.Fprintf(w, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", marginL, y, marginL+plotW, y)
		fmt.Fprintf(w, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", marginL-6, y+4, fcount(v))
	}
	gw := float64(plotW) / float64(len(keys))
	bwid := gw * 0.8 / float64(len(modes))
	for gi, k := range keys {
		gx := marginL + gw*float64(gi) + gw*0.1
		for mi, m := range modes {
			for _, r := range rows {
				if r.Key() != k || r.Mode != m {
					continue
				}
				h := r.ReadsPerSec / top * plotH
				x := gx + bwid*float64(mi)
				p99 := "no p99"
				if hasQuantile(r, 0.99) {
					p99 = "p99 " + fnum(r.P99us) + " µs"
				}
				fmt.Fprintf(w, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s %s: %s reads/s, %s GB/s, %s</title></rect>`+"\n",
					x, marginT+plotH-h, bwid-1, h, modeColor(m), esc(labels[k]), m, fcount(r.ReadsPerSec), fnum(r.GBPerSec), p99)
			}
		}
		fmt.Fprintf(w, `<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%s</text>`+"\n", gx+gw*0.4, marginT+plotH+14, esc(labels[k]))
	}
	var items [][2]string
	for _, m := range modes {
		items = append(items, [2]string{m, modeColor(m)})
	}
	legend(w, items)
	fmt.Fprintln(w, `</g>`)
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*e {
			return m * e
		}
	}
	return 10 * e
}
