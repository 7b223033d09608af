package shmview

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/ecxfer/ecxfer/internal/procinfo"
)

// ErrBadAdvert reports advertisement bytes that do not decode.
var ErrBadAdvert = errors.New("shmview: bad advertisement")

// Kind says how a consumer reaches an advertised region.
type Kind uint8

const (
	// KindFile: map the file Path at Offset.
	KindFile Kind = 1
	// KindProc: no file; read the producer's memory with a kernel copy
	// (process_vm_readv) at Base.
	KindProc Kind = 2
	// KindSysV: attach the System V shared memory segment Ino (its shmid)
	// read-only; the region starts at Offset in it. UCX allocates engine
	// regions this way.
	KindSysV Kind = 3
)

func (k Kind) String() string {
	switch k {
	case KindFile:
		return "file"
	case KindProc:
		return "proc"
	case KindSysV:
		return "sysv"
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// Host identifies a kernel and the namespaces a process sees: two processes
// with equal Hosts can open each other's /proc entries and files.
type Host struct {
	Boot  string // /proc/sys/kernel/random/boot_id
	NetNS uint64 // inode of /proc/self/ns/net
	PidNS uint64 // inode of /proc/self/ns/pid
	MntNS uint64 // inode of /proc/self/ns/mnt
}

// LocalHost returns this process's Host.
func LocalHost() (Host, error) {
	boot, err := procinfo.BootID(maxBoot)
	if err != nil {
		return Host{}, fmt.Errorf("shmview: %w", err)
	}
	h := Host{Boot: boot}
	for _, ns := range []struct {
		name string
		dst  *uint64
	}{{"net", &h.NetNS}, {"pid", &h.PidNS}, {"mnt", &h.MntNS}} {
		if *ns.dst, err = procinfo.NSInode(ns.name); err != nil {
			return Host{}, fmt.Errorf("shmview: %w", err)
		}
	}
	return h, nil
}

// Advert is what a producer publishes about its region.
type Advert struct {
	Kind  Kind
	Host  Host
	PID   uint32 // the producer's process
	Start uint64 // its start time (clock ticks after boot): pid plus start names one process
	Base  uint64 // the region's address in the producer; descriptors are relative to it
	Size  uint64 // the region's length
	// KindFile only.
	Path   string
	Offset uint64 // file offset of the region's first byte
	Dev    uint64 // the file's identity, checked after opening Path
	Ino    uint64
	// Notify names the producer's notification socket (NotifyAddr); 0:
	// it has none, notifications go through the engine. The producer
	// picks it; it may also say where the producer's lifeword is
	// (LifeToken, LifeFD).
	Notify uint64
	// NotifyKey is the secret every datagram to that socket starts with.
	// The socket's address is no secret (any local user can list
	// abstract addresses in /proc/net/unix); the key travels only in the
	// metadata, so only a process given it can notify the producer and
	// make it free blocks. Zero exactly when Notify is.
	NotifyKey [NotifyKeyLen]byte
}

// NotifyKeyLen is the length of Advert.NotifyKey.
const NotifyKeyLen = 16

// NotifyAddr is the abstract Unix socket address a producer with process
// id pid receives same-host notifications on. Abstract addresses belong to
// the network namespace, which Host compares.
func NotifyAddr(pid uint32, token uint64) string {
	return fmt.Sprintf("@ecxfer-notify/%d/%016x", pid, token)
}

// The token of a producer with a lifeword (package lifeword) carries the
// word's descriptor in its low 32 bits: lifeTag in the upper 16 of them,
// the descriptor plus one in the lower 16. The advertisement's layout, which
// older consumers decode strictly, stays as it was; they use the token as
// a name only. A token of an older producer is random and matches the tag
// one time in 65,536; the descriptor it names is then refused by
// lifeword.Watch's checks, and the consumer polls the pidfd as before.
const (
	lifeTag   = 0xEC1F
	lifeFDMax = 0xFFFE
)

// LifeToken is a notification socket token from random bits rnd that also
// names descriptor fd, the producer's lifeword; fd < 0 (or too large to
// fit) gives a token without one.
func LifeToken(rnd uint64, fd int) uint64 {
	if fd < 0 || fd > lifeFDMax {
		if rnd&0xFFFF_FFFF>>16 == lifeTag {
			rnd ^= 1 << 16 // not the tag by chance
		}
		return rnd | 1 // never 0: 0 means no socket
	}
	return rnd&^0xFFFF_FFFF | lifeTag<<16 | uint64(fd+1)
}

// LifeID is the id of the producer's lifeword holder (lifeword.Holder.ID)
// when its token names a lifeword (LifeFD): the token's upper 32 bits.
// Producers of older builds put random bits there, which lifeword.Watch
// ignores for a page without an id.
func (a *Advert) LifeID() uint32 { return uint32(a.Notify >> 32) }

// LifeFD is the descriptor of the producer's lifeword its token names, if
// it names one.
func (a *Advert) LifeFD() (int, bool) {
	if a.Notify&0xFFFF_FFFF>>16 != lifeTag || a.Notify&0xFFFF == 0 {
		return 0, false
	}
	return int(a.Notify&0xFFFF) - 1, true
}

const (
	advMagic   = "ECXA"
	advVersion = 2 // 2: NotifyKey
	maxBoot    = 64
	maxPath    = 4096
	advFixed   = 4 + 1 + 1 + 4 + 8*10 + NotifyKeyLen // magic, version, kind, pid, ten u64, key
	// trailer after the advertisement in wrapped metadata
	wrapMagic = "ECXDIRv1"
	wrapTail  = 4 + len(wrapMagic)
)

// Append appends the encoded advertisement to b.
func (a *Advert) Append(b []byte) []byte {
	b = append(b, advMagic...)
	b = append(b, advVersion, byte(a.Kind))
	b = binary.LittleEndian.AppendUint32(b, a.PID)
	for _, v := range [...]uint64{a.Start, a.Base, a.Size, a.Offset, a.Dev, a.Ino,
		a.Host.NetNS, a.Host.PidNS, a.Host.MntNS, a.Notify} {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	b = append(b, a.NotifyKey[:]...)
	b = append(b, byte(len(a.Host.Boot)))
	b = append(b, a.Host.Boot...)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(a.Path)))
	return append(b, a.Path...)
}

// Validate checks the fields an encoder or a decoder must agree on.
func (a *Advert) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrBadAdvert}, args...)...)
	}
	switch {
	case a.Kind != KindFile && a.Kind != KindProc && a.Kind != KindSysV:
		return bad("kind %d", a.Kind)
	case a.PID == 0 || a.PID > 1<<22:
		return bad("pid %d", a.PID)
	case a.Size == 0:
		return bad("empty region")
	case a.Base+a.Size < a.Base:
		return bad("region [%#x, +%d) wraps", a.Base, a.Size)
	case len(a.Host.Boot) == 0 || len(a.Host.Boot) > maxBoot || !printable(a.Host.Boot):
		return bad("boot id %q", a.Host.Boot)
	case (a.Notify == 0) != (a.NotifyKey == [NotifyKeyLen]byte{}):
		return bad("notification socket %#x with key %x", a.Notify, a.NotifyKey)
	}
	if a.Kind == KindProc {
		if a.Path != "" || a.Offset != 0 || a.Dev != 0 || a.Ino != 0 {
			return bad("process advertisement carries file fields")
		}
		return nil
	}
	if a.Kind == KindSysV {
		switch {
		case a.Path != "" || a.Dev != 0:
			return bad("System V advertisement carries a path or device")
		case a.Ino > 1<<31-1:
			return bad("shmid %d", a.Ino)
		case a.Offset+a.Size < a.Offset || a.Offset+a.Size > 1<<62:
			return bad("segment window [%d, +%d)", a.Offset, a.Size)
		}
		return nil
	}
	switch {
	case len(a.Path) == 0 || len(a.Path) > maxPath || a.Path[0] != '/' || strings.IndexByte(a.Path, 0) >= 0:
		return bad("path %q", a.Path)
	case a.Offset+a.Size < a.Offset || a.Offset+a.Size > 1<<62:
		return bad("file window [%d, +%d)", a.Offset, a.Size)
	}
	return nil
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '!' || s[i] > '~' {
			return false
		}
	}
	return true
}

// DecodeAdvert decodes exactly one advertisement. It is strict: unknown
// versions, trailing bytes and inconsistent fields are errors.
func DecodeAdvert(b []byte) (Advert, error) {
	var a Advert
	if len(b) < advFixed+1+2 || string(b[:4]) != advMagic {
		return a, fmt.Errorf("%w: %d bytes, no header", ErrBadAdvert, len(b))
	}
	if b[4] != advVersion {
		return a, fmt.Errorf("%w: version %d", ErrBadAdvert, b[4])
	}
	a.Kind = Kind(b[5])
	a.PID = binary.LittleEndian.Uint32(b[6:])
	var u [10]uint64
	for i := range u {
		u[i] = binary.LittleEndian.Uint64(b[10+8*i:])
	}
	a.Start, a.Base, a.Size, a.Offset, a.Dev, a.Ino = u[0], u[1], u[2], u[3], u[4], u[5]
	a.Host.NetNS, a.Host.PidNS, a.Host.MntNS, a.Notify = u[6], u[7], u[8], u[9]
	copy(a.NotifyKey[:], b[10+8*len(u):])
	rest := b[advFixed:]
	n := int(rest[0])
	if len(rest) < 1+n+2 {
		return Advert{}, fmt.Errorf("%w: boot id truncated", ErrBadAdvert)
	}
	a.Host.Boot = string(rest[1 : 1+n])
	rest = rest[1+n:]
	m := int(binary.LittleEndian.Uint16(rest))
	rest = rest[2:]
	if len(rest) != m {
		return Advert{}, fmt.Errorf("%w: path of %d bytes, %d left", ErrBadAdvert, m, len(rest))
	}
	a.Path = string(rest)
	if err := a.Validate(); err != nil {
		return Advert{}, err
	}
	return a, nil
}

// Wrap returns the engine metadata md with the advertisement appended in a
// trailer that Split recognises. md itself is not modified.
func Wrap(md []byte, a *Advert) []byte {
	out := make([]byte, 0, len(md)+advFixed+3+len(a.Host.Boot)+len(a.Path)+wrapTail)
	out = append(out, md...)
	n := len(out)
	out = a.Append(out)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(out)-n))
	return append(out, wrapMagic...)
}

// Split takes a trailer added by Wrap off metadata. Metadata without one
// comes back whole with a nil advertisement; a trailer that does not decode
// is an error.
func Split(b []byte) ([]byte, *Advert, error) {
	if len(b) < wrapTail || !bytes.HasSuffix(b, []byte(wrapMagic)) {
		return b, nil, nil
	}
	n := uint64(binary.LittleEndian.Uint32(b[len(b)-wrapTail:]))
	if n > uint64(len(b)-wrapTail) {
		return nil, nil, fmt.Errorf("%w: trailer claims %d bytes of %d", ErrBadAdvert, n, len(b)-wrapTail)
	}
	end := len(b) - wrapTail
	a, err := DecodeAdvert(b[end-int(n) : end])
	if err != nil {
		return nil, nil, err
	}
	return b[:end-int(n)], &a, nil
}

// SameHost reports whether h and o are one kernel and one set of
// namespaces.
func (h Host) SameHost(o Host) bool { return h == o }

// Self fills the host and process fields of an advertisement for this
// process.
func Self(a *Advert) error {
	h, err := LocalHost()
	if err != nil {
		return err
	}
	start, err := procinfo.StartTime(os.Getpid())
	if err != nil {
		return fmt.Errorf("shmview: %w", err)
	}
	a.Host, a.PID, a.Start = h, uint32(os.Getpid()), start
	return nil
}

// Alive reports whether the advertised process still runs (the pid exists
// and has the advertised start time).
func (a *Advert) Alive() bool {
	s, err := procinfo.StartTime(int(a.PID))
	return err == nil && s == a.Start
}
