package ucx

import (
	"bytes"
	"encoding/binary"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/nixl"
)

// UCX statuses the owner's check answers with.
const (
	ucsOK           = 0
	ucsInvalidParam = -5
	ucsInvalidAddr  = -7
)

// Limits of ecx.h, as the wire and its checks use them.
const (
	gatherChunk     = 60 << 10
	gatherReqBytes  = 64 * gatherChunk
	gatherReqRanges = 2048
)

// checkModel is the owner's check as the protocol states it (ecx.h):
// 1..ECX_GATHER_REQ_RANGES ranges, each non-empty and inside one region,
// adding up to bytes, 1..ECX_GATHER_REQ_BYTES.
func checkModel(regions [][2]uint64, ranges []byte, n uint32, bytes uint64) int {
	if n == 0 || n > gatherReqRanges || bytes == 0 || bytes > gatherReqBytes || uint64(len(ranges)) != uint64(n)*16 {
		return ucsInvalidParam
	}
	var sum uint64
	for i := range n {
		a := binary.LittleEndian.Uint64(ranges[16*i:])
		l := binary.LittleEndian.Uint64(ranges[16*i+8:])
		if l == 0 || l > bytes-sum {
			return ucsInvalidParam
		}
		in := false
		for _, r := range regions {
			if a >= r[0] && a-r[0] <= r[1] && l <= r[1]-(a-r[0]) {
				in = true
			}
		}
		if !in {
			return ucsInvalidAddr
		}
		sum += l
	}
	if sum != bytes {
		return ucsInvalidParam
	}
	return ucsOK
}

// FuzzGatherCheck: the owner's check of a request (which comes from the
// network) against its registered memory agrees with the protocol's
// statement of it, whatever the ranges: addresses at and around the
// regions' ends, lengths that overflow, counts that do not match.
func FuzzGatherCheck(f *testing.F) {
	a, err := New(Config{Name: "owner"})
	require.NoError(f, err)
	f.Cleanup(func() { _ = a.Close() })
	bufs := [][]byte{make([]byte, 0), nil}
	for i, n := range []int{1 << 16, 3 << 12} {
		b := mmapBuf(f, n)
		_, err := a.RegisterMem(b, nixl.DRAM, 0)
		require.NoError(f, err)
		bufs[i] = b
	}
	regions := [][2]uint64{{addrOf(bufs[0]), uint64(len(bufs[0]))}, {addrOf(bufs[1]), uint64(len(bufs[1]))}}
	base0, base1 := regions[0][0], regions[1][0]
	f.Add(gatherReq(base0, 4096), uint32(1), uint64(4096), false)
	f.Add(gatherReq(base0, 1<<16), uint32(1), uint64(1<<16), false)
	f.Add(gatherReq(base0+1, 1<<16), uint32(1), uint64(1<<16), false)
	f.Add(gatherReq(base0, 100, base1+5, 200), uint32(2), uint64(300), false)
	f.Add(gatherReq(base1+3<<12, 1), uint32(1), uint64(1), false)
	f.Add(gatherReq(base0-1, 2), uint32(1), uint64(2), false)
	f.Add(gatherReq(base0, 1<<63, base0, 1<<63), uint32(2), uint64(0), false)
	f.Add(gatherReq(base0, 10, base0, 0), uint32(2), uint64(10), false)
	f.Add(gatherReq(base0, 10), uint32(1), uint64(11), false)
	f.Add(gatherReq(0, 4096, 1<<16, 4096), uint32(2), uint64(8192), true)
	f.Fuzz(func(t *testing.T, ranges []byte, n uint32, bytes uint64, near bool) {
		r := append([]byte(nil), ranges...)
		if near {
			// Addresses near the registered regions, so the answers
			// other than "outside" come up: each address's lowest bit
			// picks a region, the rest an offset from 64 KiB before
			// its start to 64 KiB past it.
			for i := 0; i+16 <= len(r); i += 16 {
				v := binary.LittleEndian.Uint64(r[i:])
				base := regions[v&1][0]
				binary.LittleEndian.PutUint64(r[i:], base-(1<<16)+(v>>1)%(1<<17))
			}
		}
		want := checkModel(regions, r, n, bytes)
		got := a.gatherCheck(r, n, bytes)
		if got != want {
			t.Fatalf("check of %d ranges for %d bytes: %d, the protocol says %d", n, bytes, got, want)
		}
	})
}

// planModel is how the protocol cuts a served request's bytes (ranges
// checked, adding up to bytes) into answers of size bytes: the chunks, the
// bytes of those lying in more than one piece of the owner's memory
// (ranges that follow each other there are one piece), and how many lie
// in one.
func planModel(ranges []byte, bytes uint64, size uint32) (nch uint32, copied uint64, zc uint32) {
	type piece struct{ addr, len uint64 }
	var all []piece
	for i := 0; i+16 <= len(ranges); i += 16 {
		all = append(all, piece{binary.LittleEndian.Uint64(ranges[i:]), binary.LittleEndian.Uint64(ranges[i+8:])})
	}
	ri, off := 0, uint64(0)
	for at := uint64(0); at < bytes; at += uint64(size) {
		n := min(uint64(size), bytes-at)
		nch++
		pieces, end := 0, uint64(0)
		for left := n; left > 0; {
			p := all[ri]
			take := min(p.len-off, left)
			if pieces == 0 || p.addr+off != end {
				pieces++
			}
			end = p.addr + off + take
			left -= take
			if off += take; off == p.len {
				ri, off = ri+1, 0
			}
		}
		if pieces > 1 {
			copied += n
		} else {
			zc++
		}
	}
	return nch, copied, zc
}

// FuzzGatherRequest: the owner's handler reads a request's header and
// ranges (from the network) as the protocol states: a header of the wrong
// size is dropped; a ranges length that is not the header's count of
// pairs, a chunk size other than 60 KiB (or 0 for it), or 252 KiB without
// LargeTCPSegments, is refused, as are ranges the check refuses; a served
// request's answers cover its bytes in the chunks the protocol cuts.
func FuzzGatherRequest(f *testing.F) {
	owners := map[bool]*Agent{}
	regions := map[bool][][2]uint64{}
	for _, big := range []bool{false, true} {
		a, err := New(Config{Name: "owner", LargeTCPSegments: big})
		require.NoError(f, err)
		f.Cleanup(func() { _ = a.Close() })
		for _, n := range []int{1 << 20, 3 << 12} {
			b := mmapBuf(f, n)
			_, err := a.RegisterMem(b, nixl.DRAM, 0)
			require.NoError(f, err)
			regions[big] = append(regions[big], [2]uint64{addrOf(b), uint64(n)})
		}
		owners[big] = a
	}
	hdr := func(n, size uint32, bytes uint64) []byte {
		h := make([]byte, 32)
		binary.LittleEndian.PutUint64(h, 7)
		binary.LittleEndian.PutUint64(h[8:], 1<<20)
		binary.LittleEndian.PutUint32(h[16:], n)
		binary.LittleEndian.PutUint32(h[20:], size)
		binary.LittleEndian.PutUint64(h[24:], bytes)
		return h
	}
	f.Add(hdr(1, 0, 4096), gatherReq(0, 4096), false)
	f.Add(hdr(2, gatherChunk, 200<<10), gatherReq(0, 100<<10, 200<<10, 100<<10), false)
	f.Add(hdr(3, 252<<10, 300<<10), gatherReq(0, 100<<10, 100<<10, 100<<10, 300<<10, 100<<10), true)
	f.Add(hdr(1, 252<<10, 4096), gatherReq(0, 4096), false)
	f.Add(hdr(2, 0, 4096), gatherReq(0, 4096), false)
	f.Add(hdr(1, 0, 4096)[:31], gatherReq(0, 4096), false)
	f.Add(hdr(1, 12345, 4096), gatherReq(0, 4096), false)
	f.Fuzz(func(t *testing.T, header, ranges []byte, big bool) {
		a, regs := owners[big], regions[big]
		// Range addresses are offsets into the first region when they
		// fall inside twice its size, so that served requests come up.
		r := append([]byte(nil), ranges...)
		for i := 0; i+16 <= len(r); i += 16 {
			if v := binary.LittleEndian.Uint64(r[i:]); v < 2<<20 {
				binary.LittleEndian.PutUint64(r[i:], regs[0][0]+v)
			}
		}
		dropped, st, nch, copied, zc := a.gatherReqPlan(header, r)
		if len(header) != 32 {
			require.True(t, dropped, "a %d-byte header", len(header))
			return
		}
		require.False(t, dropped)
		n := binary.LittleEndian.Uint32(header[16:])
		size := binary.LittleEndian.Uint32(header[20:])
		bytes := binary.LittleEndian.Uint64(header[24:])
		if size == 0 {
			size = gatherChunk
		}
		want := ucsInvalidParam
		if uint64(len(r)) == uint64(n)*16 && (size == gatherChunk || (size == 252<<10 && big)) {
			want = checkModel(regs, r, n, bytes)
		}
		require.Equal(t, want, st, "request of %d ranges, %d bytes in chunks of %d", n, bytes, size)
		if st != ucsOK {
			return
		}
		wn, wc, wz := planModel(r, bytes, size)
		require.Equal(t, [3]uint64{uint64(wn), wc, uint64(wz)}, [3]uint64{uint64(nch), copied, uint64(zc)},
			"chunks, bytes copied, chunks sent in place")
	})
}

// FuzzGatherAnswers: whatever a producer answers (a hostile or broken
// one), the consumer's handler writes nothing outside the local blocks of
// the READ the answer names, and nothing into them but answer bytes; the
// READ ends or waits, and the agent goes on. With big, the READ is one
// between two agents with LargeTCPSegments, whose answers come in 252 KiB
// chunks (here two: ten 32 KiB blocks); else its answers are 60 KiB.
func FuzzGatherAnswers(f *testing.F) {
	type setup struct {
		g          *gatherPair
		lidx, ridx []int
		inRead     map[int]bool
	}
	mk := func(bs, nb int, cfg Config, lidx, ridx []int) setup {
		s := setup{g: newGatherPairTB(f, bs, nb, cfg), lidx: lidx, ridx: ridx, inRead: map[int]bool{}}
		for _, l := range lidx {
			s.inRead[l] = true
		}
		return s
	}
	small := mk(4096, 64, Config{}, []int{3, 5, 6, 20, 40}, []int{9, 2, 30, 31, 63})
	large := mk(32768, 16, Config{LargeTCPSegments: true}, []int{1, 3, 4, 5, 6, 7, 8, 9, 11, 15}, []int{14, 0, 2, 3, 4, 12, 11, 10, 6, 8})
	hdr := func(id, off uint64, st int32, n uint32) []byte {
		h := make([]byte, 24)
		binary.LittleEndian.PutUint64(h, id)
		binary.LittleEndian.PutUint64(h[8:], off)
		binary.LittleEndian.PutUint32(h[16:], uint32(st))
		binary.LittleEndian.PutUint32(h[20:], n)
		return h
	}
	f.Add(hdr(0, 0, 0, 4096), bytes.Repeat([]byte{1}, 4096), true, false)
	f.Add(hdr(0, 0, 0, 5*4096), bytes.Repeat([]byte{2}, 5*4096), true, false)
	f.Add(hdr(0, 4096, 0, 100), bytes.Repeat([]byte{3}, 100), true, false)
	f.Add(hdr(0, 0, -2, 0), []byte{}, true, false)
	f.Add(hdr(0, 0, -5, 0), []byte{}, true, false)
	f.Add(hdr(7, 0, 0, 4096), bytes.Repeat([]byte{4}, 4096), false, false)
	f.Add([]byte{1, 2, 3}, []byte{9}, true, false)
	f.Add(hdr(0, 0, 0, 252<<10), bytes.Repeat([]byte{5}, 252<<10), true, true)
	f.Add(hdr(0, 252<<10, 0, 68<<10), bytes.Repeat([]byte{6}, 68<<10), true, true)
	f.Add(hdr(0, 60<<10, 0, 60<<10), bytes.Repeat([]byte{7}, 60<<10), true, true)
	f.Fuzz(func(t *testing.T, header, data []byte, ours, big bool) {
		s := small
		if big {
			s = large
		}
		g, lidx, ridx, inRead := s.g, s.lidx, s.ridx, s.inRead
		for i := range g.cbuf {
			g.cbuf[i] = 0xEE
		}
		// A READ whose requests went out and whose producer never
		// answers (it is not progressed): only the injected answers come.
		id := g.read(t, lidx, ridx, nil)
		_, err := g.cons.Progress()
		require.NoError(t, err)
		if ours && len(header) >= 8 {
			// Name the READ in flight (its id is the consumer's last).
			header = append([]byte(nil), header...)
			binary.LittleEndian.PutUint64(header, uint64(g.cons.c.glast))
		}
		g.cons.gatherInject(header, data)
		_, err = g.cons.Progress()
		require.NoError(t, err)
		for b := range g.nb {
			blk := g.cbuf[b*g.bs : (b+1)*g.bs]
			if !inRead[b] {
				if !bytes.Equal(blk, bytes.Repeat([]byte{0xEE}, g.bs)) {
					t.Fatalf("an answer wrote local block %d, which is not the READ's", b)
				}
				continue
			}
			for i, c := range blk {
				if c != 0xEE && !bytes.Contains(data, []byte{c}) {
					t.Fatalf("local block %d byte %d is %#x, which no answer carried", b, i, c)
				}
			}
		}
		require.NoError(t, g.cons.ReleaseXfer(id))
		// The released READ's requests call back: the next READ into
		// the same blocks is not held behind them.
		for range 3 {
			_, err = g.cons.Progress()
			require.NoError(t, err)
		}
	})
}

// newGatherPairTB is newGatherPair for fuzz targets (no t.Setenv there),
// both agents with cfg.
func newGatherPairTB(f *testing.F, bs, nb int, cfg Config) *gatherPair {
	f.Helper()
	old, had := os.LookupEnv("UCX_TLS")
	require.NoError(f, os.Setenv("UCX_TLS", "tcp"))
	defer func() {
		if had {
			_ = os.Setenv("UCX_TLS", old)
		} else {
			_ = os.Unsetenv("UCX_TLS")
		}
	}()
	g := buildGatherPair(f, bs, nb, cfg, cfg)
	// One READ answered, so the endpoint is wired up both ways.
	id := g.read(f, []int{0}, []int{1}, nil)
	require.NoError(f, waitXfer(f, g.cons, id, 10*time.Second, g.prod))
	require.NoError(f, g.cons.ReleaseXfer(id))
	return g
}

// TestGatherRequestPlan: a request FuzzGatherRequest's seeds make, with
// the owner's answer worked out by hand: 300 KiB in three ranges, the
// first two following each other in memory, in 252 KiB chunks: the first
// chunk holds two pieces and is copied, the second is sent in place.
func TestGatherRequestPlan(t *testing.T) {
	a, err := New(Config{Name: "owner", LargeTCPSegments: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, a.Close()) }()
	b := mmapBuf(t, 1<<20)
	_, err = a.RegisterMem(b, nixl.DRAM, 0)
	require.NoError(t, err)
	base := addrOf(b)
	h := make([]byte, 32)
	binary.LittleEndian.PutUint32(h[16:], 3)
	binary.LittleEndian.PutUint32(h[20:], 252<<10)
	binary.LittleEndian.PutUint64(h[24:], 300<<10)
	r := gatherReq(base, 100<<10, base+100<<10, 100<<10, base+300<<10, 100<<10)
	dropped, st, nch, copied, zc := a.gatherReqPlan(h, r)
	require.False(t, dropped)
	require.Equal(t, ucsOK, st)
	require.Equal(t, uint32(2), nch)
	require.Equal(t, uint64(252<<10), copied)
	require.Equal(t, uint32(1), zc)
	// Past the region's end: refused for its address.
	r = gatherReq(base, 100<<10, base+100<<10, 100<<10, base+(1<<20)-50<<10, 100<<10)
	_, st, _, _, _ = a.gatherReqPlan(h, r)
	require.Equal(t, ucsInvalidAddr, st)
	// One byte short of its count of ranges: refused.
	_, st, _, _, _ = a.gatherReqPlan(h, r[:len(r)-1])
	require.Equal(t, ucsInvalidParam, st)
}
