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
// two, so that a position maps to its slot with a mask. One slot is enough:
// whether a slot is free is decided from the consumer's head, and whether it
// holds position pos from its sequence number (pos+1), which differs on every
// lap (see mpscSlot).
func roundCapacity(kind string, capacity int) int {
	if capacity <= 0 {
		panic(fmt.Sprintf("ring: New%s capacity must be positive, got %d", kind, capacity))
	}
	if capacity > MaxCapacity {
		panic(fmt.Sprintf("ring: New%s capacity %d exceeds the maximum %d", kind, capacity, MaxCapacity))
	}
	return 1 << bits.Len(uint(capacity-1))
}
