// Package scrape parses Prometheus' text exposition format, enough for
// tests and tools to check what an exporter serves: HELP and TYPE lines
// and samples with labels. It is not a full implementation (no exemplars,
// no OpenMetrics), and it rejects what it does not understand.
package scrape

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// Sample is one line of data.
type Sample struct {
	Name   string // as written, e.g. x_bucket for a histogram's bucket
	Labels map[string]string
	Value  float64
}

// Family is a metric family: the samples that share a base name.
type Family struct {
	Name    string
	Type    string // counter, gauge, histogram, summary, untyped
	Help    string
	Samples []Sample
}

// maxLine bounds one line of input.
const maxLine = 1 << 20

// Get fetches an exporter's exposition from url and parses it. A status
// other than 200 is an error.
func Get(url string) (map[string]*Family, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, fmt.Errorf("scrape: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape: %s: %s", url, resp.Status)
	}
	return Parse(resp.Body)
}

// Parse reads an exposition and returns its families by name. Samples of
// a histogram or summary (name_bucket, name_sum, name_count) go to the
// family of their base name when it was declared with TYPE.
func Parse(r io.Reader) (map[string]*Family, error) {
	fams := map[string]*Family{}
	get := func(name string) *Family {
		f := fams[name]
		if f == nil {
			f = &Family{Name: name, Type: "untyped"}
			fams[name] = f
		}
		return f
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxLine)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		if strings.HasPrefix(line, "#") {
			f := strings.SplitN(line, " ", 4)
			if len(f) < 3 || (f[1] != "HELP" && f[1] != "TYPE") {
				continue // a comment
			}
			if !validName(f[2]) {
				return nil, fmt.Errorf("line %d: bad metric name %q", n, f[2])
			}
			rest := ""
			if len(f) == 4 {
				rest = f[3]
			}
			fam := get(f[2])
			if f[1] == "HELP" {
				fam.Help = rest
				continue
			}
			switch rest {
			case "counter", "gauge", "histogram", "summary", "untyped":
				fam.Type = rest
			default:
				return nil, fmt.Errorf("line %d: unknown type %q", n, rest)
			}
			continue
		}
		s, err := parseSample(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		fam := get(familyOf(fams, s.Name))
		fam.Samples = append(fam.Samples, s)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return fams, nil
}

func familyOf(fams map[string]*Family, name string) string {
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suf)
		if !ok {
			continue
		}
		if f := fams[base]; f != nil && (f.Type == "histogram" || f.Type == "summary") {
			return base
		}
	}
	return name
}

func validName(s string) bool {
	if s == "" {
		return false
	}
	for i, c := range s {
		switch {
		case c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'):
		case c >= '0' && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

func parseSample(line string) (Sample, error) {
	i := strings.IndexAny(line, "{ \t")
	if i < 0 {
		return Sample{}, fmt.Errorf("no value in %q", line)
	}
	s := Sample{Name: line[:i], Labels: map[string]string{}}
	if !validName(s.Name) {
		return Sample{}, fmt.Errorf("bad metric name %q", s.Name)
	}
	rest := line[i:]
	if rest[0] == '{' {
		var err error
		if rest, err = parseLabels(rest[1:], s.Labels); err != nil {
			return Sample{}, err
		}
	}
	f := strings.Fields(rest)
	if len(f) < 1 || len(f) > 2 {
		return Sample{}, fmt.Errorf("want a value and an optional timestamp, got %q", rest)
	}
	v, err := parseValue(f[0])
	if err != nil {
		return Sample{}, err
	}
	if len(f) == 2 {
		if _, err := strconv.ParseInt(f[1], 10, 64); err != nil {
			return Sample{}, fmt.Errorf("bad timestamp %q", f[1])
		}
	}
	s.Value = v
	return s, nil
}

func parseValue(s string) (float64, error) {
	switch s {
	case "+Inf", "Inf":
		return math.Inf(1), nil
	case "-Inf":
		return math.Inf(-1), nil
	case "NaN":
		return math.NaN(), nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || strings.ContainsAny(s, "_xXpPiInN") {
		return 0, fmt.Errorf("bad value %q", s)
	}
	return v, nil
}

// parseLabels reads name="value" pairs up to the closing brace and returns
// what follows it.
func parseLabels(s string, into map[string]string) (string, error) {
	for {
		s = strings.TrimLeft(s, " \t")
		if strings.HasPrefix(s, "}") {
			return s[1:], nil
		}
		eq := strings.IndexByte(s, '=')
		if eq < 0 {
			return "", fmt.Errorf("label without '='")
		}
		name := strings.TrimSpace(s[:eq])
		if !validName(name) || strings.Contains(name, ":") {
			return "", fmt.Errorf("bad label name %q", name)
		}
		if _, dup := into[name]; dup {
			return "", fmt.Errorf("label %q twice", name)
		}
		s = strings.TrimLeft(s[eq+1:], " \t")
		if !strings.HasPrefix(s, `"`) {
			return "", fmt.Errorf("label %q: value not quoted", name)
		}
		var b strings.Builder
		i := 1
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] != '\\' {
				b.WriteByte(s[i])
				continue
			}
			i++
			if i == len(s) {
				break
			}
			switch s[i] {
			case '\\', '"':
				b.WriteByte(s[i])
			case 'n':
				b.WriteByte('\n')
			default:
				return "", fmt.Errorf("label %q: bad escape \\%c", name, s[i])
			}
		}
		if i >= len(s) {
			return "", fmt.Errorf("label %q: unterminated value", name)
		}
		into[name] = b.String()
		s = strings.TrimLeft(s[i+1:], " \t")
		if strings.HasPrefix(s, ",") {
			s = s[1:]
		} else if !strings.HasPrefix(s, "}") {
			return "", fmt.Errorf("after label %q: want ',' or '}'", name)
		}
	}
}

// Value returns the value of the family's sample with exactly these labels
// (and the given sample name, "" for the family's own name), and whether
// there is one.
func (f *Family) Value(sample string, labels map[string]string) (float64, bool) {
	if sample == "" {
		sample = f.Name
	}
	for _, s := range f.Samples {
		if s.Name != sample || len(s.Labels) != len(labels) {
			continue
		}
		match := true
		for k, v := range labels {
			if s.Labels[k] != v {
				match = false
				break
			}
		}
		if match {
			return s.Value, true
		}
	}
	return 0, false
}
