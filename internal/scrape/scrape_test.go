package scrape

import (
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const sample = `# HELP ecxfer_reads_done_total READs finished.
# TYPE ecxfer_reads_done_total counter
ecxfer_reads_done_total{agent="a"} 42
# a comment
# TYPE ecxfer_read_duration_seconds histogram
ecxfer_read_duration_seconds_bucket{agent="a",le="1e-06"} 1
ecxfer_read_duration_seconds_bucket{agent="a",le="+Inf"} 3
ecxfer_read_duration_seconds_sum{agent="a"} 1.5e-05
ecxfer_read_duration_seconds_count{agent="a"} 3
# TYPE odd gauge
odd{v="q\"uo\\te\nx" , w=""} -Inf 1700000000000
plain 7
`

func TestParse(t *testing.T) {
	fams, err := Parse(strings.NewReader(sample))
	require.NoError(t, err)
	require.Len(t, fams, 4)

	f := fams["ecxfer_reads_done_total"]
	require.Equal(t, "counter", f.Type)
	require.Equal(t, "READs finished.", f.Help)
	v, ok := f.Value("", map[string]string{"agent": "a"})
	require.True(t, ok)
	require.Equal(t, 42.0, v)
	_, ok = f.Value("", map[string]string{"agent": "b"})
	require.False(t, ok)

	h := fams["ecxfer_read_duration_seconds"]
	require.Equal(t, "histogram", h.Type)
	require.Len(t, h.Samples, 4)
	v, ok = h.Value("ecxfer_read_duration_seconds_bucket", map[string]string{"agent": "a", "le": "+Inf"})
	require.True(t, ok)
	require.Equal(t, 3.0, v)

	o := fams["odd"]
	require.Equal(t, "gauge", o.Type)
	require.Equal(t, map[string]string{"v": "q\"uo\\te\nx", "w": ""}, o.Samples[0].Labels)
	require.True(t, math.IsInf(o.Samples[0].Value, -1))

	require.Equal(t, "untyped", fams["plain"].Type)
}

func TestParseRejects(t *testing.T) {
	for _, in := range []string{
		"x",
		"x{a=\"1\"}",
		"9x 1",
		"x{a=1} 2",
		"x{a=\"1\" 2",
		"x{a=\"1\",a=\"2\"} 3",
		"x{a=\"\\q\"} 1",
		"x{a:b=\"1\"} 1",
		"x 1 2 3",
		"x one",
		"x 1 soon",
		"x 0x1p3",
		"# TYPE x countr",
		"# TYPE 9x counter",
		"x{a=\"1\"b=\"2\"} 1",
	} {
		_, err := Parse(strings.NewReader(in + "\n"))
		require.Error(t, err, "%q", in)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(sample))
	f.Add([]byte("x{a=\"\\\"\"} NaN\n"))
	f.Add([]byte("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_count 1\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		fams, err := Parse(strings.NewReader(string(in)))
		if err != nil {
			return
		}
		again, err := Parse(strings.NewReader(string(in)))
		require.NoError(t, err, "parsing is deterministic")
		require.Equal(t, len(fams), len(again))
		for name, f := range fams {
			require.Equal(t, name, f.Name)
			require.True(t, validName(name), name)
			for _, s := range f.Samples {
				require.True(t, validName(s.Name), s.Name)
				require.True(t, strings.HasPrefix(s.Name, name), "%s in family %s", s.Name, name)
				for k := range s.Labels {
					require.True(t, validName(k), k)
				}
			}
		}
	})
}

func TestGet(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			_, _ = io.WriteString(w, sample)
		case "/garbage":
			_, _ = io.WriteString(w, "9x 1\n")
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()

	fams, err := Get(srv.URL + "/metrics")
	require.NoError(t, err)
	v, ok := fams["ecxfer_reads_done_total"].Value("", map[string]string{"agent": "a"})
	require.True(t, ok)
	require.Equal(t, 42.0, v)

	_, err = Get(srv.URL + "/missing")
	require.ErrorContains(t, err, "404")
	_, err = Get(srv.URL + "/garbage")
	require.Error(t, err)
	_, err = Get("http://127.0.0.1:1/metrics") // nothing listens on port 1
	require.Error(t, err)
	_, err = Get("::not a url")
	require.Error(t, err)
}
