// Command ecxfer-bench measures ecxfer against the alternatives, side by
// side in one run, and prints where each stands against the machine's copy
// limit.
//
// Usage:
//
//	ecxfer-bench run [--workloads latency,image,fanin,notif] [--modes reactor,direct,locked,raw]
//	                 [--backend ucx|loopback|nixl] [--duration D] [--warmup D] [--rounds N]
//	                 [--reactor-cpu N] [--numa-node N] [--idle spin|yield|park|hybrid]
//	                 [--batch N] [--producer reactor|locked|raw] [--producer-idle S]
//	                 [--wait poll|block] [--wait-spin D] [--reactor-only]
//	                 [--copy-workers N] [--inline-bytes N] [--large-tcp-segments]
//	                 [--connect HOST:PORT] [--no-refs] [--json FILE] [--svg FILE]
//	                 [--cpuprofile FILE] [--memprofile FILE] [--quiet]
//	ecxfer-bench serve --listen HOST:PORT [--once] [--backend ucx|nixl] [--metrics-addr HOST:PORT]
//	                   [--handshake-wait D]
//
// run measures each workload×mode cell for --duration, in --rounds rounds
// (default 2) with a --warmup before each, the modes in alternating order.
// Each mode reads from a producer of its own design unless --producer names
// one for every reactor, locked and raw row (direct rows keep theirs). With
// the ucx backend it starts the producer as a child process (this binary,
// re-executed) and swaps metadata with it over a pipe; with loopback both
// sides live in this process, which measures the reactor alone. With
// --connect it reads from a producer started on another host by serve
// (metadata over TCP, data over UCX). serve with --metrics-addr exports the
// producer's metrics (package metrics) on http://HOST:PORT/metrics: those
// of the reactor-mode Transport of the current cell, or of the last one
// once it closed. serve serves one run at a time and drops a client that
// has not sent its first frame within --handshake-wait (30s); --once ends
// after the first run whose client did.
//
// The progress line is drawn only when stderr is a terminal. The end of
// the run reports how much CPU other processes used meanwhile: the reactor
// mode needs two threads running at once (caller and reactor), so on a
// small machine it is the first to suffer from anything else running, and
// a run marked DISTURBED should be repeated on a quiet machine. A producer
// at --connect that runs on the same kernel (make bench-hosts: another
// network namespace) tells its CPU time, which the run reports apart and
// does not count as other processes'.
//
// Modes: reactor is ecxfer's Transport on the engine path; direct is the
// same Transport reading a same-host producer's region directly (copy
// workers, or inline in PostRead for small READs); locked is vLLM's design
// (one mutex around direct engine calls; the producer's engine progressed
// by a goroutine as messages arrive, as NIXL's progress thread does); raw
// is one goroutine driving the engine with no locking, the floor. The
// table compares reads/s and p99 against locked and GB/s against the
// better of one-thread and copy-worker-count memcpy of the same block
// size.
package main
