package reactor

import (
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestTableClaimLookupFree(t *testing.T) {
	tab := newTable(300)
	require.Len(t, tab.slots, 512, "capacity rounds up to a power of two")
	h, s := tab.claim()
	require.NotNil(t, s)
	require.NotZero(t, h)
	got, w := tab.lookup(h)
	require.Same(t, s, got)
	require.Equal(t, uint64(stClaimed), wordState(w), "claimed, not yet a handle of a caller")
	require.Equal(t, int64(1), tab.live.Load())

	// A stale generation on the same slot does not match.
	stale := h + uint64(len(tab.slots))
	gs, _ := tab.lookup(stale)
	require.Nil(t, gs)
	z, _ := tab.lookup(0)
	require.Nil(t, z)

	require.True(t, tab.free(s, w))
	require.False(t, tab.free(s, w), "double free")
	gone, _ := tab.lookup(h)
	require.Nil(t, gone)
	require.Equal(t, int64(0), tab.live.Load())
}

func TestTableGenerationsNeverRepeat(t *testing.T) {
	tab := newTable(256)
	seen := map[uint64]bool{}
	for i := 0; i < 10000; i++ {
		h, s := tab.claim()
		require.NotNil(t, s)
		require.False(t, seen[h], "handle %x handed out twice", h)
		seen[h] = true
		_, w := tab.lookup(h)
		require.True(t, tab.free(s, w))
	}
}

// A caller that releases a READ and posts the next gets the slot it just
// freed back (its cache lines are warm), under a new handle; a hint that
// names a slot taken since is passed over.
func TestTableClaimReusesTheSlotFreedLast(t *testing.T) {
	tab := newTable(256)
	ha, a := tab.claim()
	hb, b := tab.claim()
	require.NotSame(t, a, b)
	_, wa := tab.lookup(ha)
	require.True(t, tab.free(a, wa))
	h, s := tab.claim()
	require.Same(t, a, s, "the slot freed last")
	require.NotEqual(t, ha, h, "a new handle")
	old, _ := tab.lookup(ha)
	require.Nil(t, old, "the old handle names nothing")
	got, _ := tab.lookup(h)
	require.Same(t, a, got)

	// The hint is taken once: the next claim probes.
	h2, s2 := tab.claim()
	require.NotSame(t, a, s2)
	require.NotSame(t, b, s2)

	// A hint naming a slot in use (claimed by probing after it was freed).
	tab.hint.Store(1 + uint64(b.idx))
	h3, s3 := tab.claim()
	require.NotNil(t, s3)
	require.NotSame(t, b, s3)
	for _, x := range []uint64{h, hb, h2, h3} {
		s, w := tab.lookup(x)
		require.NotNil(t, s, "handle %x lost", x)
		require.True(t, tab.free(s, w))
	}
	require.Zero(t, tab.live.Load())
}

func TestTableFull(t *testing.T) {
	tab := newTable(256)
	claimed := 0
	for i := 0; i < 1000; i++ {
		if _, s := tab.claim(); s != nil {
			claimed++
		}
	}
	require.Equal(t, 256, claimed, "every slot can be claimed and no more")
	h, s := tab.claim()
	require.Nil(t, s)
	require.Zero(t, h)
}

func TestTableConcurrentClaims(t *testing.T) {
	tab := newTable(1 << 12)
	var wg sync.WaitGroup
	var mu sync.Mutex
	seen := map[uint64]bool{}
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []uint64
			for i := 0; i < 2000; i++ {
				h, s := tab.claim()
				if s == nil {
					continue
				}
				mine = append(mine, h)
				if i%3 == 0 {
					_, w := tab.lookup(h)
					tab.free(s, w)
					mine = mine[:len(mine)-1]
				}
				if len(mine) > 64 {
					s, w := tab.lookup(mine[0])
					require.NotNil(t, s)
					tab.free(s, w)
					mine = mine[1:]
				}
			}
			mu.Lock()
			for _, h := range mine {
				require.False(t, seen[h])
				seen[h] = true
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Equal(t, int64(len(seen)), tab.live.Load())
	for h := range seen {
		s, w := tab.lookup(h)
		require.NotNil(t, s, "live handle lost")
		require.True(t, tab.free(s, w))
	}
	require.Equal(t, int64(0), tab.live.Load())
}

func TestHistogram(t *testing.T) {
	var h Histogram
	require.Zero(t, h.Snapshot().Quantile(0.5))
	for i := 1; i <= 1000; i++ {
		h.Add(durationNS(int64(i) * 1000)) // 1µs .. 1ms
	}
	s := h.Snapshot()
	require.Equal(t, uint64(1000), s.Count())
	p50 := int64(s.Quantile(0.5))
	require.InDelta(t, 500_000, p50, 500_000*0.13, "p50 within a bucket's resolution")
	p99 := int64(s.Quantile(0.99))
	require.InDelta(t, 990_000, p99, 990_000*0.13)
	require.LessOrEqual(t, p50, p99)
	// Out of range: the largest latency counted above 1, the smallest
	// at or below 0 and for NaN; no longer the top bucket (17 minutes).
	lo, hi := s.Quantile(0.0001), s.Quantile(1)
	require.Less(t, hi, 2*time.Millisecond)
	for _, q := range []float64{2, math.Inf(1)} {
		require.Equal(t, hi, s.Quantile(q), "q %v", q)
	}
	for _, q := range []float64{0, -1, math.Inf(-1), math.NaN()} {
		require.Equal(t, lo, s.Quantile(q), "q %v", q)
	}

	// Bucket bounds are monotonic and every value falls in its bucket.
	for _, v := range []int64{0, 1, 7, 8, 9, 15, 16, 17, 1000, 1 << 20, 1<<40 - 1, 1 << 50, -5} {
		i := histIndex(v)
		require.GreaterOrEqual(t, i, 0)
		require.Less(t, i, histBuckets)
		if v >= 0 && v < 1<<40 {
			require.LessOrEqual(t, histLower(i), v, "value %d", v)
			if i+1 < histBuckets {
				require.Greater(t, histLower(i+1), v, "value %d", v)
			}
		}
	}
}

func TestOptions(t *testing.T) {
	o, err := Options{}.withDefaults()
	require.NoError(t, err)
	require.Equal(t, 64, o.BatchSize)
	require.Equal(t, IdleHybrid, o.Idle)
	bad := []Options{
		{BatchSize: -1},
		{Handles: 1 << 25},
		{Handles: 1<<20 + 1},
		{SubmitRing: 1<<20 + 1},
		{SubmitRing: -3},
		{Idle: 9},
		{SpinFor: -1},
		{WaitSpin: -1},
		{PinCPU: true, CPU: -1},
		{BindNUMA: true, NUMANode: -2},
		{MaxNotif: -1},
	}
	for i, b := range bad {
		_, err := b.withDefaults()
		require.ErrorIs(t, err, errUnsupportedOption, "case %d", i)
	}
	for _, s := range []string{"hybrid", "spin", "yield", "park"} {
		v, err := ParseIdle(s)
		require.NoError(t, err)
		require.Equal(t, s, v.String())
	}
	_, err = ParseIdle("busy")
	require.Error(t, err)
}

// A claim fails only when every slot is taken: Options.Handles is the
// number of transfers that can be posted and not yet released.
func TestTableClaimFindsTheLastFreeSlot(t *testing.T) {
	for _, n := range []int{256, 4096} {
		tab := newTable(n)
		for i := 0; i < n; i++ {
			_, s := tab.claim()
			require.NotNil(t, s, "claim %d of %d failed with %d slots free", i+1, n, n-i)
		}
		_, s := tab.claim()
		require.Nil(t, s, "a claim succeeded on a full table")
		require.Equal(t, int64(n), tab.live.Load())
	}
}

// Two tables hand out different handles: one's handle is unknown to the
// other (the C ABI serves several transports in one process). Generations
// start at a random point and wrap without ever making handle 0.
func TestTablesDoNotShareHandles(t *testing.T) {
	a, b := newTable(256), newTable(256)
	ha, sa := a.claim()
	hb, sb := b.claim()
	require.NotNil(t, sa)
	require.NotNil(t, sb)
	require.NotEqual(t, ha, hb)
	s, _ := b.lookup(ha)
	require.Nil(t, s, "a handle of one table names a READ of another")
	s, _ = a.lookup(hb)
	require.Nil(t, s)

	// Across the counter's wrap and the generation's own (bit 63 is never
	// part of a handle): no handle 0, none negative as an int64, none twice.
	for _, start := range []uint64{^uint64(0) - 3, 1<<(63-8) - 3} {
		w := newTable(256)
		w.gen.Store(start)
		seen := map[uint64]bool{}
		for range 10 {
			h, s := w.claim()
			require.NotNil(t, s)
			require.NotZero(t, h)
			require.Less(t, h, uint64(1)<<63, "handle %x does not fit an int64", h)
			require.False(t, seen[h], "handle %x handed out twice across the wrap", h)
			seen[h] = true
			got, word := w.lookup(h)
			require.Equal(t, s, got)
			bad, _ := w.lookup(h | 1<<63)
			require.Nil(t, bad, "a handle with bit 63 set names a READ")
			require.True(t, w.free(s, word))
		}
	}
}

// The pool of large index buffers is the process's and outlives every
// transport: buffers of huge READs are not kept.
func TestIdxPoolKeepsNoHugeBuffers(t *testing.T) {
	var p idxPool
	p.put(make([]int, 0, maxBigIdxLen+1))
	require.Empty(t, p.free, "a buffer longer than maxBigIdxLen was kept")
	p.put(make([]int, 0, maxBigIdxLen))
	require.Len(t, p.free, 1)
	require.Equal(t, maxBigIdxLen, cap(p.get(maxBigIdxLen)), "a kept buffer is reused")
}
