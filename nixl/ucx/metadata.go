package ucx

import (
	"bytes"
	"fmt"
	"sort"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/ecxfer/ecxfer/nixl"
)

// Metadata blob layout (msgpack):
//
//	[magic str, version uint, body bin, checksum uint]
//
// checksum is xxhash64 of body. Version 1 body:
//
//	[name str, boot str, netns uint, pidns uint, pid uint, start uint,
//	 ucx uint, worker bin, regions [[addr uint, len uint, rkey bin]...]]
//
// magic, version and checksum are checked before the body is parsed, so a
// truncated or corrupted blob never reaches UCX.
const (
	mdMagic   = "ecxfer/ucx"
	mdVersion = 1

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
	must(e.EncodeUint(mdVersion))
	must(e.EncodeBytes(body.Bytes()))
	must(e.EncodeUint(xxhash.Sum64(body.Bytes())))
	if out.Len() > maxMetadata {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "metadata is %d bytes, limit %d", out.Len(), maxMetadata)
	}
	return out.Bytes(), nil
}

// mdReader is a strict reader over msgpack: every item must have the
// expected kind, every length is checked against what is left before
// anything is allocated.
type mdReader struct {
	r *bytes.Reader
	d *msgpack.Decoder
}

func newMDReader(b []byte) *mdReader {
	r := bytes.NewReader(b)
	// bytes.Reader is an io.ByteScanner, so the decoder reads it directly
	// and r.Len() is exactly what is left.
	return &mdReader{r: r, d: msgpack.NewDecoder(r)}
}

func (m *mdReader) arrayLen(what string, lo, hi int) (int, error) {
	c, err := m.d.PeekCode()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if !msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32 {
		return 0, fmt.Errorf("%s: not an array (code %#x)", what, c)
	}
	n, err := m.d.DecodeArrayLen()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if n < lo || n > hi || n > m.r.Len() {
		return 0, fmt.Errorf("%s: %d elements, want %d..%d", what, n, lo, hi)
	}
	return n, nil
}

func (m *mdReader) raw(what string, str bool, lo, hi int) ([]byte, error) {
	c, err := m.d.PeekCode()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	isStr := msgpcode.IsFixedString(c) || c == msgpcode.Str8 || c == msgpcode.Str16 || c == msgpcode.Str32
	isBin := c == msgpcode.Bin8 || c == msgpcode.Bin16 || c == msgpcode.Bin32
	if (str && !isStr) || (!str && !isBin) {
		return nil, fmt.Errorf("%s: wrong kind (code %#x)", what, c)
	}
	n, err := m.d.DecodeBytesLen()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if n < lo || n > hi || n > m.r.Len() {
		return nil, fmt.Errorf("%s: length %d, want %d..%d (%d bytes left)", what, n, lo, hi, m.r.Len())
	}
	b := make([]byte, n)
	if err := m.d.ReadFull(b); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return b, nil
}

func (m *mdReader) str(what string, lo, hi int) (string, error) {
	b, err := m.raw(what, true, lo, hi)
	if err != nil {
		return "", err
	}
	if !utf8.Valid(b) {
		return "", fmt.Errorf("%s: not UTF-8", what)
	}
	return string(b), nil
}

func (m *mdReader) uint(what string) (uint64, error) {
	c, err := m.d.PeekCode()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if !msgpcode.IsFixedNum(c) && c != msgpcode.Uint8 && c != msgpcode.Uint16 &&
		c != msgpcode.Uint32 && c != msgpcode.Uint64 || c >= msgpcode.NegFixedNumLow {
		return 0, fmt.Errorf("%s: not an unsigned integer (code %#x)", what, c)
	}
	v, err := m.d.DecodeUint64()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	return v, nil
}

func (m *mdReader) end(what string) error {
	if m.r.Len() != 0 {
		return fmt.Errorf("%s: %d trailing bytes", what, m.r.Len())
	}
	return nil
}

// decodeMetadata parses a blob strictly. Errors wrap nixl.ErrInvalidParam.
// It is pure Go: nothing here touches UCX.
func decodeMetadata(blob []byte) (*metadata, error) {
	m, err := decodeMetadataErr(blob)
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "metadata: %v", err)
	}
	return m, nil
}

func decodeMetadataErr(blob []byte) (*metadata, error) {
	if len(blob) == 0 || len(blob) > maxMetadata {
		return nil, fmt.Errorf("size %d, want 1..%d", len(blob), maxMetadata)
	}
	top := newMDReader(blob)
	if _, err := top.arrayLen("envelope", 4, 4); err != nil {
		return nil, err
	}
	magic, err := top.raw("magic", true, 0, 64)
	if err != nil {
		return nil, err
	}
	if string(magic) != mdMagic {
		return nil, fmt.Errorf("bad magic %q", magic)
	}
	ver, err := top.uint("version")
	if err != nil {
		return nil, err
	}
	if ver != mdVersion {
		return nil, fmt.Errorf("version %d, this build reads %d", ver, mdVersion)
	}
	body, err := top.raw("body", false, 1, maxMetadata)
	if err != nil {
		return nil, err
	}
	sum, err := top.uint("checksum")
	if err != nil {
		return nil, err
	}
	if err := top.end("envelope"); err != nil {
		return nil, err
	}
	if xxhash.Sum64(body) != sum {
		return nil, fmt.Errorf("checksum mismatch")
	}

	b := newMDReader(body)
	if _, err := b.arrayLen("body", 9, 9); err != nil {
		return nil, err
	}
	m := &metadata{}
	if m.Name, err = b.str("name", 1, maxNameLen); err != nil {
		return nil, err
	}
	if m.Host.Boot, err = b.str("boot id", 0, maxBootLen); err != nil {
		return nil, err
	}
	if m.Host.NetNS, err = b.uint("netns"); err != nil {
		return nil, err
	}
	if m.Host.PidNS, err = b.uint("pidns"); err != nil {
		return nil, err
	}
	if m.Pid, err = b.uint("pid"); err != nil {
		return nil, err
	}
	if m.Pid == 0 || m.Pid > maxPid {
		return nil, fmt.Errorf("pid %d out of range", m.Pid)
	}
	if m.Start, err = b.uint("start time"); err != nil {
		return nil, err
	}
	if m.UCX, err = b.uint("ucx version"); err != nil {
		return nil, err
	}
	if m.Worker, err = b.raw("worker address", false, 1, maxWorkerAddr); err != nil {
		return nil, err
	}
	n, err := b.arrayLen("regions", 0, maxRegions)
	if err != nil {
		return nil, err
	}
	m.Region = make([]region, n)
	for i := range m.Region {
		what := fmt.Sprintf("region %d", i)
		if _, err := b.arrayLen(what, 3, 3); err != nil {
			return nil, err
		}
		r := &m.Region[i]
		if r.Addr, err = b.uint(what + " addr"); err != nil {
			return nil, err
		}
		if r.Len, err = b.uint(what + " len"); err != nil {
			return nil, err
		}
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return nil, fmt.Errorf("%s: [%#x,+%d) is empty or wraps", what, r.Addr, r.Len)
		}
		if r.Rkey, err = b.raw(what+" rkey", false, 1, maxRkeyLen); err != nil {
			return nil, err
		}
	}
	if err := b.end("body"); err != nil {
		return nil, err
	}
	// Regions must not overlap: each remote byte belongs to exactly one
	// region, so each transfer range has exactly one rkey.
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return m.Region[idx[a]].Addr < m.Region[idx[b]].Addr })
	for k := 1; k < n; k++ {
		p, q := m.Region[idx[k-1]], m.Region[idx[k]]
		if p.Addr+p.Len > q.Addr {
			return nil, fmt.Errorf("regions [%#x,+%d) and [%#x,+%d) overlap", p.Addr, p.Len, q.Addr, q.Len)
		}
	}
	return m, nil
}
