package libnixl

import (
	"strings"
	"testing"
)

// FuzzParams: $ECXFER_NIXL_PARAMS, whatever it holds, is refused or read
// into parameters that travel to the shim intact: each line the shim
// gets, split at its first '=', gives back a key and its value.
func FuzzParams(f *testing.F) {
	f.Add("ucx_error_handling_mode=none")
	f.Add(" a = b , c=d=e")
	f.Add("novalue")
	f.Add("=x")
	f.Add("k=v\nx=y")
	f.Fuzz(func(t *testing.T, env string) {
		p, err := parseParams(env)
		if err != nil {
			return
		}
		enc, err := encodeParams(p)
		if err != nil {
			return
		}
		got := map[string]string{}
		for _, line := range strings.Split(strings.TrimSuffix(enc, "\n"), "\n") {
			if line == "" && len(p) == 0 {
				continue
			}
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("line %q without '='", line)
			}
			got[k] = v
		}
		if len(got) != len(p) {
			t.Fatalf("%d parameters, the shim would get %d (%q)", len(p), len(got), enc)
		}
		for k, v := range p {
			if got[k] != v {
				t.Fatalf("%q=%q, the shim would get %q", k, v, got[k])
			}
		}
	})
}

// The parameters as the shim gets them; keys it could not split refused.
func TestParams(t *testing.T) {
	p, err := parseParams(" a = b , c=d=e")
	if err != nil || len(p) != 2 || p["a"] != "b" || p["c"] != "d=e" {
		t.Fatalf("%v %v", p, err)
	}
	if enc, err := encodeParams(p); err != nil || enc != "a=b\nc=d=e\n" {
		t.Fatalf("%q %v", enc, err)
	}
	for _, bad := range []map[string]string{{"": "x"}, {"a=b": "c"}, {"a\nb": "c"}, {"a": "b\nc"}} {
		if _, err := encodeParams(bad); err == nil {
			t.Fatalf("%q taken", bad)
		}
	}
	if _, err := parseParams("a=b,novalue"); err == nil {
		t.Fatal("a parameter without '=' taken")
	}
}
