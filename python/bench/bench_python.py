"""make bench-python: ecxfer from Python, side by side with NIXL's Python
API driven the way vLLM drives it, in one invocation.

A consumer process READs from a producer process, both Python, over UCX on
this host, with the harness's workloads: 1 block of 5,120 B; 880 blocks of
5,120 B contiguous and scattered; 880 blocks of 32 KiB; and 1 block again,
one READ every 2 ms, as vLLM's scheduler makes them once per engine step
(each call then comes to a process idle since the last). For each it reports
p50/p99 post->DONE (post_read, then check_xfer_state in a loop until DONE,
as vLLM's step loop would if it never slept) and the cost of one post_read
and one check_xfer_state call (on the 2 ms row, each check 2 ms after the
last call too). Every READ carries a "{session}:{mm_hash}"
notification, which the producer drains once per 1 ms step, as vLLM's
does. Each workload's READs cycle
through NSETS block sets spread over the producer's region (contiguous ones
from moving offsets, scattered ones at random), the same sets for both
implementations, and every set is verified byte for byte (every block
carries its own index) before the timed READs.

ecxfer runs with its defaults, where the consumer copies from the
producer's mapped /dev/shm file itself (inside post_read up to inline_bytes,
on its copy workers above). Its UCX engine path (direct="off") refuses a
producer's own /dev/shm region over shared memory (see Config.Direct in the
Go package), so it has no row here.
Both get the indices as vLLM passes them, Python lists built right before
the call (NIXL under vLLM's lock, with make_prepped_xfer + transfer as its
post_read does); the cost of ecxfer's post_read given one array('q')
instead, which it reads in place, and given lists built long before,
whose ints are out of the cache, and given fresh lists through its
general path (struct.pack in Python, what lists cost before the C reader
of cmd/libecxfer/pycalls.c), is reported too.

Runs in the project's .venv (NIXL's wheel comes from requirements-nixl.txt);
without NIXL its rows say they were skipped and why.
"""

import argparse
import array
import atexit
import base64
import ctypes
import json
import mmap
import os
import random
import select
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

WORKLOADS = [
    # name, block size, blocks per READ, layout, pause between READs (s)
    ("1 block", 5120, 1, "-", 0),
    # One READ per engine step, as vLLM's scheduler posts them: each call
    # comes to a process that has been idle since the last step.
    ("1 block/2ms", 5120, 1, "-", 0.002),
    ("880 contig", 5120, 880, "contig", 0),
    ("880 scatter", 5120, 880, "scatter", 0),
    ("880 x 32KiB", 32768, 880, "contig", 0),
]
NUM_BLOCKS = {5120: 4096, 32768: 2048}
NSETS = 32  # block sets a multi-block workload's READs cycle through


def pattern(seed: int, block: int, size: int) -> bytes:
    """A block's bytes: its index first, so no block passes for another."""
    base = bytes(((block * 131 + seed + 7 * j) & 0xFF) for j in range(256))
    return (struct.pack("<QQ", seed, block) + base * (size // 256 + 1))[:size]


class Region:
    """A MAP_SHARED /dev/shm file, like vLLM's EC region."""

    def __init__(self, size):
        self.path = f"/dev/shm/vllm_ec_bench-{os.getpid()}-{uuid.uuid4().hex[:8]}.mmap"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        os.close(fd)
        # The file stays until leave(), as vLLM's region file stays while
        # its engine runs: a same-host consumer maps it by its path. (An
        # unlinked file can only be read through the kernel,
        # process_vm_readv, which is another, slower path.)
        _REGIONS.append(self.path)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))


_REGIONS: list[str] = []


def _unlink_regions():
    for path in _REGIONS:
        try:
            os.unlink(path)
        except OSError:
            pass


atexit.register(_unlink_regions)  # a run that fails; leave() on success


def say(**msg):
    sys.stdout.write("@@ " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def leave(code=0):
    _unlink_regions()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NIXL 1.5.1's wheel crashes in its destructors at exit


# -- the two implementations, with vLLM's calls -----------------------------


class EcxferSide:
    name = "ecxfer"

    def __init__(self, agent, region, nb, bs):
        from ecxfer import EcxferDataTransport

        self.t = EcxferDataTransport(
            agent_name=agent, base_ptr=region.addr, num_blocks=nb, block_size_bytes=bs, total_size_bytes=nb * bs
        )

    def blobs(self):
        return self.t.get_agent_metadata(), self.t.get_mem_descriptor()

    def add_peer(self, md, desc):
        return self.t.add_remote_peer(md, desc)

    def indices(self, idx):
        return list(idx)  # as vLLM passes them

    def post_read(self, local, peer, remote, notif):
        return self.t.post_read(local, peer, remote, notif)

    def check(self, h):
        return self.t.check_xfer_state(h)

    def wait(self, h):
        return self.t.wait(h, 30)

    def release(self, h):
        self.t.release_xfer_handle(h)

    def serve(self):
        while True:  # vLLM's producer drains once per engine step
            self.t.get_new_notifs()
            time.sleep(0.001)


class NixlSide:
    """NIXL's Python API the way vLLM's NixlDataTransport drives it."""

    name = "nixl"

    def __init__(self, agent, region, nb, bs):
        from nixl._api import nixl_agent, nixl_agent_config

        # As vLLM's NixlDataTransport makes its agent: num_threads its
        # default of 1, telemetry captured (the UCX backend by default).
        self.a = nixl_agent(agent, nixl_agent_config(num_threads=1, capture_telemetry=True))
        self.a.register_memory([(region.addr, nb * bs, 0, "")], "DRAM", backends=["UCX"])
        self.blocks = [(region.addr + i * bs, bs, 0) for i in range(nb)]
        self.local = self.a.prep_xfer_dlist("NIXL_INIT_AGENT", self.blocks, "DRAM", backends=["UCX"])
        self.lock = threading.Lock()
        self.remote = {}

    def blobs(self):
        import msgpack

        return self.a.get_agent_metadata(), msgpack.packb(self.blocks)

    def add_peer(self, md, desc):
        import msgpack

        with self.lock:
            peer = self.a.add_remote_agent(md)
            peer = peer.decode() if isinstance(peer, bytes) else peer
            blocks = [tuple(d) for d in msgpack.unpackb(desc)]
            self.remote[peer] = self.a.prep_xfer_dlist(peer, blocks, "DRAM", backends=["UCX"])
        return peer

    def indices(self, idx):
        return list(idx)

    def post_read(self, local, peer, remote, notif):
        if len(local) != len(remote):
            raise ValueError("mismatch")
        rh = self.remote[peer]
        with self.lock:
            h = self.a.make_prepped_xfer("READ", self.local, local, rh, remote, notif_msg=notif)
            self.a.transfer(h)
        return h

    def check(self, h):
        with self.lock:
            return self.a.check_xfer_state(h)

    def release(self, h):
        with self.lock:
            self.a.release_xfer_handle(h)

    def serve(self):
        while True:  # vLLM's producer drains once per engine step
            with self.lock:
                self.a.get_new_notifs()
            time.sleep(0.001)


SIDES = {"ecxfer": EcxferSide, "nixl": NixlSide}


# -- roles --------------------------------------------------------------------


def producer(impl, bs):
    nb = NUM_BLOCKS[bs]
    region = Region(nb * bs)
    for i in range(nb):
        region.mm[i * bs : (i + 1) * bs] = pattern(bs, i, bs)
    side = SIDES[impl](f"{impl}-encoder-{bs}", region, nb, bs)
    md, desc = side.blobs()
    say(md=base64.b64encode(md).decode(), desc=base64.b64encode(desc).decode())
    threading.Thread(target=side.serve, daemon=True).start()
    sys.stdin.read()  # until the consumer closes it
    leave(0)


def start_producer(impl, bs):
    p = subprocess.Popen(
        [sys.executable, __file__, "--role", "producer", "--impl", impl, "--bs", str(bs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 1)
        if r:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{impl} producer exited with {p.wait()}")
            if line.startswith("@@ "):
                m = json.loads(line[3:])
                return p, base64.b64decode(m["md"]), base64.b64decode(m["desc"])
    raise RuntimeError(f"{impl} producer did not start")


def pct(xs, q):
    """Nearest rank, as the Go harness's: the smallest sample with at least
    q of them at or below it (p50 of an even count is the lower middle)."""
    xs = sorted(xs)
    k = -(-round(q * 1000000) * len(xs) // 1000000)  # ceil(q * n), exact for q in millionths
    return xs[max(0, min(len(xs), k) - 1)]


def index_sets(name, bs, n, layout):
    """The workload's block sets, the same for every implementation."""
    nb = NUM_BLOCKS[bs]
    rng = random.Random(zlib.crc32(name.encode()))
    if n == 1:  # one block from anywhere in the region, as many as it has
        return [([k], [rng.randrange(nb)]) for k in range(nb)]
    sets = []
    for k in range(NSETS):
        if layout == "scatter":
            sets.append((rng.sample(range(nb), n), rng.sample(range(nb), n)))
        else:  # from an offset that moves through the region
            off = (k * n + rng.randrange(0, n)) % (nb - n + 1)
            sets.append((list(range(n)), list(range(off, off + n))))
    return sets


def run_workload(side, peer, bs, name, n, layout, gap, duration, mode="poll"):
    sets = index_sets(name, bs, n, layout)
    region = side.region
    # Every set once, untimed: the destination cleared, then every block
    # checked against the producer's pattern.
    for i, (local_idx, remote_idx) in enumerate(sets):
        for li in local_idx:
            region.mm[li * bs : (li + 1) * bs] = bytes(bs)
        h = side.post_read(side.indices(local_idx), peer, side.indices(remote_idx), b"sess-v:mm-%d" % i)
        st = side.check(h)
        while st == "PROC":
            st = side.check(h)
        side.release(h)
        if st != "DONE":
            raise RuntimeError(f"READ ended {st}")
        for li, ri in zip(local_idx, remote_idx):
            if region.mm[li * bs : (li + 1) * bs] != pattern(bs, ri, bs):
                raise RuntimeError(f"block {li} (remote {ri}) differs")
    args = [(side.indices(lo), side.indices(re)) for lo, re in sets]
    post, e2e = [], []
    clock = time.perf_counter_ns
    end = time.monotonic() + duration
    k = 0
    while time.monotonic() < end or k < 20:
        # The lists are built right before the call, untimed, as vLLM's
        # scheduler builds a request's block lists: their ints were just
        # touched.
        local, remote = args[k % len(args)]
        local, remote = list(local), list(remote)
        notif = b"sess-%d:mm-%d" % (k, k)
        t0 = clock()
        h = side.post_read(local, peer, remote, notif)
        t1 = clock()
        if mode == "wait":
            st = side.wait(h)
        else:
            st = side.check(h)
            while st == "PROC":
                st = side.check(h)
        t2 = clock()
        if st != "DONE":
            raise RuntimeError(f"READ ended {st}")
        side.release(h)
        if gap:
            time.sleep(gap)  # untimed: the rest of an engine step
        if k >= 5:  # warm-up
            post.append(t1 - t0)
            e2e.append(t2 - t0)
        k += 1
    # One check_xfer_state call, on a finished READ.
    local, remote = args[0]
    h = side.post_read(local, peer, remote, b"sess-x:mm-x")
    while side.check(h) == "PROC":
        pass
    if gap:
        # One call per step, as the READs were made: each after the pause.
        costs = []
        for _ in range(200):
            time.sleep(gap)
            t0 = clock()
            side.check(h)
            costs.append(clock() - t0)
        check_ns = pct(costs, 0.5)
    else:
        reps = 20000
        t0 = clock()
        for _ in range(reps):
            side.check(h)
        check_ns = (clock() - t0) / reps
    side.release(h)
    row = {
        "reads": len(e2e),
        "post_p50_us": pct(post, 0.5) / 1e3,
        "e2e_p50_us": pct(e2e, 0.5) / 1e3,
        # A p99 of fewer than 100 READs would be their largest: none then.
        "e2e_p99_us": pct(e2e, 0.99) / 1e3 if len(e2e) >= 100 else None,
        "check_us": check_ns / 1e3,
        "gbps": (n * bs * len(e2e)) / (sum(e2e) / 1e9) / 1e9,
    }
    if isinstance(side, EcxferSide) and mode == "poll" and not gap:
        # What a caller passing one array pays, one passing lists built
        # long ago, whose ints a READ has pushed out of the cache, and one
        # passing fresh lists through the general path (struct.pack in
        # Python) instead of the C reader lists take.
        from ecxfer import transport

        arrays = [(array.array("q", lo), array.array("q", re)) for lo, re in sets]
        c_path = transport._post_py
        for key, inputs, fresh in (
            ("post_array_p50_us", arrays, False),
            ("post_cold_p50_us", args, False),
            ("post_struct_p50_us", args, True),
        ):
            costs = []
            if key == "post_struct_p50_us":
                transport._post_py = None
            try:
                for i in range(k, k + 200):  # on through the sets, as the timed READs went
                    local, remote = inputs[i % len(inputs)]
                    if fresh:
                        local, remote = list(local), list(remote)
                    t0 = clock()
                    h = side.post_read(local, peer, remote, b"sess-a:mm-a")
                    costs.append(clock() - t0)
                    while side.check(h) == "PROC":
                        pass
                    side.release(h)
            finally:
                transport._post_py = c_path
            row[key] = pct(costs, 0.5) / 1e3
    return row


def consumer(impl, duration):
    results = {}
    for bs in sorted({w[1] for w in WORKLOADS}):
        prod, md, desc = start_producer(impl, bs)
        try:
            nb = NUM_BLOCKS[bs]
            region = Region(nb * bs)
            side = SIDES[impl](f"{impl}-prefill-{bs}", region, nb, bs)
            side.region = region
            peer = side.add_peer(md, desc)
            for name, wbs, n, layout, gap in WORKLOADS:
                if wbs == bs:
                    results[name] = run_workload(side, peer, bs, name, n, layout, gap, duration)
                    if impl == "ecxfer":
                        results[name + "/wait"] = run_workload(side, peer, bs, name, n, layout, gap, duration, "wait")
        finally:
            prod.stdin.close()
            prod.wait(30)
    say(results=results)
    leave(0)


def nixl_missing():
    try:
        import msgpack  # noqa: F401
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:  # ImportError, or the wheel failing to load
        return f"{type(e).__name__}: {e}"
    return None


def run_consumer(impl, duration, options=None):
    env = dict(os.environ)
    if options:
        env["ECXFER_OPTIONS"] = json.dumps(options)  # reaches the producer child too
    p = subprocess.Popen(
        [sys.executable, __file__, "--role", "consumer", "--impl", impl, "--duration", str(duration)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = p.communicate(timeout=600)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    finally:
        # A consumer killed (the timeout, an interrupt) or one that failed
        # leaves its region file behind: its atexit did not run. (Its
        # producer sees its stdin close and removes its own.)
        for path in Path("/dev/shm").glob(f"vllm_ec_bench-{p.pid}-*.mmap"):
            path.unlink(missing_ok=True)
    for line in out.splitlines():
        if line.startswith("@@ "):
            return json.loads(line[3:])["results"]
    raise RuntimeError(f"{impl} consumer failed ({p.returncode}):\n{err[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per workload (default 2)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--bs", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    if args.role == "producer":
        return producer(args.impl, args.bs)
    if args.role == "consumer":
        return consumer(args.impl, args.duration)

    load0 = os.getloadavg()
    out = {"ecxfer": run_consumer("ecxfer", args.duration)}
    why = "--skip-nixl" if args.skip_nixl else nixl_missing()
    if why is None:
        out["nixl"] = run_consumer("nixl", args.duration)
    load1 = os.getloadavg()
    cols = (
        f"{'workload':>12} {'impl':>12} {'reads':>6} {'GB/s':>6} {'p50 us':>8} {'p99 us':>9} {'post us':>8}"
        f" {'post(struct) us':>15} {'post(array) us':>14} {'post(cold) us':>13} {'check us':>9} {'p50 nixl/this':>13}"
    )
    print(cols)
    for name, *_ in WORKLOADS:
        n = out.get("nixl", {}).get(name)
        rows = (
            ("ecxfer poll", out["ecxfer"][name]),
            ("ecxfer wait", out["ecxfer"][name + "/wait"]),
            ("nixl poll", n),
        )
        for label, r in rows:
            if r is None:
                print(f"{name:>12} {label:>12}  skipped: {why}")
                continue
            ratio = f"{n['e2e_p50_us'] / r['e2e_p50_us']:.2f}x" if n and r is not n else "-"
            arr = f"{r['post_array_p50_us']:.2f}" if "post_array_p50_us" in r else "-"
            cold = f"{r['post_cold_p50_us']:.2f}" if "post_cold_p50_us" in r else "-"
            slow = f"{r['post_struct_p50_us']:.2f}" if "post_struct_p50_us" in r else "-"
            p99 = f"{r['e2e_p99_us']:.1f}" if r["e2e_p99_us"] is not None else "-"
            print(
                f"{name:>12} {label:>12} {r['reads']:>6} {r['gbps']:>6.2f} {r['e2e_p50_us']:>8.1f} {p99:>9}"
                f" {r['post_p50_us']:>8.2f} {slow:>15} {arr:>14} {cold:>13} {r['check_us']:>9.3f} {ratio:>13}"
            )
    print("GB/s: the READs' bytes over the sum of their post->DONE times (the loop's own costs between")
    print("  READs excluded, so above the rate of a caller that only reads);")
    print("  p50/p99 nearest rank, post->DONE (p99 only from 100 READs); the implementations run one after the")
    print("  other, not in alternating rounds")
    print(f"load average before/after: {load0[0]:.2f} / {load1[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": out, "load": [load0, load1], "nixl_skipped": why}, indent=1))


if __name__ == "__main__":
    main()
