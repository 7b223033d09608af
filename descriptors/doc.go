// Package descriptors describes the blocks of registered memory that a
// producer offers and a consumer reads, and carries those descriptions
// between processes.
//
// A producer advertises its memory as one descriptor per block: an address,
// a length and a device id. vLLM sends that list to its peers as msgpack,
// written by msgspec for the type list[tuple[int, int, int]]: an array of
// 3-element arrays [addr, len, dev], every integer in its smallest unsigned
// encoding. ecxfer peers talk to vLLM's Python agents, so Encode produces
// exactly those bytes and Decode reads them back.
//
// The bytes come from another process and are not trusted. Decode accepts
// only that shape, checks every value (no zero lengths, no address ranges
// that wrap around), refuses a declared element count it cannot back with
// input or that exceeds a limit before allocating anything, and never
// panics; each failure names the element and field at fault.
//
// The index helpers (ValidateIndices, MergeRuns) check a READ's local and
// remote block indices against both descriptor lists and fold runs of
// blocks that are contiguous on both sides into single ranges, so a
// transfer of hundreds of blocks becomes a handful of copies.
package descriptors
