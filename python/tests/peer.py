"""A producer or consumer process for the two-process tests, making vLLM's
calls in vLLM's order. Protocol lines on stdout start with "@@ " (UCX may
log to stdout too); the parent answers on stdin with JSON lines.

    python peer.py producer NAME SHM_PATH NUM_BLOCKS BLOCK_SIZE SEED
    python peer.py consumer NAME SHM_PATH NUM_BLOCKS BLOCK_SIZE
"""

import base64
import json
import sys
import time

from conftest import ShmRegion, pattern

from ecxfer import EcxferDataTransport


def say(**msg):
    sys.stdout.write("@@ " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def hear():
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    return json.loads(line)


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def producer(name, path, nb, bs, seed):
    region = ShmRegion(nb * bs, path)
    for i in range(nb):
        region.mm[i * bs : (i + 1) * bs] = pattern(seed, i, bs)
    t = EcxferDataTransport(
        agent_name=name, base_ptr=region.addr, num_blocks=nb, block_size_bytes=bs, total_size_bytes=nb * bs
    )
    say(md=b64(t.get_agent_metadata()), desc=b64(t.get_mem_descriptor()))
    want = hear()["expect_notifs"]
    got = []
    # vLLM's producer drains its notifications once per engine step.
    deadline = time.monotonic() + 30
    while len(got) < want and time.monotonic() < deadline:
        for sender, msgs in t.get_new_notifs().items():
            got.extend([sender, m.decode()] for m in msgs)
        time.sleep(0.001)
    say(notifs=got)
    hear()  # "quit"
    t.deregister()
    region.close()


def consumer(name, path, nb, bs):
    region = ShmRegion(nb * bs, path)
    t = EcxferDataTransport(
        agent_name=name, base_ptr=region.addr, num_blocks=nb, block_size_bytes=bs, total_size_bytes=nb * bs
    )
    say(md=b64(t.get_agent_metadata()), desc=b64(t.get_mem_descriptor()))
    job = hear()
    peer = t.add_remote_peer(base64.b64decode(job["md"]), base64.b64decode(job["desc"]))
    results = []
    for req in job["reads"]:
        h = t.post_read(req["local"], peer, req["remote"], req["notif"].encode())
        # vLLM checks once per engine step.
        deadline = time.monotonic() + 30
        state = t.check_xfer_state(h)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = t.check_xfer_state(h)
        err = t.xfer_error(h)
        t.release_xfer_handle(h)
        bad = [
            loc
            for loc, rem in zip(req["local"], req["remote"])
            if region.mm[loc * bs : (loc + 1) * bs] != pattern(job["seed"], rem, bs)
        ]
        results.append({"state": state, "error": type(err).__name__ if err else None, "bad_blocks": bad})
    st = t.stats()
    t.remove_remote_peer(peer)
    say(results=results, stats=st)
    hear()  # "quit"
    t.deregister()
    region.close()


if __name__ == "__main__":
    role, name, path = sys.argv[1:4]
    nums = [int(x) for x in sys.argv[4:]]
    if role == "producer":
        producer(name, path, *nums)
    else:
        consumer(name, path, *nums)
