package shmview

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/ecxfer/ecxfer/nixl"
	"golang.org/x/sys/unix"
)

// ErrNoFile reports a region that is not backed by a file a peer could
// open: anonymous or private memory, a deleted file, or a range that spans
// several mappings that are not one contiguous window of one file.
var ErrNoFile = errors.New("shmview: region has no shareable backing file")

// Backing is the file behind a region: the region's first byte is at
// Offset in the file named Path, whose identity is (Dev, Ino).
type Backing struct {
	SysV   bool // a System V segment: Ino is its shmid, Path means nothing
	Path   string
	Offset uint64
	Dev    uint64 // as stat reports it (unix.Mkdev(major, minor))
	Ino    uint64
}

// mapsPath is read by Find; a variable for tests.
var mapsPath = "/proc/self/maps"

// Find returns the file that backs region through MAP_SHARED mappings of
// this process. The whole region must lie in mappings of one file that are
// contiguous in memory and in the file.
func Find(region []byte) (Backing, error) {
	if len(region) == 0 {
		return Backing{}, fmt.Errorf("%w: empty region", ErrNoFile)
	}
	f, err := os.Open(mapsPath)
	if err != nil {
		return Backing{}, fmt.Errorf("shmview: %w", err)
	}
	defer f.Close()
	start := nixl.Addr(region)
	return findIn(f, start, start+uint64(len(region)))
}

// mapping is one parsed line of a maps file.
type mapping struct {
	lo, hi  uint64
	shared  bool
	offset  uint64
	dev     uint64
	ino     uint64
	path    string
	deleted bool
}

// findIn scans a maps listing for [lo, hi).
func findIn(r io.Reader, lo, hi uint64) (Backing, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	var b Backing
	var next uint64 // the address the next mapping must start at; 0: not started
	var nextOff uint64
	for sc.Scan() {
		m, err := parseMapsLine(sc.Text())
		if err != nil {
			return Backing{}, err
		}
		if next == 0 {
			if lo < m.lo || lo >= m.hi {
				continue
			}
			if err := shareable(m); err != nil {
				return Backing{}, err
			}
			b = Backing{Path: m.path, Offset: m.offset + (lo - m.lo), Dev: m.dev, Ino: m.ino, SysV: isSysV(m)}
		} else {
			if m.lo != next || m.dev != b.Dev || m.ino != b.Ino || m.offset != nextOff {
				return Backing{}, fmt.Errorf("%w: region [%#x, %#x) spans mappings that are not one window of %s", ErrNoFile, lo, hi, b.Path)
			}
			if err := shareable(m); err != nil {
				return Backing{}, err
			}
		}
		if hi <= m.hi {
			return b, nil
		}
		next = m.hi
		nextOff = m.offset + (m.hi - m.lo)
	}
	if err := sc.Err(); err != nil {
		return Backing{}, fmt.Errorf("shmview: reading maps: %w", err)
	}
	if next == 0 {
		return Backing{}, fmt.Errorf("%w: [%#x, %#x) is not mapped", ErrNoFile, lo, hi)
	}
	return Backing{}, fmt.Errorf("%w: region [%#x, %#x) ends past the mappings of %s", ErrNoFile, lo, hi, b.Path)
}

func shareable(m mapping) error {
	switch {
	case !m.shared:
		return fmt.Errorf("%w: private mapping", ErrNoFile)
	case m.ino == 0 || !strings.HasPrefix(m.path, "/"):
		return fmt.Errorf("%w: anonymous mapping %q", ErrNoFile, m.path)
	case m.deleted && !isSysV(m):
		return fmt.Errorf("%w: %s was deleted", ErrNoFile, m.path)
	}
	return nil
}

// isSysV reports a System V shared memory segment: the kernel names them
// "/SYSV<key in hex>" and, once removed (UCX removes its segments as soon
// as they are attached), "(deleted)"; the inode is the shmid.
func isSysV(m mapping) bool {
	return strings.HasPrefix(m.path, "/SYSV") && len(m.path) == 13
}

// parseMapsLine parses "lo-hi perms offset major:minor inode [path]".
func parseMapsLine(line string) (mapping, error) {
	bad := func() (mapping, error) {
		return mapping{}, fmt.Errorf("shmview: bad maps line %q", line)
	}
	var m mapping
	fields := strings.Fields(line)
	if len(fields) < 5 {
		return bad()
	}
	rng, perms, off, dev, ino := fields[0], fields[1], fields[2], fields[3], fields[4]
	a, z, ok := strings.Cut(rng, "-")
	if !ok {
		return bad()
	}
	var err1, err2, err3, err4 error
	m.lo, err1 = strconv.ParseUint(a, 16, 64)
	m.hi, err2 = strconv.ParseUint(z, 16, 64)
	m.offset, err3 = strconv.ParseUint(off, 16, 64)
	m.ino, err4 = strconv.ParseUint(ino, 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil || m.hi <= m.lo || len(perms) != 4 {
		return bad()
	}
	m.shared = perms[3] == 's'
	maj, mino, ok := strings.Cut(dev, ":")
	if !ok {
		return bad()
	}
	ma, err1 := strconv.ParseUint(maj, 16, 32)
	mi, err2 := strconv.ParseUint(mino, 16, 32)
	if err1 != nil || err2 != nil {
		return bad()
	}
	m.dev = unix.Mkdev(uint32(ma), uint32(mi))
	// The path is everything after the inode field, spaces included.
	rest := line
	for range 5 {
		rest = strings.TrimLeft(rest, " \t")
		i := strings.IndexAny(rest, " \t")
		if i < 0 {
			rest = ""
			break
		}
		rest = rest[i:]
	}
	m.path = strings.TrimLeft(rest, " \t")
	if p, ok := strings.CutSuffix(m.path, " (deleted)"); ok {
		m.path, m.deleted = p, true
	}
	return m, nil
}
