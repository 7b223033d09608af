// Package ring provides the bounded lock-free queue that carries work from
// ecxfer's caller goroutines to its reactor.
//
// Every PostRead hands its handle to a single reactor goroutine locked to an
// OS thread, and so does every release of a READ in flight and every
// control operation (peers, teardown). A mutex or a channel on that path
// would make callers contend on one lock word and park/unpark each other
// through the scheduler; on a two-core machine that cost is of the order of
// a whole transfer request. The MPSC ring here lets a producer claim a place
// with one compare-and-swap (TryPush) and the reactor take a whole batch of
// items per loop turn with no atomic read-modify-write at all (Drain).
// Wake-ups of a sleeping reactor do not travel the ring: the reactor sleeps
// on an eventfd, which a producer writes only when the reactor has said it
// is asleep.
//
// The ring is bounded, with a power-of-two capacity so that a position maps
// to a slot with a mask. Positions are 64-bit counters that never wrap in
// practice; they are compared through differences so that the arithmetic
// would stay correct even if they did. The producer and consumer cursors
// live on separate cache lines, and the memory-ordering argument for each
// publish/acquire pair is written next to the code that relies on it. Drain
// must only ever be called by the one consumer goroutine.
package ring
