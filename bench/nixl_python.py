# NIXL's own Python API on the harness's workloads, for `make bench-nixl`:
# the rows ecxfer's engines are compared with. It is not part of ecxfer.
#
# Usage (in the project's .venv, which has NIXL's wheel):
#   nixl_python.py [--error-mode peer|none] [--duration S] [--warmup S]
#                  [--workloads latency,image] [--json FILE]
#
# Two processes, like the Go harness: this one is the consumer; it starts
# itself again as the producer (--serve), which owns a 128 MiB region of
# blocks and polls its notifications every millisecond (an engine step),
# and swaps metadata with it over a pipe. Both agents are made the way
# vLLM makes its NIXL agent: nixl_agent_config(num_threads=1,
# capture_telemetry=True) (progress thread on, UCX backend with one
# transfer thread) and, with --error-mode none, a UCX backend created with
# ucx_error_handling_mode=none and one thread. Each READ is made, posted and polled to
# DONE through the Python API exactly as vLLM's NIXL transport does
# (make_prepped_xfer, transfer, check_xfer_state until DONE,
# release_xfer_handle). Latency READs carry no notification, image READs
# carry one, as in the Go harness. The first READ of every cell is checked
# byte for byte.
#
# Every process leaves through os._exit: NIXL 1.5.1's wheel crashes in its
# destructors at interpreter exit.
import argparse
import json
import mmap
import os
import select
import subprocess
import sys
import time

import msgpack
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

SMALL, LARGE = 5120, 32768
IMAGE_BLOCKS = 880
LOCAL_BLOCKS = 1024
REMOTE_REGION = 128 << 20
SCATTER_SETS = 64  # as the Go harness's scatterSets


def leave(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_agent(name, error_mode):
    # vLLM's NixlDataTransport: nixl_agent_config(num_threads=1 (its
    # default), capture_telemetry=True), the UCX backend.
    if error_mode == "peer":
        return nixl_agent(name, nixl_agent_config(num_threads=1, capture_telemetry=True))
    agent = nixl_agent(name, nixl_agent_config(backends=[], capture_telemetry=True))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_mode, "num_threads": "1"})
    return agent


def fill(buf, seed):
    # Any pattern the consumer can recompute; block i of byte j.
    rng = np.random.default_rng(seed)
    buf[:] = rng.integers(0, 256, size=buf.shape, dtype=np.uint8)


def serve(error_mode, bs):
    # The pipe to the consumer is a copy of fd 1; anything a library
    # prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    nb = REMOTE_REGION // bs
    agent = make_agent("py-bench-prod-%d" % os.getpid(), error_mode)
    buf = anon_blocks(nb, bs)
    fill(buf, bs)
    base = buf.ctypes.data
    agent.register_memory([(base, nb * bs, 0, "")], "DRAM")
    blocks = [(base + i * bs, bs, 0) for i in range(nb)]
    print("MD", agent.get_agent_metadata().hex(), msgpack.packb(blocks).hex(), file=out, flush=True)
    notifs = 0
    while True:
        for _, msgs in agent.get_new_notifs().items():
            notifs += len(msgs)
        ready, _, _ = select.select([sys.stdin], [], [], 0.001)
        if ready and sys.stdin.readline() == "":
            break
    leave(0)


def anon_blocks(n, bs):
    """An (n, bs) uint8 array on its own anonymous mmap, as the Go side's
    regions are: numpy's own allocator asks for transparent huge pages on
    buffers of 4 MiB and more (MADV_HUGEPAGE), which the Go harness's
    regions do not get, and the comparison would not be like for like."""
    mm = mmap.mmap(-1, n * bs, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype=np.uint8).reshape(n, bs)


def percentile(sorted_ns, q):
    """Nearest rank, as the Go harness's: the smallest sample with at least
    q of them at or below it."""
    if not sorted_ns:
        return float("nan")
    k = max(0, min(len(sorted_ns), -(-round(q * 1000000) * len(sorted_ns) // 1000000)) - 1)
    return sorted_ns[k] / 1000.0


def run_cell(agent, local, remote, rbuf_check, lbuf, bs, nrem, blocks, contiguous, notif,
             duration, warmup, rng):
    # The blocks READs come from, as the Go harness chooses them: one-block
    # READs from anywhere in the producer's region, contiguous ones from a
    # base that moves through it, so neither reads the same cached bytes
    # over and over; scattered ones cycle through SCATTER_SETS random sets.
    if blocks == 1:
        # As many as the region has blocks, and more: 4,096 would be 20 MiB
        # at 5 KiB, which the cache would keep between passes.
        sets = [([k % LOCAL_BLOCKS], [int(y)]) for k, y in enumerate(rng.integers(0, nrem, max(4096, 2 * nrem)))]
    elif contiguous:
        sets = []
        for k in range(max(1, nrem // blocks)):
            r0 = (k * blocks) % (nrem - blocks + 1)
            sets.append((list(range(blocks)), list(range(r0, r0 + blocks))))
    else:
        sets = [(rng.permutation(LOCAL_BLOCKS)[:blocks].tolist(),
                 rng.permutation(nrem)[:blocks].tolist()) for _ in range(SCATTER_SETS)]
    msg = b"session:hash" if notif else b""
    lat = []
    k = 0
    t_start = time.perf_counter()
    measure_from = t_start + warmup
    end = measure_from + duration
    measured_start = None
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        li, ri = sets[k % len(sets)]
        t0 = time.perf_counter_ns()
        h = agent.make_prepped_xfer("READ", local, li, remote, ri, msg)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        t1 = time.perf_counter_ns()
        if state != "DONE":
            raise RuntimeError("READ ended in " + state)
        agent.release_xfer_handle(h)
        if k == 0:
            for a, b in zip(li, ri):
                if not np.array_equal(lbuf[a], rbuf_check(b)):
                    raise RuntimeError("block %d (remote %d) differs" % (a, b))
        k += 1
        if now >= measure_from:
            if measured_start is None:
                measured_start = now
            lat.append(t1 - t0)
    span = time.perf_counter() - (measured_start or end)
    lat.sort()
    n = len(lat)
    return {
        "reads_per_s": n / span if span > 0 else 0.0,
        "gb_per_s": n * blocks * bs / span / 1e9 if span > 0 else 0.0,
        "p50_us": percentile(lat, 0.50),
        "p99_us": percentile(lat, 0.99),
        "reads": n,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--error-mode", choices=["peer", "none"], default="peer")
    ap.add_argument("--duration", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--workloads", default="latency,image")
    ap.add_argument("--json", default="")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.error_mode, args.serve)
    workloads = args.workloads.split(",")
    label = "vLLM defaults (peer)" if args.error_mode == "peer" else "error mode none"
    rows = []
    for bs in (SMALL, LARGE):
        nrem = REMOTE_REGION // bs
        prod = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(bs), "--error-mode", args.error_mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = ""
        while not line.startswith("MD "):  # skip anything a library printed
            line = prod.stdout.readline()
            if line == "":
                raise RuntimeError("the producer exited before its metadata")
        _, md_hex, desc_hex = line.split()
        agent = make_agent("py-bench-cons-%d-%d" % (os.getpid(), bs), args.error_mode)
        lbuf = anon_blocks(LOCAL_BLOCKS, bs)
        base = lbuf.ctypes.data
        agent.register_memory([(base, LOCAL_BLOCKS * bs, 0, "")], "DRAM")
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(base + i * bs, bs, 0) for i in range(LOCAL_BLOCKS)], "DRAM")
        peer = agent.add_remote_agent(bytes.fromhex(md_hex))
        rblocks = [tuple(d) for d in msgpack.unpackb(bytes.fromhex(desc_hex))]
        remote = agent.prep_xfer_dlist(peer, rblocks, "DRAM")
        want = np.zeros((nrem, bs), dtype=np.uint8)
        fill(want, bs)
        rng = np.random.default_rng(7)
        cells = []
        if "latency" in workloads:
            cells.append(("latency", 1, False, False))
        if "image" in workloads:
            cells += [("image", IMAGE_BLOCKS, True, True), ("image", IMAGE_BLOCKS, False, True)]
        for w, blocks, contig, notif in cells:
            r = run_cell(agent, local, remote, lambda i: want[i], lbuf, bs, nrem, blocks, contig,
                         notif, args.duration, args.warmup, rng)
            r.update({"workload": w, "block": bs, "blocks": blocks,
                      "layout": "-" if blocks == 1 else ("contig" if contig else "scatter"),
                      "mode": "nixl-python", "config": label})
            rows.append(r)
        agent.release_dlist_handle(remote)
        agent.release_dlist_handle(local)
        agent.remove_remote_agent(peer)
        prod.stdin.close()
        prod.wait(timeout=30)
    print("NIXL's Python API (nixl %s), %s: %.1f s per cell after %.1f s warm-up"
          % (nixl_version(), label, args.duration, args.warmup))
    print("%9s %7s %9s %8s %10s %8s %8s %8s" % ("workload", "block B", "blk/read", "layout",
                                                 "reads/s", "GB/s", "p50 µs", "p99 µs"))
    for r in rows:
        print("%9s %7d %9d %8s %10.1f %8.2f %8.1f %8.1f" % (
            r["workload"], r["block"], r["blocks"], r["layout"], r["reads_per_s"],
            r["gb_per_s"], r["p50_us"], r["p99_us"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    leave(0)


def nixl_version():
    from importlib.metadata import version
    try:
        return version("nixl-cu12")
    except Exception:
        return "?"


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # report, then leave without the interpreter's exit
        print("nixl_python.py:", repr(e), file=sys.stderr)
        leave(1)
