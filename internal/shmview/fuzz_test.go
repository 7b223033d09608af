package shmview

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func FuzzDecodeAdvert(f *testing.F) {
	a := testAdvert()
	f.Add(a.Append(nil))
	p := Advert{Kind: KindProc, Host: Host{Boot: "b"}, PID: 7, Base: 4096, Size: 10}
	f.Add(p.Append(nil))
	f.Add([]byte("ECXA"))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := DecodeAdvert(b)
		if err != nil {
			if !errors.Is(err, ErrBadAdvert) {
				t.Fatalf("refused with %v, not ErrBadAdvert", err)
			}
			return
		}
		// What decodes re-encodes to the same bytes and validates.
		if !bytes.Equal(got.Append(nil), b) {
			t.Fatalf("re-encoding differs")
		}
		if got.Validate() != nil {
			t.Fatal("decoded advert does not validate")
		}
	})
}

func FuzzSplit(f *testing.F) {
	a := testAdvert()
	f.Add(Wrap([]byte("md"), &a))
	f.Add([]byte("plain metadata"))
	f.Add([]byte("ECXDIRv1"))
	f.Fuzz(func(t *testing.T, b []byte) {
		md, adv, err := Split(b)
		switch {
		case err != nil:
			// Only a blob that ends in the trailer's magic is refused:
			// other metadata is never taken for a broken trailer.
			if !bytes.HasSuffix(b, []byte(wrapMagic)) {
				t.Fatalf("refused %q, which has no trailer: %v", b, err)
			}
		case adv == nil:
			// No trailer: the metadata comes back whole.
			if !bytes.Equal(md, b) {
				t.Fatal("metadata without a trailer came back changed")
			}
		default:
			if !bytes.Equal(Wrap(md, adv), b) {
				t.Fatal("Wrap(Split(b)) != b")
			}
			if adv.Validate() != nil {
				t.Fatal("split advert does not validate")
			}
		}
	})
}

func FuzzParseMapsLine(f *testing.F) {
	f.Add("7f0000000000-7f0000010000 rw-s 00000000 00:1a 42  /dev/shm/a file")
	f.Add("7f0000030000-7f0000040000 rw-s 00000000 00:01 44  /memfd:x (deleted)")
	f.Add("00400000-00452000 r-xp 00000000 08:02 173521")
	f.Fuzz(func(t *testing.T, line string) {
		m, err := parseMapsLine(line)
		if err != nil {
			return
		}
		if m.hi <= m.lo {
			t.Fatalf("accepted empty range %+v", m)
		}
		if strings.ContainsAny(line, "\r\n") || len(line) >= 1<<20 {
			return // not one line of a listing
		}
		// A listing of that one line backs its own range exactly when
		// the mapping is one a consumer may open.
		b, err := findIn(strings.NewReader(line+"\n"), m.lo, m.hi)
		if serr := shareable(m); serr != nil {
			if !errors.Is(err, ErrNoFile) {
				t.Fatalf("unshareable mapping %+v (%v) found: %+v, %v", m, serr, b, err)
			}
			return
		}
		want := Backing{Path: m.path, Offset: m.offset, Dev: m.dev, Ino: m.ino, SysV: isSysV(m)}
		if err != nil || b != want {
			t.Fatalf("mapping %+v: found %+v, %v; want %+v", m, b, err, want)
		}
	})
}
