"""ecxfer and fork. Loading libecxfer.so starts Go's runtime and its
threads; a forked child keeps none of those threads, and a call into Go
there can wait forever on a lock one of them held. vLLM loads its plugins
in processes that may fork later. So: importing ecxfer and registering the
plugin must not load the library; a child forked before the first
transport works normally; a child forked after it gets ForkedError from
every call instead of a hang, exits cleanly, and leaves the parent's
transport working.

Each case runs in a fresh interpreter (the test process itself has loaded
the library); the script forks, and its parent kills a child that has not
exited within its deadline and reports it as hung."""

import json
import os
import subprocess
import sys

from conftest import HELPERS, PYDIR, child_env

STUB = str(HELPERS / "stub_vllm")

PRELUDE = r'''
import json, os, signal, sys, time, array
import ecxfer, ecxfer.vllm_plugin
from ecxfer import _lib

def mapped():
    with open("/proc/self/maps") as f:
        return "libecxfer" in f.read()

def transport(name):
    return ecxfer.EcxferDataTransport(name, 0, 8, 4096, 8 * 4096, backend="loopback")

def roundtrip(t):
    """A READ of two blocks from the transport itself, DONE, released."""
    peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
    h = t.post_read(array.array("q", [0, 1]), peer, array.array("q", [2, 3]), b"s:h")
    st = t.wait(h, 10)
    t.release_xfer_handle(h)
    return st

def run_child(body, deadline=30):
    """Fork; the child runs body() and exits with its return value (its
    interpreter shut down normally: atexit handlers and finalizers run).
    Returns the child's exit status, or "hung" if it had to be killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 3
        try:
            res = body()
            os.write(w, json.dumps(res).encode())
            code = 0
        except BaseException as e:
            os.write(w, json.dumps({"child_exception": repr(e)}).encode())
        finally:
            os.close(w)
        sys.exit(code)
    os.close(w)
    end = time.monotonic() + deadline
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung", None
        time.sleep(0.02)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    return os.waitstatus_to_exitcode(status), (json.loads(data) if data else None)

out = {}
'''

IMPORT_ONLY = PRELUDE + r'''
os.environ["ECXFER_VLLM"] = "1"
ecxfer.vllm_plugin.register()
from vllm.distributed.ec_transfer.ec_connector.cpu.data import nixl as data
out["patched"] = data.NixlDataTransport is ecxfer.EcxferDataTransport
out["mapped_after_import"] = mapped()
out["loaded_after_import"] = _lib.loaded()
t = transport("imp-0")
out["mapped_after_new"] = mapped()
out["state"] = roundtrip(t)
t.deregister()
print("@@ " + json.dumps(out))
'''

FORK_BEFORE = PRELUDE + r'''
os.environ["ECXFER_VLLM"] = "1"
ecxfer.vllm_plugin.register()

def child():
    t = transport("child-0")
    st = roundtrip(t)
    t.deregister()
    return {"state": st}

out["child"] = run_child(child)
t = transport("parent-0")
out["parent_state"] = roundtrip(t)
t.deregister()
print("@@ " + json.dumps(out))
'''

FORK_AFTER = PRELUDE + r'''
t = transport("parent-0")
peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())

def child():
    res = {}
    try:
        transport("child-0")
    except ecxfer.ForkedError as e:
        res["new"] = "ForkedError: " + str(e)
    try:
        t.post_read([0], peer, [1], b"")
    except ecxfer.ForkedError as e:
        res["post"] = "ForkedError"
    try:
        t.check_xfer_state(1)
    except ecxfer.ForkedError:
        res["check"] = "ForkedError"
    t.release_xfer_handle(1)  # never raises; logs
    t.remove_remote_peer(peer)  # never raises; logs
    t.deregister()  # forgets the parent's transport here
    res["deregistered"] = True
    return res  # then sys.exit: the interpreter's finalizers run

out["child"] = run_child(child)
out["parent_state"] = roundtrip(t)
out["parent_peers"] = t.stats()["peers"]
t.deregister()
print("@@ " + json.dumps(out))
'''


# Another thread loads the library (the first transport) while the main
# thread forks. The child, whose copy of the library may be half started,
# gets ForkedError, or loads its own copy if the fork came before the load
# began; it never hangs. (The load lock used to be inherited held, and the
# child's first transport waited on it forever.)
FORK_WHILE_LOADING = PRELUDE + r'''
import threading
delay = float(sys.argv[1])
loader = threading.Thread(target=_lib.get)
loader.start()
time.sleep(delay)

def child():
    try:
        t = transport("child-0")
    except ecxfer.ForkedError:
        return "ForkedError"
    st = roundtrip(t)
    t.deregister()
    return st

out["child"] = run_child(child, deadline=20)
loader.join()
t = transport("parent-0")
out["parent_state"] = roundtrip(t)
t.deregister()
print("@@ " + json.dumps(out))
'''


# The library is mapped and then refused (here: this package expects
# another ABI version), so it is not loaded; the parent's next load, with
# the right version, works. A child forked after the refusal used to load
# "its own copy", which dlopen hands back as the parent's, its Go runtime
# without threads, and hang in its first call: it gets ForkedError.
FORK_AFTER_REFUSED_LOAD = PRELUDE + r'''
real = _lib.ABI_VERSION
_lib.ABI_VERSION = real + 1000
try:
    _lib.get()
except ImportError as e:
    out["refused"] = str(e)
_lib.ABI_VERSION = real
out["loaded"] = _lib.loaded()
out["mapped"] = mapped()

def child():
    try:
        transport("child-0")
    except ecxfer.ForkedError:
        return "ForkedError"
    return "made a transport"

out["child"] = run_child(child, deadline=20)
t = transport("parent-0")
out["parent_state"] = roundtrip(t)
t.deregister()
print("@@ " + json.dumps(out))
'''


def run(script, *args):
    env = child_env({"ECXFER_VLLM": ""})
    env["PYTHONPATH"] = os.pathsep.join([STUB, str(PYDIR), str(HELPERS)])
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=180, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("@@ ")][-1][3:])


def test_import_and_plugin_do_not_load_the_library():
    out = run(IMPORT_ONLY)
    assert out["patched"]
    assert out["mapped_after_import"] is False
    assert out["loaded_after_import"] is False
    assert out["mapped_after_new"] is True
    assert out["state"] == "DONE"


def test_fork_before_first_transport():
    out = run(FORK_BEFORE)
    assert out["child"] == [0, {"state": "DONE"}]
    assert out["parent_state"] == "DONE"


def test_fork_after_first_transport():
    out = run(FORK_AFTER)
    code, res = out["child"]
    assert code == 0, res
    assert res["new"].startswith("ForkedError: ecxfer: this process was forked after it loaded")
    assert res["post"] == "ForkedError"
    assert res["check"] == "ForkedError"
    assert res["deregistered"] is True
    # The child's deregister and its exit touched nothing of the parent's.
    assert out["parent_state"] == "DONE"
    assert out["parent_peers"] == 1


def test_fork_while_another_thread_loads():
    seen = set()
    for delay in ("0", "0", "0", "0.0005", "0.001", "0.002"):
        out = run(FORK_WHILE_LOADING, delay)
        code, res = out["child"]
        assert code == 0, (delay, code, res)
        assert res in ("ForkedError", "DONE"), (delay, res)
        seen.add(res)
        assert out["parent_state"] == "DONE"
    assert "ForkedError" in seen


def test_fork_after_a_refused_load():
    out = run(FORK_AFTER_REFUSED_LOAD)
    assert "ABI version" in out["refused"]
    assert out["loaded"] is False and out["mapped"] is True
    assert out["child"] == [0, "ForkedError"], out["child"]
    assert out["parent_state"] == "DONE"
