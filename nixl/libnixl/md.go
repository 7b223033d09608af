package libnixl

import (
	"bytes"
	"encoding/binary"
	"unicode/utf8"

	"github.com/ecxfer/ecxfer/nixl"
)

// NIXL's metadata blob is a stream of records after a fixed magic: a tag
// (a known string, no length), a 64-bit little-endian length, that many
// bytes, and '|'. The agent name is the first record. This package reads
// it for two reasons: LoadRemoteMetadata must name the peer even when NIXL
// refuses the blob (NIXL then reports no name), and a blob cut short must
// be refused before NIXL sees it (NIXL can half-load one and then refuse
// the good blob of the same peer).
//
// Only the name is required. The rest of the walk follows the layout of
// the NIXL versions this project was written against. A blob whose records
// run past its end is refused, as far as the walk gets: at the first
// record it does not know (an unknown tag or size, another NIXL's layout)
// it stops, and since tags carry no length it cannot tell where later
// records end, so NIXL judges the rest unchecked (if NIXL then refuses
// the blob, LoadRemoteMetadata drops whatever of it NIXL kept). When the walk succeeds
// it also yields the DRAM regions the peer advertised, which PrepDlist uses
// to check remote lists before NIXL does.

const mdMagic = "nixlSerDes|"

// maxMDRecord bounds one record's length.
const maxMDRecord = 1 << 30

// basicDescSize is the size of NIXL's serialized basic descriptor: address,
// length and device id, 64 bits each.
const basicDescSize = 24

// dramSeg is NIXL's DRAM memory type, serialized as a 32-bit enum.
const dramSeg = 0

type mdReader struct {
	b          []byte
	off        int
	addrFormat int // see peerMD
}

// errTruncated reports a record running past the end of the blob.
var errTruncated = nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata is truncated")

// errLayout reports a record with an unexpected tag or size: the blob comes
// from a NIXL whose layout this package does not know.
var errLayout = nixl.Errorf(nixl.ErrInvalidParam, "libnixl: unknown metadata layout")

func (r *mdReader) record(tag string) ([]byte, error) {
	if len(r.b)-r.off < len(tag)+8 {
		return nil, errTruncated
	}
	if string(r.b[r.off:r.off+len(tag)]) != tag {
		return nil, errLayout
	}
	n := binary.LittleEndian.Uint64(r.b[r.off+len(tag):])
	start := r.off + len(tag) + 8
	if n > maxMDRecord || uint64(len(r.b)-start) < n+1 {
		return nil, errTruncated
	}
	end := start + int(n)
	if r.b[end] != '|' {
		return nil, errLayout
	}
	r.off = end + 1
	return r.b[start:end], nil
}

func (r *mdReader) count(tag string) (uint64, error) {
	v, err := r.record(tag)
	if err != nil {
		return 0, err
	}
	if len(v) != 8 {
		return 0, errLayout
	}
	return binary.LittleEndian.Uint64(v), nil
}

// peerMD is what this package learns from a blob.
type peerMD struct {
	name    string
	regions []nixl.Span // DRAM regions; nil when the layout was not known
	known   bool        // the whole blob followed the known layout
	// addrFormat is the format version of the first connection record's
	// UCX worker address (the low nibble of its first byte), -1 when it
	// has none or the blob ends before it; read even when what follows
	// it is of an unknown layout.
	addrFormat int
}

// parseMD reads a metadata blob. It fails with ErrInvalidParam when the
// blob has no magic or name, or when a record before the first one of an
// unknown layout runs past its end.
func parseMD(b []byte) (peerMD, error) {
	md := peerMD{addrFormat: -1}
	if !bytes.HasPrefix(b, []byte(mdMagic)) {
		return md, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: not NIXL metadata (no magic)")
	}
	r := &mdReader{b: b, off: len(mdMagic), addrFormat: -1}
	name, err := r.record("Agent")
	if err != nil {
		return md, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata has no agent name: %v", err)
	}
	if len(name) == 0 || len(name) > 4096 {
		return md, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata agent name of %d bytes", len(name))
	}
	if bytes.IndexByte(name, 0) >= 0 {
		// NIXL's C API hands names back as C strings: this one would come
		// back cut at the NUL, as the name of another agent.
		return md, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata agent name %q has a NUL byte", name)
	}
	if !utf8.Valid(name) {
		// The other engines refuse such names too: a peer name is a
		// string everywhere above (errors, events, metric labels).
		return md, nixl.Errorf(nixl.ErrInvalidParam, "libnixl: metadata agent name %q is not UTF-8", name)
	}
	md.name = string(name)
	regions, err := r.rest()
	switch err {
	case nil:
		md.regions, md.known, md.addrFormat = regions, true, r.addrFormat
	case errLayout:
		// Another NIXL version: NIXL itself judges the rest, but the
		// first connection's address, if it got that far, is still
		// checked (LoadRemoteMetadata): NIXL connects to it before it
		// reads what follows, and UCX aborts the process on an address of
		// a format it does not know.
		md.addrFormat = r.addrFormat
	default:
		return md, err
	}
	return md, nil
}

// rest walks the connection and memory-section records after the name.
func (r *mdReader) rest() ([]nixl.Span, error) {
	conns, err := r.count("Conns")
	if err != nil {
		return nil, err
	}
	if conns > 64 {
		return nil, errLayout
	}
	r.addrFormat = -1
	for i := uint64(0); i < conns; i++ {
		if _, err := r.record("t"); err != nil {
			return nil, err
		}
		c, err := r.record("c")
		if err != nil {
			return nil, err
		}
		if i == 0 && len(c) > 0 {
			r.addrFormat = int(c[0] & 0x0f)
		}
	}
	sec, err := r.record("")
	if err != nil {
		return nil, err
	}
	if string(sec) != "MemSection" {
		return nil, errLayout
	}
	segs, err := r.count("nixlSecElms")
	if err != nil {
		return nil, err
	}
	if segs > 1<<16 {
		return nil, errLayout
	}
	var spans []nixl.Span
	for i := uint64(0); i < segs; i++ {
		if _, err := r.record("bknd"); err != nil {
			return nil, err
		}
		kind, err := r.record("nixlDList")
		if err != nil {
			return nil, err
		}
		if string(kind) != "nixlSDList" {
			return nil, errLayout
		}
		typ, err := r.record("t")
		if err != nil {
			return nil, err
		}
		if len(typ) != 4 {
			return nil, errLayout
		}
		n, err := r.count("n")
		if err != nil {
			return nil, err
		}
		if n > uint64(len(r.b)) {
			return nil, errTruncated
		}
		dram := binary.LittleEndian.Uint32(typ) == dramSeg
		for j := uint64(0); j < n; j++ {
			d, err := r.record("")
			if err != nil {
				return nil, err
			}
			if len(d) < basicDescSize {
				return nil, errLayout
			}
			if dram {
				spans = append(spans, nixl.Span{
					Addr: binary.LittleEndian.Uint64(d),
					Len:  binary.LittleEndian.Uint64(d[8:]),
				})
			}
		}
	}
	return spans, nil
}
