// Package reactor is ecxfer's event loop: one goroutine, locked to one OS
// thread and optionally pinned to a CPU, that owns a nixl.Agent and does
// all of its work (or lets a polling caller do a step of it, one at a
// time: see below).
//
// Why one thread: a transfer engine such as UCX is fastest when a single
// thread drives its worker without locks, and the data owner's engine must
// keep progressing for reads of its memory and for its notifications to
// move. So nobody but the reactor touches the agent (or a caller holding
// the reactor's token in its place). Submitters claim a slot
// in a fixed handle table, copy their request into it and push the handle
// onto a lock-free MPSC ring; the reactor drains the ring in batches, makes
// and posts the engine requests, progresses the engine, polls completions
// (one call per turn, however many finished), drains notifications and
// publishes each transfer's end in its slot's atomic state word. Checking a
// transfer is then one atomic load: no lock, no cgo call, no trip through
// the loop. Control operations (peers, teardown) travel the same loop and
// are answered synchronously.
//
// Callers stepping in (help.go): with an engine that allows being driven
// by any thread one at a time (nixl.AnyThread), "the reactor" is a token
// rather than a thread. The reactor thread holds it except while idle; a
// caller that checks an engine READ in flight takes it if it is free,
// with one compare-and-swap, and runs the engine part of a turn (post
// what is queued, progress, publish what ended) on its own thread: only
// one caller polling one READ (see Options.ReactorOnly for the bounds;
// with many callers a step's thread that lost its CPU would hold up the
// rest). While a caller polls that way in a loop, the reactor thread
// stands aside: it naps, taking no turn while they go on (at most until
// a READ's timeout is due), and its turns leave the engine's progress to
// them, so a caller polling its READ and the engine share one core,
// as with raw engine calls: on a 2-core machine the second core stays
// for the peer's engine. Everything else (cancels, control operations,
// timeouts, the direct path but the ends of its copies) stays with the
// reactor thread.
// Options.ReactorOnly turns it off.
//
// Idle: spinning costs a core and on a 2-core machine starves everything
// else; sleeping costs wake-up latency. The default hybrid strategy spins
// for SpinFor after the last work, yields the CPU until YieldFor, then
// parks in epoll_wait on the engine's event fd and an eventfd that
// submitters write only when the reactor has said it is asleep. A busy
// reactor never sleeps; an idle one costs about nothing.
//
// The direct path (direct.go): a peer on this host whose region this
// process has mapped read-only (or, for anonymous memory, reads with
// process_vm_readv) is read without the engine. A READ of at most
// InlineBytes is copied by the caller inside Post and published DONE
// before Post returns; a larger one goes through the submission ring like
// any READ, and the reactor hands its runs (or, between two block grids,
// its index lists) to the copy workers instead of the engine. A READ is
// published DONE only if the producer is alive after its copy ended: its
// lifeword says so with a load (package lifeword), or else its pidfd with
// a poll. Every notification is sent once, after its READ is
// published DONE: by the caller inside Post for an inline READ when the
// producer's socket takes it at once, otherwise by whoever publishes the
// READ's end: the reactor, or, while the reactor thread sleeps beside
// the copies, the goroutine that copied the last chunk, holding the
// engine token as a caller stepping in does. The reactor keeps what
// must stay serialized: it ends READs on
// cancel, removal, replacement and close; and it watches each direct
// peer's pidfd. Mappings are reference counted, so nothing is unmapped
// under a running copy. A caller that checks a READ still on the copy
// workers copies one chunk that no worker has taken, per check. Notifications between
// direct peers go over a Unix datagram socket of the reactor's instead of
// the engine (notifsock.go): an engine endpoint that carries nothing can
// always be closed.
//
// Handles are (generation, slot) pairs. The slot word carries the
// generation, so a released or reused slot never answers for an old
// handle; see table.go for the layout and the hashing.
//
// Every slot has one owner at a time, and only its owner frees it: the
// Post that claimed it, until the handle is on the submission ring (the
// slot is CLAIMED while Post writes the request, and State and Release
// refuse a CLAIMED handle; on error Post frees exactly the word it set;
// Close leaves such a slot to its Post); then the reactor, until it publishes the end; then the caller
// who releases the handle. A handle released in flight is marked
// canceling and queued on the cancel ring; its slot is freed by the
// reactor as it drains that entry (or, for a direct READ whose copy is
// still running, when the copy ends after the entry was drained), so a
// slot never has two cancel entries queued and the cancel ring, with a
// place per slot, cannot fill.
package reactor
