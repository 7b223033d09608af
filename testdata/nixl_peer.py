# A NIXL agent driven through NIXL's Python API the way vLLM's
# NixlDataTransport drives one, as the other side of ecxfer's interop test
# (nixl_interop_test.go). It is not part of ecxfer.
#
# Usage: nixl_peer.py producer|consumer NAME BLOCK_SIZE NUM_BLOCKS SEED
#
# It runs in the project's .venv (NIXL's wheel, numpy, msgpack) and always
# leaves through os._exit: NIXL 1.5.1's wheel crashes (SIGSEGV) in its
# destructors at interpreter exit.
#
# Control channel: lines on stdin and stdout, hex for binary fields. Only
# this program writes to stdout (anything a library logs goes to stderr).
#   producer: prints "meta <md>" and "desc <descs>", then "notif <agent>
#             <msg>" for every notification, until stdin closes.
#   consumer: reads "peer <md> <descs>" and "read <local> <remote> <msg>"
#             (indices comma-separated), READs those blocks, checks them and
#             prints "done <agent>" or "fail <why>"; then waits for stdin to
#             close.
import os
import select
import sys
import time

import msgpack
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

# Keep the control channel off fd 1.
ctrl = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def say(*words):
    print(*words, file=ctrl, flush=True)


def leave(code):
    ctrl.flush()
    sys.stderr.flush()
    os._exit(code)


def text(name):
    # Agent names come back as str or bytes depending on the call.
    return name.decode() if isinstance(name, bytes) else name


def pattern(seed, nb, bs):
    # Byte j of block i is the top byte of (seed ^ i<<20 ^ j) * an odd
    # 64-bit constant, taken mod 2^64. The Go test computes the same.
    assert bs < 1 << 20
    i = np.arange(nb, dtype=np.uint64)[:, None] << np.uint64(20)
    j = np.arange(bs, dtype=np.uint64)[None, :]
    x = (np.uint64(seed) ^ i ^ j) * np.uint64(0x9E3779B97F4A7C15)
    return (x >> np.uint64(56)).astype(np.uint8)


role, name = sys.argv[1], sys.argv[2]
bs, nb, seed = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
buf = np.zeros((nb, bs), dtype=np.uint8)
base = buf.ctypes.data
agent.register_memory([(base, nb * bs, 0, "")], "DRAM", backends=["UCX"])
blocks = [(base + i * bs, bs, 0) for i in range(nb)]
local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, "DRAM", backends=["UCX"])

if role == "producer":
    buf[:] = pattern(seed, nb, bs)
    say("meta", agent.get_agent_metadata().hex())
    say("desc", msgpack.packb(blocks).hex())
    while True:
        for peer, msgs in agent.get_new_notifs().items():
            for m in msgs:
                say("notif", text(peer), m.hex())
        ready, _, _ = select.select([sys.stdin], [], [], 0.001)
        if ready and sys.stdin.readline() == "":
            break
    leave(0)

if role != "consumer":
    print("unknown role " + role, file=sys.stderr)
    leave(2)

_, md, descs = sys.stdin.readline().split()
peer = agent.add_remote_agent(bytes.fromhex(md))
remote_blocks = [tuple(d) for d in msgpack.unpackb(bytes.fromhex(descs))]
remote = agent.prep_xfer_dlist(peer, remote_blocks, "DRAM", backends=["UCX"])

_, li, ri, msg = sys.stdin.readline().split()
li = [int(k) for k in li.split(",")]
ri = [int(k) for k in ri.split(",")]
h = agent.make_prepped_xfer("READ", local, li, remote, ri, bytes.fromhex(msg))
state = agent.transfer(h)
deadline = time.monotonic() + 20
while state == "PROC" and time.monotonic() < deadline:
    state = agent.check_xfer_state(h)
if state != "DONE":
    say("fail", "transfer state", state)
    leave(1)
want = pattern(seed, nb, bs)
bad = [k for k in range(len(li)) if not np.array_equal(buf[li[k]], want[ri[k]])]
if bad:
    say("fail", "%d of %d blocks differ, first local %d" % (len(bad), len(li), li[bad[0]]))
    leave(1)
agent.release_xfer_handle(h)
agent.release_dlist_handle(remote)
agent.remove_remote_agent(peer)
say("done", text(peer))
sys.stdin.read()
leave(0)
