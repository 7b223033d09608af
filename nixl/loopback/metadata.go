package loopback

import (
	"bytes"
	"sort"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/ecxfer/ecxfer/internal/msgp"
	"github.com/ecxfer/ecxfer/nixl"
)

// Metadata format: a msgpack array
//
//	[magic string, version uint, name string, incarnation uint, [[addr uint, len uint], ...]]
//
// Incarnation tells restarts apart: metadata of a dead agent still decodes,
// but never reaches a newer agent that took the same name.
const (
	metaMagic   = "ecxfer-loopback"
	metaVersion = 1
	// MaxMetadataSize is the largest metadata blob LoadRemoteMetadata accepts.
	MaxMetadataSize = 1 << 20
	// MaxRegions is the most regions one agent may advertise.
	MaxRegions = 4096
)

// LocalMetadata returns this agent's metadata: its name, incarnation and
// registered regions. It changes whenever memory is registered or released.
func (a *Agent) LocalMetadata() ([]byte, error) {
	if a.dead.Load() {
		return nil, ErrClosed
	}
	if len(a.regions) > MaxRegions {
		return nil, nixl.Errorf(nixl.ErrNotSupported, "loopback: %d regions registered, metadata holds at most %d", len(a.regions), MaxRegions)
	}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	// Writes to a bytes.Buffer cannot fail.
	_ = e.EncodeArrayLen(5)
	_ = e.EncodeString(metaMagic)
	_ = e.EncodeUint(metaVersion)
	_ = e.EncodeString(a.name)
	_ = e.EncodeUint(a.inc)
	_ = e.EncodeArrayLen(len(a.regions))
	for _, r := range a.regions {
		_ = e.EncodeArrayLen(2)
		_ = e.EncodeUint(r.addr)
		_ = e.EncodeUint(uint64(len(r.buf)))
	}
	return buf.Bytes(), nil
}

// metadata is a decoded blob.
type metadata struct {
	name  string
	inc   uint64
	spans nixl.SpanIndex
}

// metaReader reads metadata through the strict msgp reader and words its
// errors as this package's.
type metaReader struct{ r *msgp.Reader }

// array reads an array header with exactly want elements (want < 0: any
// number up to max).
func (m metaReader) array(what string, want, max int) (int, error) {
	n, err := m.r.ArrayLen()
	if err != nil {
		return 0, metaErr("%s: %v", what, err)
	}
	if want >= 0 && n != uint64(want) {
		return 0, metaErr("%s: want %d elements, found %d", what, want, n)
	}
	if n > uint64(max) || n > uint64(m.r.Len()) { // every element takes at least a byte
		return 0, metaErr("%s: %d elements is too many", what, n)
	}
	return int(n), nil
}

func (m metaReader) uint(what string) (uint64, error) {
	v, err := m.r.Uint()
	if err != nil {
		return 0, metaErr("%s: %v", what, err)
	}
	return v, nil
}

func (m metaReader) str(what string, max int) (string, error) {
	b, err := m.r.Str(max)
	if err != nil {
		return "", metaErr("%s: %v", what, err)
	}
	return string(b), nil
}

func metaErr(format string, args ...any) error {
	return nixl.Errorf(nixl.ErrInvalidParam, "loopback: metadata: "+format, args...)
}

// decodeMetadata parses a blob strictly: exact shape, exact types, no
// trailing bytes, bounded sizes, valid name, non-empty non-overlapping
// regions that do not wrap.
func decodeMetadata(md []byte) (metadata, error) {
	var out metadata
	if len(md) > MaxMetadataSize {
		return out, metaErr("%d bytes exceeds the limit of %d", len(md), MaxMetadataSize)
	}
	m := metaReader{msgp.NewReader(md)}
	if _, err := m.array("header", 5, 5); err != nil {
		return out, err
	}
	magic, err := m.str("magic", len(metaMagic))
	if err != nil {
		return out, err
	}
	if magic != metaMagic {
		return out, metaErr("bad magic %q", magic)
	}
	v, err := m.uint("version")
	if err != nil {
		return out, err
	}
	if v != metaVersion {
		return out, metaErr("unsupported version %d (want %d)", v, metaVersion)
	}
	if out.name, err = m.str("name", MaxNameLen); err != nil {
		return out, err
	}
	if err := checkName(out.name); err != nil {
		return out, metaErr("%v", err)
	}
	if out.inc, err = m.uint("incarnation"); err != nil {
		return out, err
	}
	if out.inc == 0 {
		return out, metaErr("incarnation 0")
	}
	n, err := m.array("regions", -1, MaxRegions)
	if err != nil {
		return out, err
	}
	spans := make([]nixl.Span, n)
	for i := range spans {
		if _, err := m.array("region", 2, 2); err != nil {
			return out, err
		}
		if spans[i].Addr, err = m.uint("region address"); err != nil {
			return out, err
		}
		if spans[i].Len, err = m.uint("region length"); err != nil {
			return out, err
		}
	}
	if err := m.r.End(); err != nil {
		return out, metaErr("%v", err)
	}
	if out.spans, err = nixl.NewSpanIndex(spans); err != nil {
		return out, metaErr("%v", err)
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].Addr < spans[j].Addr })
	for i := 1; i < len(spans); i++ {
		if p := spans[i-1]; p.Addr+p.Len > spans[i].Addr {
			return out, metaErr("regions [%#x,+%d) and [%#x,+%d) overlap", p.Addr, p.Len, spans[i].Addr, spans[i].Len)
		}
	}
	return out, nil
}

// LoadRemoteMetadata decodes md strictly and loads the peer it describes.
// Identical metadata again returns the same name; different metadata under
// a loaded name fails with nixl.ErrNotAllowed, returned with that name,
// until InvalidateRemoteMetadata. Metadata of an agent that no longer exists
// loads, but transfers to it end with nixl.ErrRemoteDisconnect.
func (a *Agent) LoadRemoteMetadata(md []byte) (string, error) {
	if a.dead.Load() {
		return "", ErrClosed
	}
	m, err := decodeMetadata(md)
	if err != nil {
		return "", err
	}
	if p, ok := a.peers[m.name]; ok {
		if bytes.Equal(p.blob, md) {
			return m.name, nil
		}
		return m.name, nixl.Errorf(nixl.ErrNotAllowed, "loopback: other metadata for %q is loaded; invalidate it first", m.name)
	}
	a.peers[m.name] = &peer{name: m.name, inc: m.inc, blob: bytes.Clone(md), spans: m.spans}
	return m.name, nil
}

// InvalidateRemoteMetadata forgets a peer. Its lists can only be released
// (other uses fail with nixl.ErrNotFound) and its posted requests end at
// once with nixl.ErrRemoteDisconnect.
func (a *Agent) InvalidateRemoteMetadata(name string) error {
	p, err := live(a, a.peers, name, "loopback: unknown peer %q")
	if err != nil {
		return err
	}
	p.invalid = true
	delete(a.peers, name)
	for _, e := range a.pending {
		if x := e.x; e.live() && x.remote.peer == p {
			a.finish(x, disconnected(name, "metadata invalidated"))
		}
	}
	return nil
}
