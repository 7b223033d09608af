"""After deregister, nothing is left: no transports in the library's
registry (handles and peers live in a transport, so none of those
either), no more goroutines than before (counted: the C ABI does not
name them, unlike the Go tests' leak check) and no new file
descriptors. The library itself stays loaded (Go shared libraries cannot
be unloaded). Runs in a fresh interpreter so the baseline is this test's
alone."""

import subprocess
import sys

from conftest import child_env

SCRIPT = r'''
import json, os, time
from conftest import ShmRegion, lib_runtime as runtime, open_fds as fds
from ecxfer import EcxferDataTransport

def cycle(tag, reads):
    nb, bs = 128, 4096
    regs = [ShmRegion(nb * bs) for _ in range(2)]
    a = EcxferDataTransport(agent_name="leak-a-" + tag, base_ptr=regs[0].addr, num_blocks=nb, block_size_bytes=bs, total_size_bytes=nb * bs)
    b = EcxferDataTransport(agent_name="leak-b-" + tag, base_ptr=regs[1].addr, num_blocks=nb, block_size_bytes=bs, total_size_bytes=nb * bs)
    pa = b.add_remote_peer(a.get_agent_metadata(), a.get_mem_descriptor())
    pb = a.add_remote_peer(b.get_agent_metadata(), b.get_mem_descriptor())
    kept = []
    for i in range(reads):
        h = b.post_read(list(range(64)), pa, list(range(64, 128)), b"s:%d" % i)
        if i % 3 == 0:
            b.release_xfer_handle(h)      # released, maybe in flight
        elif i % 3 == 1:
            b.wait(h, 10); b.release_xfer_handle(h)
        else:
            kept.append(h)                # never released: deregister frees it
        h2 = a.post_read([i % nb], pb, [i % nb], b"")
        kept.append(h2)
    st = b.stats()
    assert st["peers"] == 1 and st["live_handles"] >= 1, st
    assert runtime()["transports"] == 2
    a.wait_notifs(5)
    a.deregister(); b.deregister()
    for r in regs:
        r.close()

cycle("warm", 3)                          # start whatever the runtime starts once
time.sleep(0.5)
base_g, base_fd = runtime()["goroutines"], fds()
for k in range(3):
    cycle(str(k), 30)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    rt, now = runtime(), fds()
    if rt["transports"] == 0 and rt["goroutines"] <= base_g and now <= base_fd:
        break
    time.sleep(0.05)
print(json.dumps({"runtime": rt, "base_goroutines": base_g, "new_fds": sorted(now - base_fd),
                  "links": {f: os.readlink("/proc/self/fd/" + f) for f in now - base_fd if os.path.exists("/proc/self/fd/" + f)}}))
'''


def test_nothing_left_after_deregister():
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["runtime"]["transports"] == 0, out
    assert out["runtime"]["goroutines"] <= out["base_goroutines"], out
    assert out["new_fds"] == [], out
