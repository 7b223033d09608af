// Package bench is ecxfer's benchmark harness: it measures the reactor
// transport side by side with the alternatives, in one run, on the same
// engine and the same kind of memory, and says where each stands against
// the machine's physical limit.
//
// Modes, all on the same backend:
//
//   - reactor: ecxfer's Transport on its engine path (Direct off). Callers
//     poll CheckXferState (or block in Wait with Config.Wait "block"); the
//     reactor thread owns the engine. The producer is a Transport too,
//     with the hybrid idle strategy by default (Config.ProducerIdle).
//   - direct: ecxfer's Transport as a same-host consumer gets it by
//     default: memory copies from the producer's mapped region, inline in
//     PostRead or on the copy workers.
//   - locked: the design vLLM's NIXL transport uses, rendered in Go: one
//     sync.Mutex around direct nixl.Agent calls. Posting is MakeXfer and
//     PostXfer under the lock; checking is Progress and XferStatus under the
//     lock (as NIXL's status check progresses the worker). Its producer
//     takes notifications under its own lock once per millisecond, like an
//     engine step, and a goroutine progresses its engine under that lock
//     as messages arrive, as NIXL's progress thread does.
//   - raw: one goroutine driving the nixl.Agent with no concurrency and no
//     lock: the floor of overhead.
//
// References, measured in the same run: memcpy on one thread and on two
// from a buffer far larger than the caches (the copy limits of one core
// and of the machine's two), whole rounds and block by block, and UCX's own
// ucx_perftest ucp_get for the same message sizes when it is installed.
//
// Callers wait the same way in every mode: a burst of back-to-back state
// checks, then one check per runtime.Gosched (with Config.Wait "block",
// reactor and direct callers block in Transport.Wait instead, which checks
// for Config.Reactor.WaitSpin before it sleeps).
//
// Each cell's Duration is split into Config.Rounds rounds; the modes run
// in turn within a round, in reverse order every other round, and each row
// merges its rounds, so that a drift of the machine's speed falls on every
// mode alike.
//
// Workloads: latency (one block per READ, one at a time), image (880 blocks
// per READ, contiguous and scattered), fanin (1 to 64 goroutines posting
// 1–16-block READs) and notif (from the post to the producer application
// seeing the READ's notification, timed with CLOCK_MONOTONIC, which both
// processes share).
//
// The producer runs in a child process (the same binary, re-executed with
// ECXFER_BENCH_ROLE=producer) for the ucx backend, in-process for the
// loopback backend, or on another host behind `ecxfer-bench serve`. The two
// sides talk over internal/ctrl: metadata, mode switches and, for the notif
// workload, the time each notification was seen. Bytes are verified with
// internal/pattern on a sample of reads of every cell.
package bench
