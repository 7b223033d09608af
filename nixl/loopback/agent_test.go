package loopback

import (
	"errors"
	"strings"
	"testing"

	"github.com/ecxfer/ecxfer/descriptors"
	"github.com/ecxfer/ecxfer/nixl"
)

func TestNewNames(t *testing.T) {
	tests := []struct {
		name string
		want error // nil: accepted
	}{
		{"producer", nil},
		{"a b-c_d.e:1", nil},
		{"é編碼器", nil},
		{strings.Repeat("x", MaxNameLen), nil},
		{"", nixl.ErrInvalidParam},
		{strings.Repeat("x", MaxNameLen+1), nixl.ErrInvalidParam},
		{"tab\there", nixl.ErrInvalidParam},
		{"nul\x00", nixl.ErrInvalidParam},
		{"bad\xffutf8", nixl.ErrInvalidParam},
		{"newline\n", nixl.ErrInvalidParam},
	}
	for _, tc := range tests {
		a, err := New(tc.name)
		if tc.want == nil {
			if err != nil {
				t.Errorf("New(%q): %v", tc.name, err)
				continue
			}
			if a.Name() != tc.name {
				t.Errorf("Name() = %q, want %q", a.Name(), tc.name)
			}
			must(t, a.Close())
			continue
		}
		if !errors.Is(err, tc.want) || a != nil {
			t.Errorf("New(%q) = %v, %v; want %v", tc.name, a, err, tc.want)
		}
	}
}

func TestNewDuplicateAndIncarnation(t *testing.T) {
	a, err := New("dup")
	must(t, err)
	_, err = New("dup")
	mustIs(t, err, nixl.ErrNotAllowed)
	if got := LiveAgents(); len(got) != 1 || got[0] != "dup" {
		t.Fatalf("LiveAgents() = %q", got)
	}
	must(t, a.Close())
	b, err := New("dup") // the name is free again
	must(t, err)
	defer b.Close()
	if b.Incarnation() <= a.Incarnation() {
		t.Fatalf("incarnation %d after %d", b.Incarnation(), a.Incarnation())
	}
}

func TestCloseIdempotentAndClosedErrors(t *testing.T) {
	a, err := New("closer")
	must(t, err)
	if a.EventFD() < 0 {
		t.Fatal("no eventfd")
	}
	must(t, a.Close())
	must(t, a.Close())
	if len(LiveAgents()) != 0 {
		t.Fatalf("still registered: %q", LiveAgents())
	}
	if a.Name() != "closer" {
		t.Fatalf("Name() after Close = %q", a.Name())
	}
	if a.EventFD() != -1 {
		t.Fatalf("EventFD() after Close = %d", a.EventFD())
	}
	calls := map[string]error{}
	_, calls["RegisterMem"] = a.RegisterMem(make([]byte, 8), nixl.DRAM, 0)
	_, _, calls["AllocMem"] = a.AllocMem(8, nixl.DRAM, 0)
	calls["DeregisterMem"] = a.DeregisterMem(1)
	_, calls["LocalMetadata"] = a.LocalMetadata()
	_, calls["LoadRemoteMetadata"] = a.LoadRemoteMetadata(nil)
	calls["InvalidateRemoteMetadata"] = a.InvalidateRemoteMetadata("x")
	_, calls["PrepDlist"] = a.PrepDlist("", nil, nixl.DRAM)
	calls["ReleaseDlist"] = a.ReleaseDlist(1)
	_, calls["MakeXfer"] = a.MakeXfer(nixl.Read, 1, []int{0}, 2, []int{0}, nil)
	calls["PostXfer"] = a.PostXfer(1)
	_, calls["XferStatus"] = a.XferStatus(1)
	calls["ReleaseXfer"] = a.ReleaseXfer(1)
	calls["SendNotif"] = a.SendNotif("x", []byte("m"))
	_, calls["Progress"] = a.Progress()
	_, calls["Arm"] = a.Arm()
	for name, err := range calls {
		if !errors.Is(err, ErrClosed) || !errors.Is(err, nixl.ErrNotAllowed) {
			t.Errorf("%s after Close: %v, want ErrClosed", name, err)
		}
	}
	if n := a.PollCompletions(make([]nixl.Completion, 1)); n != 0 {
		t.Errorf("PollCompletions after Close = %d", n)
	}
	if n := a.GetNotifs(map[string][][]byte{}); n != 0 {
		t.Errorf("GetNotifs after Close = %d", n)
	}
}

func TestMemory(t *testing.T) {
	a := newAgent(t, "mem")
	heap := make([]byte, 4096)

	t.Run("register", func(t *testing.T) {
		id, err := a.RegisterMem(heap, nixl.DRAM, 0)
		must(t, err)
		if id == 0 {
			t.Fatal("zero MemID")
		}
		_, err = a.RegisterMem(heap[100:200], nixl.DRAM, 0)
		mustIs(t, err, nixl.ErrInvalidParam) // overlaps
		_, err = a.RegisterMem(heap, nixl.DRAM, 0)
		mustIs(t, err, nixl.ErrInvalidParam) // twice
		must(t, a.DeregisterMem(id))
		mustIs(t, a.DeregisterMem(id), nixl.ErrNotFound)
	})

	t.Run("hostile", func(t *testing.T) {
		tests := []struct {
			name string
			err  error
			want error
		}{
			{"register empty", func() error { _, err := a.RegisterMem(nil, nixl.DRAM, 0); return err }(), nixl.ErrInvalidParam},
			{"register VRAM", func() error { _, err := a.RegisterMem(heap, nixl.VRAM, 0); return err }(), nixl.ErrNotSupported},
			{"register bad type", func() error { _, err := a.RegisterMem(heap, nixl.MemType(9), 0); return err }(), nixl.ErrInvalidParam},
			{"alloc zero", func() error { _, _, err := a.AllocMem(0, nixl.DRAM, 0); return err }(), nixl.ErrInvalidParam},
			{"alloc negative", func() error { _, _, err := a.AllocMem(-1, nixl.DRAM, 0); return err }(), nixl.ErrInvalidParam},
			{"alloc VRAM", func() error { _, _, err := a.AllocMem(64, nixl.VRAM, 0); return err }(), nixl.ErrNotSupported},
			{"alloc huge", func() error { _, _, err := a.AllocMem(1<<62, nixl.DRAM, 0); return err }(), nixl.ErrBackend},
			{"deregister zero", a.DeregisterMem(0), nixl.ErrNotFound},
			{"deregister unknown", a.DeregisterMem(12345), nixl.ErrNotFound},
		}
		for _, tc := range tests {
			if !errors.Is(tc.err, tc.want) {
				t.Errorf("%s: %v, want %v", tc.name, tc.err, tc.want)
			}
		}
	})

	t.Run("alloc", func(t *testing.T) {
		id, buf, err := a.AllocMem(3*4096, nixl.DRAM, 0)
		must(t, err)
		if len(buf) != 3*4096 {
			t.Fatalf("len %d", len(buf))
		}
		for i := range buf {
			buf[i] = byte(i) // writable
		}
		// A prepared list pins the region.
		d, err := a.PrepDlist("", descriptors.List{{Addr: nixl.Addr(buf) + 10, Len: 100}}, nixl.DRAM)
		must(t, err)
		mustIs(t, a.DeregisterMem(id), nixl.ErrNotAllowed)
		must(t, a.ReleaseDlist(d))
		must(t, a.DeregisterMem(id))
	})
}

func TestPrepDlist(t *testing.T) {
	p := newSide(t, "prep-p")
	c := newSide(t, "prep-c")
	link(t, c, p)
	base := nixl.Addr(p.buf)
	size := uint64(len(p.buf))
	cbase := nixl.Addr(c.buf)

	tests := []struct {
		name  string
		peer  string
		descs descriptors.List
		mem   nixl.MemType
		want  error
	}{
		{"local whole", "", descriptors.List{{Addr: cbase, Len: size}}, nixl.DRAM, nil},
		{"local empty list", "", nil, nixl.DRAM, nil},
		{"local last byte", "", descriptors.List{{Addr: cbase + size - 1, Len: 1}}, nixl.DRAM, nil},
		{"local one past", "", descriptors.List{{Addr: cbase + size - 1, Len: 2}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"local before", "", descriptors.List{{Addr: cbase - 1, Len: 1}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"local zero len", "", descriptors.List{{Addr: cbase, Len: 0}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"local wraps", "", descriptors.List{{Addr: cbase, Len: ^uint64(0)}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"local peer's memory", "", descriptors.List{{Addr: base, Len: 1}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"local VRAM", "", descriptors.List{{Addr: cbase, Len: 1}}, nixl.VRAM, nixl.ErrNotSupported},
		{"remote whole", "prep-p", descriptors.List{{Addr: base, Len: size}}, nixl.DRAM, nil},
		{"remote blocks", "prep-p", p.descs, nixl.DRAM, nil},
		{"remote one past", "prep-p", descriptors.List{{Addr: base + size, Len: 1}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"remote straddles end", "prep-p", descriptors.List{{Addr: base + 8, Len: size}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"remote own memory", "prep-p", descriptors.List{{Addr: cbase, Len: 1}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"remote zero len", "prep-p", descriptors.List{{Addr: base, Len: 0}}, nixl.DRAM, nixl.ErrInvalidParam},
		{"remote bad type", "prep-p", descriptors.List{{Addr: base, Len: 1}}, nixl.MemType(7), nixl.ErrInvalidParam},
		{"unknown peer", "nobody", descriptors.List{{Addr: base, Len: 1}}, nixl.DRAM, nixl.ErrNotFound},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			id, err := c.a.PrepDlist(tc.peer, tc.descs, tc.mem)
			if tc.want != nil {
				mustIs(t, err, tc.want)
				if id != 0 {
					t.Fatalf("id %d on error", id)
				}
				return
			}
			must(t, err)
			if id == 0 {
				t.Fatal("zero DlistID")
			}
			must(t, c.a.ReleaseDlist(id))
			mustIs(t, c.a.ReleaseDlist(id), nixl.ErrNotFound)
		})
	}
	mustIs(t, c.a.ReleaseDlist(0), nixl.ErrNotFound)
	mustIs(t, c.a.ReleaseDlist(999999), nixl.ErrNotFound)
}

func TestPrepDlistCopiesInput(t *testing.T) {
	p := newSide(t, "copy-p")
	c := newSide(t, "copy-c")
	descs := append(descriptors.List(nil), p.descs...)
	link(t, c, p)
	d, err := c.a.PrepDlist("copy-p", descs, nixl.DRAM)
	must(t, err)
	descs[0].Addr = 1 // the caller's slice is not the agent's
	x, err := c.a.MakeXfer(nixl.Read, c.dlocal, []int{0}, d, []int{0}, nil)
	must(t, err)
	must(t, c.a.PostXfer(x))
	must(t, waitDone(t, c.a, x))
}
