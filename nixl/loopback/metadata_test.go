package loopback

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

// enc builds a msgpack blob from values written by the encoder's
// low-level calls, so that tests can shape hostile input freely.
func enc(t testing.TB, parts ...func(*msgpack.Encoder) error) []byte {
	t.Helper()
	var b bytes.Buffer
	e := msgpack.NewEncoder(&b)
	for _, p := range parts {
		if err := p(e); err != nil {
			t.Fatal(err)
		}
	}
	return b.Bytes()
}

func arr(n int) func(*msgpack.Encoder) error {
	return func(e *msgpack.Encoder) error { return e.EncodeArrayLen(n) }
}
func str(s string) func(*msgpack.Encoder) error {
	return func(e *msgpack.Encoder) error { return e.EncodeString(s) }
}
func u(v uint64) func(*msgpack.Encoder) error {
	return func(e *msgpack.Encoder) error { return e.EncodeUint(v) }
}
func i64(v int64) func(*msgpack.Encoder) error {
	return func(e *msgpack.Encoder) error { return e.EncodeInt(v) }
}
func raw(b ...byte) func(*msgpack.Encoder) error {
	return func(e *msgpack.Encoder) error { _, err := e.Writer().Write(b); return err }
}

// meta is a well-formed blob with the given fields.
func meta(t testing.TB, magic string, version uint64, name string, inc uint64, regions ...[2]uint64) []byte {
	parts := []func(*msgpack.Encoder) error{arr(5), str(magic), u(version), str(name), u(inc), arr(len(regions))}
	for _, r := range regions {
		parts = append(parts, arr(2), u(r[0]), u(r[1]))
	}
	return enc(t, parts...)
}

func TestMetadataRoundTrip(t *testing.T) {
	a := newAgent(t, "md-a")
	_, b1, err := a.AllocMem(4096, nixl.DRAM, 0)
	must(t, err)
	heap := make([]byte, 100)
	_, err = a.RegisterMem(heap, nixl.DRAM, 0)
	must(t, err)
	md, err := a.LocalMetadata()
	must(t, err)
	m, err := decodeMetadata(md)
	must(t, err)
	if m.name != "md-a" || m.inc != a.Incarnation() {
		t.Fatalf("decoded %q/%d", m.name, m.inc)
	}
	for _, sp := range []nixl.Span{{Addr: nixl.Addr(b1), Len: 4096}, {Addr: nixl.Addr(heap), Len: 100}} {
		if !m.spans.Contains(sp.Addr, sp.Len) || m.spans.Contains(sp.Addr, sp.Len+1) {
			t.Fatalf("span %+v not advertised exactly", sp)
		}
	}
	// An agent with no memory has valid, empty metadata.
	e := newAgent(t, "md-empty")
	md, err = e.LocalMetadata()
	must(t, err)
	_, err = decodeMetadata(md)
	must(t, err)
}

func TestLoadRemoteMetadata(t *testing.T) {
	p := newSide(t, "load-p")
	c := newSide(t, "load-c")
	md, err := p.a.LocalMetadata()
	must(t, err)

	name, err := c.a.LoadRemoteMetadata(md)
	must(t, err)
	if name != "load-p" {
		t.Fatalf("name %q", name)
	}
	name, err = c.a.LoadRemoteMetadata(bytes.Clone(md)) // identical again
	must(t, err)
	if name != "load-p" {
		t.Fatalf("name %q on reload", name)
	}

	// Different metadata under the same name: refused until invalidated.
	_, _, err = p.a.AllocMem(4096, nixl.DRAM, 0)
	must(t, err)
	md2, err := p.a.LocalMetadata()
	must(t, err)
	name, err = c.a.LoadRemoteMetadata(md2)
	mustIs(t, err, nixl.ErrNotAllowed)
	if name != "load-p" {
		t.Fatalf("refused reload returned name %q, want the peer to invalidate", name)
	}

	mustIs(t, c.a.InvalidateRemoteMetadata("nobody"), nixl.ErrNotFound)
	mustIs(t, c.a.InvalidateRemoteMetadata(""), nixl.ErrNotFound)
	must(t, c.a.InvalidateRemoteMetadata("load-p"))
	mustIs(t, c.a.InvalidateRemoteMetadata("load-p"), nixl.ErrNotFound)
	name, err = c.a.LoadRemoteMetadata(md2)
	must(t, err)
	if name != "load-p" {
		t.Fatalf("name %q", name)
	}

	// The loader keeps its own copy of the blob.
	md2[len(md2)-1] ^= 0xff
	_, err = c.a.LoadRemoteMetadata(md2)
	if err == nil {
		t.Fatal("mutated blob accepted as identical")
	}

	// An agent may load its own metadata.
	own, err := c.a.LocalMetadata()
	must(t, err)
	name, err = c.a.LoadRemoteMetadata(own)
	must(t, err)
	if name != "load-c" {
		t.Fatalf("own name %q", name)
	}
}

func TestLoadRemoteMetadataHostile(t *testing.T) {
	a := newAgent(t, "hostile")
	good := meta(t, metaMagic, metaVersion, "peer", 7, [2]uint64{0x1000, 0x100})
	if _, err := decodeMetadata(good); err != nil {
		t.Fatalf("good blob: %v", err)
	}
	regions := make([][2]uint64, MaxRegions+1)
	for i := range regions {
		regions[i] = [2]uint64{uint64(i+1) * 0x1000, 0x10}
	}
	tests := []struct {
		name string
		md   []byte
	}{
		{"nil", nil},
		{"empty", []byte{}},
		{"truncated", good[:len(good)-1]},
		{"trailing byte", append(bytes.Clone(good), 0)},
		{"not an array", enc(t, str("hello"))},
		{"map", enc(t, raw(0x80))},
		{"nil header", enc(t, raw(0xc0))},
		{"header too short", enc(t, arr(4), str(metaMagic), u(1), str("p"), u(1))},
		{"header too long", enc(t, arr(6), str(metaMagic), u(1), str("p"), u(1), arr(0), u(0))},
		{"bad magic", meta(t, "ecxfer-loopbacK", metaVersion, "p", 1)},
		{"short magic", meta(t, "ecx", metaVersion, "p", 1)},
		{"long magic", meta(t, metaMagic+"-plus", metaVersion, "p", 1)},
		{"magic as bin", enc(t, arr(5), func(e *msgpack.Encoder) error { return e.EncodeBytes([]byte(metaMagic)) }, u(1), str("p"), u(1), arr(0))},
		{"version 0", meta(t, metaMagic, 0, "p", 1)},
		{"version 2", meta(t, metaMagic, 2, "p", 1)},
		{"version nil", enc(t, arr(5), str(metaMagic), raw(0xc0), str("p"), u(1), arr(0))},
		{"version negative", enc(t, arr(5), str(metaMagic), i64(-1), str("p"), u(1), arr(0))},
		{"version float", enc(t, arr(5), str(metaMagic), raw(0xca, 0x3f, 0x80, 0, 0), str("p"), u(1), arr(0))},
		{"empty name", meta(t, metaMagic, metaVersion, "", 1)},
		{"long name", meta(t, metaMagic, metaVersion, strings.Repeat("n", MaxNameLen+1), 1)},
		{"unprintable name", meta(t, metaMagic, metaVersion, "p\x01", 1)},
		{"invalid utf8 name", meta(t, metaMagic, metaVersion, "p\xc3", 1)},
		{"name as int", enc(t, arr(5), str(metaMagic), u(1), u(5), u(1), arr(0))},
		{"incarnation 0", meta(t, metaMagic, metaVersion, "p", 0)},
		{"incarnation negative", enc(t, arr(5), str(metaMagic), u(1), str("p"), i64(-5), arr(0))},
		{"regions nil", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), raw(0xc0))},
		{"regions not array", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), u(3))},
		{"too many regions", meta(t, metaMagic, metaVersion, "p", 1, regions...)},
		{"region count lies", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), raw(0xdd, 0xff, 0xff, 0xff, 0xff))},
		{"region count over max", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), raw(0xdc, 0x10, 0x01))},
		{"region of 3", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), arr(1), arr(3), u(1), u(2), u(3))},
		{"region of 1", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), arr(1), arr(1), u(1))},
		{"region zero length", meta(t, metaMagic, metaVersion, "p", 1, [2]uint64{0x1000, 0})},
		{"region wraps", meta(t, metaMagic, metaVersion, "p", 1, [2]uint64{^uint64(0) - 10, 100})},
		{"regions overlap", meta(t, metaMagic, metaVersion, "p", 1, [2]uint64{0x2000, 0x100}, [2]uint64{0x1000, 0x1001})},
		{"region addr negative", enc(t, arr(5), str(metaMagic), u(1), str("p"), u(1), arr(1), arr(2), i64(-4096), u(16))},
		{"str32 length lies", enc(t, arr(5), raw(0xdb, 0xff, 0xff, 0xff, 0xff), raw([]byte(metaMagic)...))},
		{"name str32 lies", enc(t, arr(5), str(metaMagic), u(1), raw(0xdb, 0x7f, 0xff, 0xff, 0xff, 'p'))},
		{"oversized", append(bytes.Clone(good), make([]byte, MaxMetadataSize)...)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			name, err := a.LoadRemoteMetadata(tc.md)
			var ne *nixl.Error
			if !errors.Is(err, nixl.ErrInvalidParam) || !errors.As(err, &ne) || name != "" {
				t.Fatalf("LoadRemoteMetadata = %q, %v; want ErrInvalidParam", name, err)
			}
		})
	}
	if len(a.peers) != 0 {
		t.Fatalf("hostile input loaded peers: %d", len(a.peers))
	}
}

func TestLoadDeadIncarnation(t *testing.T) {
	c := newSide(t, "dead-c")
	p, err := New("dead-p")
	must(t, err)
	mem, buf, err := p.AllocMem(blockSize, nixl.DRAM, 0)
	must(t, err)
	_ = mem
	md, err := p.LocalMetadata()
	must(t, err)
	must(t, p.Close())

	// Loads, but the peer is unreachable.
	name, err := c.a.LoadRemoteMetadata(md)
	must(t, err)
	d, err := c.a.PrepDlist(name, descriptors.List{{Addr: nixl.Addr(buf), Len: blockSize}}, nixl.DRAM)
	must(t, err)
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, d, []int{0}, []byte("n"))
	must(t, err)
	must(t, c.a.PostXfer(x))
	mustIs(t, waitDone(t, c.a, x), nixl.ErrRemoteDisconnect)
	mustIs(t, c.a.SendNotif(name, []byte("hi")), nixl.ErrRemoteDisconnect)

	// A new agent under the old name is not the old incarnation.
	p2 := newAgent(t, "dead-p")
	_, _, err = p2.AllocMem(blockSize, nixl.DRAM, 0)
	must(t, err)
	must(t, c.a.PostXfer(x))
	mustIs(t, waitDone(t, c.a, x), nixl.ErrRemoteDisconnect)
	mustIs(t, c.a.SendNotif(name, []byte("hi")), nixl.ErrRemoteDisconnect)
	if n := p2.GetNotifs(map[string][][]byte{}); n != 0 {
		t.Fatalf("new incarnation got %d notifications meant for the old one", n)
	}
}

// FuzzLoadRemoteMetadata feeds arbitrary blobs to the decoder: it must
// never panic, must fail with ErrInvalidParam, and whatever it accepts
// must decode again to the same name.
func FuzzLoadRemoteMetadata(f *testing.F) {
	good := meta(f, metaMagic, metaVersion, "peer", 7, [2]uint64{0x1000, 0x100}, [2]uint64{0x4000, 0x2000})
	f.Add(good)
	f.Add(meta(f, metaMagic, metaVersion, "p", 1))
	f.Add(good[:len(good)/2])
	f.Add(append(bytes.Clone(good), 0xc0))
	for _, i := range []int{0, 1, 17, 19, len(good) - 3} {
		m := bytes.Clone(good)
		m[i] ^= 0x20
		f.Add(m)
	}
	f.Add(enc(f, arr(5), str(metaMagic), u(1), str("p"), u(1), raw(0xdd, 0xff, 0xff, 0xff, 0xff)))
	f.Add([]byte{})

	a, err := New("fuzz-loader")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { a.Close() })
	f.Fuzz(func(t *testing.T, md []byte) {
		name, err := a.LoadRemoteMetadata(md)
		if err != nil {
			if !errors.Is(err, nixl.ErrInvalidParam) || name != "" {
				t.Fatalf("LoadRemoteMetadata = %q, %v; want ErrInvalidParam", name, err)
			}
			return
		}
		m, err := decodeMetadata(md)
		if err != nil || m.name != name {
			t.Fatalf("accepted blob does not decode again: %v", err)
		}
		must(t, a.InvalidateRemoteMetadata(name))
	})
}
