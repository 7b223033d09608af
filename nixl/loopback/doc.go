// Package loopback is a pure-Go nixl.Agent whose peers live in the same
// process.
//
// It exists so that everything above the transfer engine — the reactor, the
// handle table, the transport's semantics — can be tested and measured
// without UCX, without a second process and without cgo. Agents find each
// other through a process-wide registry keyed by name; a "transfer" is a
// memmove between two agents' registered regions.
//
// The backend keeps the properties the layers above rely on, so that tests
// written against it stay honest about the real engines:
//
//   - Completion is asynchronous. PostXfer never copies; the bytes move during
//     a later Progress of the initiator, so the in-progress state is
//     observable and a reactor that forgets to progress is caught.
//   - A transfer's notification reaches the data owner's inbox strictly after
//     the bytes have landed, keyed by the initiator's name.
//   - Descriptors are checked against the regions the peer advertised in its
//     metadata, and metadata is decoded strictly: hostile blobs are refused,
//     never trusted.
//   - Peers can go away: a closed, killed, invalidated or disconnected peer
//     makes transfers end with nixl.ErrRemoteDisconnect.
//
// On top of that it injects faults on demand (FailNext, SetDelay,
// Disconnect, Kill), which the real engines cannot do reproducibly.
//
// Like every nixl.Agent, an Agent is driven by one goroutine. The exceptions
// are the fault-injection methods, which any goroutine may call at any time,
// and the delivery of notifications, which the sending agent performs on its
// own goroutine (the inbox is guarded by a mutex and the receiver's EventFD
// is signalled after the message is queued).
//
// After Close (or Kill) every method fails with ErrClosed, which wraps
// nixl.ErrNotAllowed.
package loopback
