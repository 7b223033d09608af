// Package bench is ecxfer's benchmark harness: it measures the reactor
// transport side by side with the alternatives, in one run, on the same
// engine and the same kind of memory, and says where each stands against
// the machine's physical limit.
//
// Modes, all on the same backend:
//
//   - reactor: ecxfer's Transport. Callers poll CheckXferState (or block in
//     Wait with Config.Wait "block"); the reactor thread owns the engine.
//     The producer is a Transport too, with the hybrid idle strategy by
//     default (Config.ProducerIdle).
//   - locked: the design vLLM's NIXL transport uses, rendered in Go: one
//     sync.Mutex around direct nixl.Agent calls. Posting is MakeXfer and
//     PostXfer under the lock; checking is Progress and XferStatus under the
//     lock (as NIXL's status check progresses the worker); nobody else
//     progresses the engine. Its producer polls notifications under its own
//     lock once per millisecond, like an engine step.
//   - raw: one goroutine driving the nixl.Agent with no concurrency and no
//     lock: the floor of overhead.
//
// References, measured in the same run: single-thread memcpy from a buffer
// far larger than the caches (the copy limit of one core), and UCX's own
// ucx_perftest ucp_get for the same message sizes when it is installed.
//
// Every caller waits the same way in every mode: a burst of back-to-back
// state checks, then one check per runtime.Gosched.
//
// Workloads: latency (one block per READ, one at a time), image (880 blocks
// per READ, contiguous and scattered), fanin (1 to 64 goroutines posting
// 1–16-block READs) and notif (from the reader seeing DONE to the producer
// application seeing the notification, timed with CLOCK_MONOTONIC, which
// both processes share).
//
// The producer runs in a child process (the same binary, re-executed with
// ECXFER_BENCH_ROLE=producer) for the ucx backend, in-process for the
// loopback backend, or on another host behind `ecxfer-bench serve`. The two
// sides talk over internal/ctrl: metadata, mode switches and, for the notif
// workload, the time each notification was seen. Bytes are verified with
// internal/pattern on a sample of reads of every cell.
package bench
