// Package ring provides the bounded lock-free queues that connect ecxfer's
// caller goroutines to its reactor.
//
// Every PostRead, control operation and wake-up request is handed to a single
// reactor goroutine pinned to an OS thread. A mutex or a channel on that path
// would make callers contend on one lock word and park/unpark each other
// through the scheduler on every submission; on a two-core machine that cost
// dominates a sub-microsecond transfer request. The rings here instead let a
// producer claim a place with one atomic add (MPSC Push), one compare-and-swap
// (MPSC TryPush) or no atomic read-modify-write at all (SPSC), and let the
// reactor take a whole batch of items per loop turn with none either.
//
// Both rings are bounded, with a power-of-two capacity so that a position maps
// to a slot with a mask. Positions are 64-bit counters that never wrap in
// practice; they are compared through signed differences so that the
// arithmetic would stay correct even if they did. Producer and consumer
// cursors live on separate cache lines, and the memory-ordering argument for
// each publish/acquire pair is written next to the code that relies on it.
//
// MPSC is for many submitters and one reactor; SPSC is the cheaper variant
// for a fixed pair of goroutines. In both, Drain must only ever be called by
// the one consumer goroutine.
package ring
