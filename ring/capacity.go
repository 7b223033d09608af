package ring

import (
	"fmt"
	"math/bits"
)

// MaxCapacity is the largest capacity a ring accepts. Rings are allocated up
// front, so a request beyond this is treated as a programming error rather
// than an attempt to allocate gigabytes of slots.
const MaxCapacity = 1 << 30

// roundCapacity validates a requested capacity and rounds it up to a power of
// two, at least 2. The MPSC ring needs two slots at minimum: with one slot the
// sequence number a producer leaves behind (pos+1) would equal the sequence
// that marks the slot free for the next position, and a full ring would look
// empty to producers. SPSC follows the same rule so both types round alike.
func roundCapacity(kind string, capacity int) int {
	if capacity <= 0 {
		panic(fmt.Sprintf("ring: New%s capacity must be positive, got %d", kind, capacity))
	}
	if capacity > MaxCapacity {
		panic(fmt.Sprintf("ring: New%s capacity %d exceeds the maximum %d", kind, capacity, MaxCapacity))
	}
	if capacity < 2 {
		return 2
	}
	return 1 << bits.Len(uint(capacity-1))
}
