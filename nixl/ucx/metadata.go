package ucx

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"sort"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/ecxfer/ecxfer/internal/msgp"
	"github.com/ecxfer/ecxfer/nixl"
)

// Metadata blob layout (msgpack):
//
//	[magic str, version uint, body bin, checksum uint]
//
// checksum is xxhash64 of body. Body (versions 1 and 2):
//
//	[name str, boot str, netns uint, pidns uint, pid uint, start uint,
//	 ucx uint, worker bin, regions [[addr uint, len uint, rkey bin]...]]
//
// ucx is major<<16 | features<<8 | minor: the UCX library's version and
// this build's features (featFragNotifs). Builds before features compare
// the major alone, so they read the metadata of builds that have them.
//
// Version 2 is the same body from an agent with featBigSegments, and only
// from one: its tcp messages can be larger than a 64 KiB receive segment,
// and builds from before that feature, which would not see the bit and
// could read such an agent with UCX gets (answered in messages they have
// no room for), read version 1 alone and refuse it whole. A blob whose
// version and bit disagree is refused.
//
// magic, version and checksum are checked before the body is parsed, so a
// truncated or corrupted blob never reaches UCX.
const (
	mdMagic   = "ecxfer/ucx"
	mdVersion = 1
	// mdVersionBig is the version of an agent with featBigSegments.
	mdVersionBig = 2

	maxMetadata   = 16 << 20
	maxNameLen    = 256
	maxBootLen    = 64
	maxWorkerAddr = 16 << 10
	maxRkeyLen    = 16 << 10
	maxRegions    = 1 << 16
	maxPid        = 1 << 22 // PID_MAX_LIMIT
)

// hostID identifies the machine and namespaces a process lives in. Two
// agents share a host, for our purposes, when all three match: the same
// kernel boot, the same network namespace (two netns "hosts" on one
// machine reach each other over the network only) and the same pid
// namespace (so the peer's pid means the same process to us).
type hostID struct {
	Boot  string
	NetNS uint64
	PidNS uint64
}

type region struct {
	Addr, Len uint64
	Rkey      []byte
}

// ucxFeatures packs the UCX version and feature bits into the ucx field.
func ucxFeatures(major, minor, features uint64) uint64 {
	return major<<16 | (features&0xff)<<8 | minor&0xff
}

func (m *metadata) ucxMajor() uint64    { return m.UCX >> 16 }
func (m *metadata) ucxMinor() uint64    { return m.UCX & 0xff }
func (m *metadata) ucxFeatures() uint64 { return m.UCX >> 8 & 0xff }

// version is the envelope version m is sent with: mdVersionBig for an
// agent with featBigSegments, mdVersion for every other.
func (m *metadata) version() uint64 {
	if m.ucxFeatures()&featBigSegments != 0 {
		return mdVersionBig
	}
	return mdVersion
}

type metadata struct {
	Name   string
	Host   hostID
	Pid    uint64
	Start  uint64 // process start time, clock ticks after boot
	UCX    uint64 // major<<16 | minor of the UCX library
	Worker []byte
	Region []region
}

func encodeMetadata(m *metadata) ([]byte, error) {
	var body bytes.Buffer
	e := msgpack.NewEncoder(&body)
	must := func(err error) {
		if err != nil {
			panic(err) // bytes.Buffer writes do not fail
		}
	}
	must(e.EncodeArrayLen(9))
	must(e.EncodeString(m.Name))
	must(e.EncodeString(m.Host.Boot))
	must(e.EncodeUint(m.Host.NetNS))
	must(e.EncodeUint(m.Host.PidNS))
	must(e.EncodeUint(m.Pid))
	must(e.EncodeUint(m.Start))
	must(e.EncodeUint(m.UCX))
	must(e.EncodeBytes(m.Worker))
	must(e.EncodeArrayLen(len(m.Region)))
	for _, r := range m.Region {
		must(e.EncodeArrayLen(3))
		must(e.EncodeUint(r.Addr))
		must(e.EncodeUint(r.Len))
		must(e.EncodeBytes(r.Rkey))
	}
	var out bytes.Buffer
	e = msgpack.NewEncoder(&out)
	must(e.EncodeArrayLen(4))
	must(e.EncodeString(mdMagic))
	must(e.EncodeUint(m.version()))
	must(e.EncodeBytes(body.Bytes()))
	must(e.EncodeUint(xxhash.Sum64(body.Bytes())))
	if out.Len() > maxMetadata {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "metadata is %d bytes, limit %d", out.Len(), maxMetadata)
	}
	return out.Bytes(), nil
}

// mdReader reads metadata through the strict msgp reader and adds, to
// every error, what was being read.
type mdReader struct{ r *msgp.Reader }

func newMDReader(b []byte) mdReader { return mdReader{msgp.NewReader(b)} }

func (m mdReader) arrayLen(what string, lo, hi int) (int, error) {
	n, err := m.r.ArrayLen()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	// Every element takes at least a byte.
	if n < uint64(lo) || n > uint64(hi) || n > uint64(m.r.Len()) {
		return 0, fmt.Errorf("%s: %d elements, want %d..%d", what, n, lo, hi)
	}
	return int(n), nil
}

func (m mdReader) bin(what string, lo, hi int) ([]byte, error) {
	b, err := m.r.Bin(hi)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if len(b) < lo {
		return nil, fmt.Errorf("%s: length %d, want %d..%d", what, len(b), lo, hi)
	}
	return bytes.Clone(b), nil
}

func (m mdReader) str(what string, lo, hi int) (string, error) {
	b, err := m.r.Str(hi)
	if err != nil {
		return "", fmt.Errorf("%s: %w", what, err)
	}
	if len(b) < lo {
		return "", fmt.Errorf("%s: length %d, want %d..%d", what, len(b), lo, hi)
	}
	if !utf8.Valid(b) {
		return "", fmt.Errorf("%s: not UTF-8", what)
	}
	return string(b), nil
}

func (m mdReader) uint(what string) (uint64, error) {
	v, err := m.r.Uint()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	return v, nil
}

func (m mdReader) end(what string) error {
	if err := m.r.End(); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

// decodeMetadata parses a blob strictly. Errors wrap nixl.ErrInvalidParam.
// It is pure Go: nothing here touches UCX.
func decodeMetadata(blob []byte) (*metadata, error) {
	ver, body, err := openEnvelope(blob)
	if err == nil {
		var m *metadata
		if m, err = decodeBody(body); err == nil {
			if m.version() == ver {
				return m, nil
			}
			// Version 2 without the bit would reach builds that
			// refuse big segments; the bit in version 1 would reach
			// builds that cannot take them.
			err = fmt.Errorf("version %d does not match the peer's features %#x (version %d is that of LargeTCPSegments, and only of it)",
				ver, m.ucxFeatures(), mdVersionBig)
		}
	}
	return nil, nixl.Errorf(nixl.ErrInvalidParam, "metadata: %v", err)
}

// openEnvelope checks the blob's size, magic, version and checksum and
// returns the version and the body (aliasing blob).
func openEnvelope(blob []byte) (uint64, []byte, error) {
	if len(blob) == 0 || len(blob) > maxMetadata {
		return 0, nil, fmt.Errorf("size %d, want 1..%d", len(blob), maxMetadata)
	}
	top := newMDReader(blob)
	if _, err := top.arrayLen("envelope", 4, 4); err != nil {
		return 0, nil, err
	}
	magic, err := top.r.Str(64)
	if err != nil {
		return 0, nil, fmt.Errorf("magic: %w", err)
	}
	if string(magic) != mdMagic {
		return 0, nil, fmt.Errorf("bad magic %q", magic)
	}
	ver, err := top.uint("version")
	if err != nil {
		return 0, nil, err
	}
	if ver != mdVersion && ver != mdVersionBig {
		return 0, nil, fmt.Errorf("version %d, this build reads %d and %d", ver, mdVersion, mdVersionBig)
	}
	body, err := top.bin("body", 1, maxMetadata)
	if err != nil {
		return 0, nil, err
	}
	sum, err := top.uint("checksum")
	if err != nil {
		return 0, nil, err
	}
	if err := top.end("envelope"); err != nil {
		return 0, nil, err
	}
	if xxhash.Sum64(body) != sum {
		return 0, nil, fmt.Errorf("checksum mismatch")
	}
	return ver, body, nil
}

// decodeBody parses a checked body: the identity fields, then the regions.
func decodeBody(body []byte) (*metadata, error) {
	b := newMDReader(body)
	if _, err := b.arrayLen("body", 9, 9); err != nil {
		return nil, err
	}
	m := &metadata{}
	var err error
	if m.Name, err = b.str("name", 1, maxNameLen); err != nil {
		return nil, err
	}
	if m.Host.Boot, err = b.str("boot id", 0, maxBootLen); err != nil {
		return nil, err
	}
	for _, f := range []struct {
		what string
		v    *uint64
	}{{"netns", &m.Host.NetNS}, {"pidns", &m.Host.PidNS}, {"pid", &m.Pid}, {"start time", &m.Start}, {"ucx version", &m.UCX}} {
		if *f.v, err = b.uint(f.what); err != nil {
			return nil, err
		}
	}
	if m.Pid == 0 || m.Pid > maxPid {
		return nil, fmt.Errorf("pid %d out of range", m.Pid)
	}
	if m.Worker, err = b.bin("worker address", 1, maxWorkerAddr); err != nil {
		return nil, err
	}
	if m.Region, err = decodeRegions(b); err != nil {
		return nil, err
	}
	if err := b.end("body"); err != nil {
		return nil, err
	}
	return m, nil
}

// decodeRegions reads the region list and checks that no region is empty,
// wraps or overlaps another: each remote byte belongs to exactly one
// region, so each transfer range has exactly one rkey.
func decodeRegions(b mdReader) ([]region, error) {
	n, err := b.arrayLen("regions", 0, maxRegions)
	if err != nil {
		return nil, err
	}
	regions := make([]region, n)
	for i := range regions {
		what := fmt.Sprintf("region %d", i)
		if _, err := b.arrayLen(what, 3, 3); err != nil {
			return nil, err
		}
		r := &regions[i]
		if r.Addr, err = b.uint(what + " addr"); err != nil {
			return nil, err
		}
		if r.Len, err = b.uint(what + " len"); err != nil {
			return nil, err
		}
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return nil, fmt.Errorf("%s: [%#x,+%d) is empty or wraps", what, r.Addr, r.Len)
		}
		if r.Rkey, err = b.bin(what+" rkey", 1, maxRkeyLen); err != nil {
			return nil, err
		}
		if err := checkRkey(r.Rkey); err != nil {
			return nil, fmt.Errorf("%s rkey: %w", what, err)
		}
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return regions[idx[a]].Addr < regions[idx[b]].Addr })
	for k := 1; k < n; k++ {
		p, q := regions[idx[k-1]], regions[idx[k]]
		if p.Addr+p.Len > q.Addr {
			return nil, fmt.Errorf("regions [%#x,+%d) and [%#x,+%d) overlap", p.Addr, p.Len, q.Addr, q.Len)
		}
	}
	return regions, nil
}

// MetadataProcess implements nixl.ProcessNamer: the pid and start time in
// md. It only decodes.
func (a *Agent) MetadataProcess(md []byte) (pid, start uint64, ok bool) {
	m, err := decodeMetadata(md)
	if err != nil {
		return 0, 0, false
	}
	return m.Pid, m.Start, true
}

var _ nixl.ProcessNamer = (*Agent)(nil)

// The layout of a remote key as UCX 1.13 packs it (ucp_rkey_pack): a
// little-endian 64-bit map of the packer's memory domains, the memory
// type (one byte), then for each domain in the map a byte giving the size
// of that domain's key and the key; then, only for memory UCX placed on a
// system device, that device's id (one byte) and 3 bytes per device
// distance. UCX unpacks it without a length.
const (
	rkeyHeader       = 9 // the domain map and the memory type
	rkeyDistanceSize = 3
	ucsMemTypeHost   = 0 // UCS_MEMORY_TYPE_HOST
)

// checkRkey checks that a packed remote key has UCX's layout and that its
// domain map accounts for exactly its bytes: UCX parses the key from the
// map alone and reads as far as the map says, so a key cut short, or one
// whose map names domains its bytes do not hold, would have UCX read past
// the end of it (a review's forged key, one byte of the map changed,
// crashed the reader at its first READ). Host memory is all ecxfer reads.
// What each domain's key says (segment ids, addresses) is UCX's to
// parse; the shared-memory ones of a peer on this host are checked
// against that peer's own mappings later (truth.go).
func checkRkey(k []byte) error {
	if len(k) < rkeyHeader {
		return fmt.Errorf("%d bytes, shorter than its %d-byte header", len(k), rkeyHeader)
	}
	// No domain at all is a key of caller memory no domain registered
	// (UCX_TLS=posix,sysv): UCX reads it with emulated gets.
	mdMap := binary.LittleEndian.Uint64(k)
	if k[8] != ucsMemTypeHost {
		return fmt.Errorf("memory type %d, not host memory", k[8])
	}
	p := rkeyHeader
	for m := mdMap; m != 0; m &= m - 1 {
		if p >= len(k) {
			return fmt.Errorf("%d bytes end inside the keys of the %d domains its map %#x names",
				len(k), bits.OnesCount64(mdMap), mdMap)
		}
		p += 1 + int(k[p])
	}
	switch rest := len(k) - p; {
	case rest < 0:
		return fmt.Errorf("%d bytes end inside the keys of the %d domains its map %#x names",
			len(k), bits.OnesCount64(mdMap), mdMap)
	case rest > 0 && (rest-1)%rkeyDistanceSize != 0:
		return fmt.Errorf("%d bytes after the keys of the %d domains its map %#x names: not a device id and distances",
			rest, bits.OnesCount64(mdMap), mdMap)
	}
	return nil
}
