// Package shmview gives a consumer a direct, read-only view of a producer's
// block region when both run on one host.
//
// Over shared memory a READ is a memcpy. Doing it inside the transfer
// engine puts every byte through the reactor thread, and with caller
// memory UCX emulates each get by having the producer write the data back
// into the consumer's receive queue, which a dying producer can leave
// wedged for every other peer. Mapping the producer's region instead makes
// a READ a plain copy that any goroutine can do, and a dead producer can
// only ever fail the copies that read its own pages.
//
// The pieces:
//
//   - Find locates the file behind a caller region (vLLM's region is a
//     MAP_SHARED mapping of a /dev/shm file) in /proc/self/maps.
//   - Alloc creates a region as a memfd that peers can map through
//     /proc/<pid>/fd/<fd> (tests use it; the transport's engine-allocated
//     regions are UCX's System V segments, read as direct-sysv).
//   - Advert is what the producer publishes about its region (host, process,
//     file identity, offset, size), appended to the engine's metadata by
//     Wrap and taken off again by Split. DecodeAdvert is strict: the bytes
//     come from the network.
//   - Open maps a peer's file PROT_READ and MAP_SHARED, bounded by the size
//     advertised and checked against the file's real size and identity. A
//     View is reference counted: Close unmaps only once the last copy that
//     acquired it has released it, so a peer can be removed or replaced
//     while copies out of its old mapping are still running. Populate
//     faults in the pages of the peer's blocks (and only those, and of
//     those only the ones its file holds: holes stay holes) up front.
//   - Copy copies with debug.SetPanicOnFault set, so a producer that
//     truncated its file (SIGBUS on the consumer's next touch) costs that
//     copy an error instead of the consumer its life.
package shmview
