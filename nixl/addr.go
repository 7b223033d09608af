package nixl

import "unsafe"

// DefaultMaxNotif is the notification size limit every engine and the
// reactor use when none is configured: 64 KiB. Engines send notifications
// eagerly and the receiver copies each one; the limit keeps that copy small.
const DefaultMaxNotif = 64 << 10

// Addr returns the address of b's first byte as engines and metadata carry
// it: the value registered with RegisterMem and named by descriptors. It
// is 0 for a nil slice. b must live outside the Go heap (see Agent) for the
// address to stay meaningful.
func Addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }
