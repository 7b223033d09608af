"""A vLLM-shaped producer (encoder) and consumer (prefill) talking through
ecxfer, in two processes on this host:

    make python
    .venv/bin/python python/examples/vllm_pair.py

Each side keeps its blocks in a MAP_SHARED mapping of a /dev/shm file, as
vLLM's EC connector does, and makes vLLM's DataTransport calls in vLLM's
order: the producer hands its agent metadata and block descriptors to the
consumer (here over a pipe; vLLM uses its ZMQ control plane), the consumer
adds it as a peer, posts a READ of one encoding's blocks with the
notification "{session}:{mm_hash}", checks the READ once per step until
DONE and releases it; the producer drains its notifications once per step
and learns it may reuse those blocks. Both sides are on this host, so the
consumer reads the producer's file directly (the default). Options in
ECXFER_OPTIONS apply to both sides; with '{"direct": "off"}' the UCX engine
refuses the producer's own /dev/shm region over shared memory (a producer
dying mid-answer could stall every peer), so add UCX_TLS=tcp to go through
the engine over TCP.
"""

import atexit
import base64
import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

try:  # an installed ecxfer (pip install ./python) first
    from ecxfer import EcxferDataTransport
except ImportError:  # else this checkout's (make python)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ecxfer import EcxferDataTransport

NUM_BLOCKS, BLOCK_SIZE = 4096, 5120  # 20 MiB; one block = one token's embedding
ENCODING = range(100, 980)  # the producer's blocks of one image: 880 tokens


def region(engine_id: str):
    path = f"/dev/shm/vllm_ec_{engine_id}.mmap"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, NUM_BLOCKS * BLOCK_SIZE)
    mm = mmap.mmap(fd, NUM_BLOCKS * BLOCK_SIZE, mmap.MAP_SHARED)
    os.close(fd)
    # The file stays while this process runs, as vLLM's region file does: a
    # consumer on this host maps the producer's file by its path. (Once
    # unlinked, it could read it only through the kernel, more slowly.)
    atexit.register(os.unlink, path)
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


def transport(engine_id: str, base_ptr: int) -> EcxferDataTransport:
    # What vLLM's EC CPU scheduler passes (keywords only).
    return EcxferDataTransport(
        agent_name=engine_id,
        base_ptr=base_ptr,
        num_blocks=NUM_BLOCKS,
        block_size_bytes=BLOCK_SIZE,
        total_size_bytes=NUM_BLOCKS * BLOCK_SIZE,
    )


def block_bytes(i: int) -> bytes:
    return i.to_bytes(4, "little") * (BLOCK_SIZE // 4)


def producer():
    # Stop like any exit (atexit removes the region file) when the consumer
    # says so, and by itself if the consumer is gone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    parent = os.getppid()
    mm, base = region(f"encoder-{os.getpid()}")
    for i in ENCODING:  # the "embeddings"
        mm[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] = block_bytes(i)
    t = transport("encoder-0", base)
    print(json.dumps({"md": base64.b64encode(t.get_agent_metadata()).decode(),
                      "desc": base64.b64encode(t.get_mem_descriptor()).decode()}), flush=True)
    steps = 0
    while os.getppid() == parent:  # the engine's step loop
        steps += 1
        for sender, msgs in t.get_new_notifs().items():
            for m in msgs:
                print(json.dumps({"notif_from": sender, "msg": m.decode(), "step": steps}), flush=True)
                t.deregister()
                return
        time.sleep(0.001)
    t.deregister()


def consumer():
    child = subprocess.Popen([sys.executable, __file__, "producer"], stdout=subprocess.PIPE, text=True)
    try:
        return read_from(child)
    finally:
        if child.poll() is None:  # this side failed: stop the producer too
            child.terminate()
            child.wait(30)


def read_from(child) -> int:
    first = json.loads(child.stdout.readline())
    mm, base = region(f"prefill-{os.getpid()}")
    t = transport("prefill-0", base)
    peer = t.add_remote_peer(base64.b64decode(first["md"]), base64.b64decode(first["desc"]))
    local = list(range(len(ENCODING)))  # where this side wants the encoding
    t0 = time.perf_counter()
    h = t.post_read(local, peer, list(ENCODING), b"session-1:mm-hash-abc")
    steps = 0
    state = t.check_xfer_state(h)
    while state == "PROC":  # vLLM checks once per step
        time.sleep(0.0001)
        steps += 1
        state = t.check_xfer_state(h)
    dt = time.perf_counter() - t0
    err = t.xfer_error(h) if state != "DONE" else None
    ok = all(mm[k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE] == block_bytes(i) for k, i in enumerate(ENCODING))
    t.release_xfer_handle(h)
    print(f"consumer: READ of {len(local)} blocks from {peer!r}: {state} after {steps} steps, "
          f"{dt * 1e3:.2f} ms; bytes {'verified' if ok else 'WRONG'}" + (f" ({err})" if err else ""))
    if state != "DONE":
        # A failed READ sends no notification: the producer is not
        # waited for (consumer() stops it).
        t.deregister()
        return 1
    note = json.loads(child.stdout.readline())
    print(f"producer: notification from {note['notif_from']!r}: {note['msg']!r} (step {note['step']}): "
          "those blocks may be reused")
    t.remove_remote_peer(peer)
    t.deregister()
    child.wait(30)
    return 0 if ok and state == "DONE" else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["producer"]:
        producer()
    else:
        sys.exit(consumer())
