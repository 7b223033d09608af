// Package reactor is ecxfer's event loop: one goroutine, locked to one OS
// thread and optionally pinned to a CPU, that owns a nixl.Agent and does
// all of its work.
//
// Why one thread: a transfer engine such as UCX is fastest when a single
// thread drives its worker without locks, and the data owner's engine must
// keep progressing for reads of its memory and for its notifications to
// move. So nobody but the reactor touches the agent. Submitters claim a slot
// in a fixed handle table, copy their request into it and push the handle
// onto a lock-free MPSC ring; the reactor drains the ring in batches, makes
// and posts the engine requests, progresses the engine, polls completions
// (one call per turn, however many finished), drains notifications and
// publishes each transfer's end in its slot's atomic state word. Checking a
// transfer is then one atomic load: no lock, no cgo call, no trip through
// the loop. Control operations (peers, teardown) travel the same loop and
// are answered synchronously.
//
// Idle: spinning costs a core and on a 2-core machine starves everything
// else; sleeping costs wake-up latency. The default hybrid strategy spins
// for SpinFor after the last work, yields the CPU until YieldFor, then
// parks in epoll_wait on the engine's event fd and an eventfd that
// submitters write only when the reactor has said it is asleep. A busy
// reactor never sleeps; an idle one costs about nothing.
//
// Handles are (generation, slot) pairs. The slot word carries the
// generation, so a released or reused slot never answers for an old
// handle; see table.go for the layout and the hashing.
package reactor
