// Package nixl is the contract between ecxfer and its transfer engines: the
// Agent interface, shaped after NIXL's agent API (register memory, exchange
// metadata, prepare descriptor lists, make, post and poll transfers, send
// and receive notifications), and the vocabulary that goes with it
// (Status codes with NIXL's values, MemType, Op, IDs, Span bounds checks).
// It contains no engine and calls no C.
//
// # Three things named after NIXL
//
// Three different things carry the name, and they are kept apart like this:
//
//   - package nixl (this one): the interface. Every engine implements
//     nixl.Agent; the reactor and the transport use nothing else. The name
//     says whose API the interface follows, not what runs underneath.
//   - package nixl/libnixl: one engine, the one that drives the NIXL
//     library itself (through a small C shim loaded at run time), so that
//     ecxfer and vLLM's Python NIXL agents can load each other's metadata.
//     "lib" marks it as the library, as in libnixl.so.
//   - the backend string "nixl" in ecxfer.Config.Backend (and the
//     --backend flag of ecxfer-bench, the "backend" option of libecxfer):
//     a user-facing choice of engine. "nixl" selects nixl/libnixl; "ucx"
//     selects nixl/ucx, ecxfer's own engine over UCX; "loopback" selects
//     nixl/loopback, the in-process engine for tests.
//
// So: code that must work with any engine imports nixl; code that needs the
// NIXL library imports nixl/libnixl; users pick an engine by backend string.
//
// # Engines
//
//   - nixl/ucx: the default engine, UCP directly (cgo).
//   - nixl/libnixl: the NIXL library through its C shim (cgo, dlopen).
//   - nixl/loopback: pure Go, both agents in one process; it isolates the
//     layers above the engine and injects faults, and never stands in for a
//     real engine in a test that claims to test one.
//
// Their shared bookkeeping (region sets, completion queues, argument checks
// and error wording) lives in nixl/internal/enginekit. Only packages under
// nixl/, and cmd/libecxfer (the C ABI for Python), may use cgo.
//
// # Optional interfaces
//
// An engine may implement more than Agent; callers find out with a type
// assertion. NotifDropper reports notifications the engine received and
// threw away (surfaced as ecxfer Stats.NotifsDroppedByEngine).
package nixl
