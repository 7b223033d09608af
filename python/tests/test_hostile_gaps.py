"""Hostile cases the other tests leave out: calls blocked when deregister()
comes from another thread, every method after deregister(), transports
dropped without deregister() or never made (failed constructors) and
what they leave behind, and the vLLM plugin given an environment it does
not expect."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import ecxfer
from conftest import HELPERS, PYDIR, child_env, lib_runtime

STUB = str(HELPERS / "stub_vllm")



def test_blocked_calls_end_at_deregister_and_methods_after_it():
    """A post_read waiting for room in a full handle table
    (wait_when_busy) and a wait_notifs() with no time limit, each in its
    own thread, return when another thread deregisters: ClosedError and
    {}. Afterwards every method answers at once, as documented or as a
    closed transport: nothing blocks, nothing crashes."""
    before = lib_runtime()["transports"]
    kw = dict(backend="loopback", handles=256, wait_when_busy=True)
    p = ecxfer.EcxferDataTransport("hg-prod", 0, 16, 64, 16 * 64, **kw)
    c = ecxfer.EcxferDataTransport("hg-cons", 0, 16, 64, 16 * 64, **kw)
    name = c.add_remote_peer(p.get_agent_metadata(), p.get_mem_descriptor())
    hs = [c.post_read([i % 16], name, [i % 16], b"") for i in range(256)]  # the table is full
    out = {}

    def post():
        try:
            out["post"] = c.post_read([1], name, [2], b"blocked")
        except Exception as e:  # noqa: BLE001
            out["post"] = e

    def notifs():
        out["notifs"] = c.wait_notifs(None)

    threads = [threading.Thread(target=post), threading.Thread(target=notifs)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    assert all(th.is_alive() for th in threads), "the calls should be blocked"
    t0 = time.monotonic()
    c.deregister()
    for th in threads:
        th.join(10)
    assert not any(th.is_alive() for th in threads), "a blocked call did not return after deregister()"
    assert time.monotonic() - t0 < 5
    assert isinstance(out["post"], ecxfer.ClosedError), out
    assert out["notifs"] == {}

    # Every method after deregister(): at once, and no crash.
    t0 = time.monotonic()
    assert c.closed
    assert c.check_xfer_state(hs[0]) == "ERR"
    assert c.wait(hs[0], None) == "ERR"
    assert isinstance(c.xfer_error(hs[0]), ecxfer.ClosedError)
    assert c.get_new_notifs() == {}
    assert c.wait_notifs(None) == {}
    c.release_xfer_handle(hs[0])
    c.remove_remote_peer(name)
    c.deregister()
    for call in (c.get_agent_metadata, c.get_mem_descriptor, c.stats):
        with pytest.raises(ecxfer.ClosedError):
            call()
    with pytest.raises(ecxfer.ClosedError):
        c.add_remote_peer(p.get_agent_metadata(), p.get_mem_descriptor())
    with pytest.raises(ecxfer.ClosedError):
        c.post_read([0], name, [0], b"")
    with pytest.raises(ecxfer.ClosedError):
        c.post_read([0], "never-known", [0], b"")
    # Whatever else is wrong with the call: closed is what it says.
    with pytest.raises(ecxfer.ClosedError):
        c.post_read([0], name, [1, 2], b"")
    with pytest.raises(ecxfer.ClosedError):
        c.post_read({0}, name, [[1]], None)
    assert time.monotonic() - t0 < 5
    with c:  # the context manager on a closed transport
        pass
    p.deregister()
    assert lib_runtime()["transports"] == before


LEFT_BEHIND = r'''
import gc, json, os, sys, time
import ecxfer
from conftest import ShmRegion, lib_runtime as runtime, open_fds as fds

nb, bs = 16, 4096
def failing(reg, k):
    """Constructors that must fail, each its own way."""
    bad = [
        dict(agent_name="has space"),
        dict(agent_name="x" * 257),
        dict(num_blocks=0),
        dict(block_size_bytes=0),
        dict(total_size_bytes=bs),                    # region too short
        dict(idle="sometimes"),
        dict(bogus_option=1),
        dict(backend="pigeon"),
        dict(backend="nixl"),                         # not installed: NoBackendError
        dict(pin_cpu=100000),
        dict(num_threads=0),
        dict(base_ptr=reg.addr, total_size_bytes=0),  # a region of 0 bytes
    ]
    for i, b in enumerate(bad):
        kw = dict(agent_name=f"lb-fail-{k}-{i}", base_ptr=reg.addr, num_blocks=nb,
                  block_size_bytes=bs, total_size_bytes=nb * bs)
        kw.update(b)
        try:
            ecxfer.EcxferDataTransport(**kw)
        except ecxfer.EcxferError:
            continue
        raise SystemExit(f"constructor {b} did not fail")

def dropped(k):
    """Transports dropped without deregister(), with a peer, live handles
    and a notification waiting: the finalizer tears them down."""
    regs = [ShmRegion(nb * bs) for _ in range(2)]
    a = ecxfer.EcxferDataTransport(f"lb-a-{k}", regs[0].addr, nb, bs, nb * bs)
    b = ecxfer.EcxferDataTransport(f"lb-b-{k}", regs[1].addr, nb, bs, nb * bs)
    peer = b.add_remote_peer(a.get_agent_metadata(), a.get_mem_descriptor())
    for i in range(8):
        h = b.post_read([i], peer, [i], b"n")
        if i % 2:
            b.wait(h, 10)
    a.wait_notifs(5)
    with ecxfer.EcxferDataTransport(f"lb-c-{k}", 0, nb, bs, 0, backend="loopback") as c:
        c.add_remote_peer(c.get_agent_metadata(), c.get_mem_descriptor())
    assert c.closed
    del a, b, c
    gc.collect()
    return regs

reg = ShmRegion(nb * bs)
failing(reg, "warm")
for r in dropped("warm"):
    r.close()
time.sleep(0.5)
base_g, base_fd = runtime()["goroutines"], fds()
for k in range(3):
    failing(reg, k)
    for r in dropped(k):
        r.close()
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    rt, now = runtime(), fds()
    if rt["transports"] == 0 and rt["goroutines"] <= base_g and now <= base_fd:
        break
    time.sleep(0.05)
reg.close()
print("@@ " + json.dumps({"runtime": rt, "base_goroutines": base_g, "new_fds": sorted(now - base_fd),
      "links": {f: os.readlink("/proc/self/fd/" + f) for f in now - base_fd if os.path.exists("/proc/self/fd/" + f)}}))
'''


def test_dropped_and_failed_transports_leave_nothing():
    """Transports dropped without deregister() (the weakref finalizer's
    path), one closed by its context manager, and constructors that fail
    leave no transport in the library, no goroutine and no descriptor."""
    env = child_env({"ECXFER_NIXL_LIB": "/nonexistent/libecxnixl.so"})
    env.pop("NIXL_PREFIX", None)
    r = subprocess.run([sys.executable, "-c", LEFT_BEHIND], env=env, capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("@@ ")][-1][3:])
    assert out["runtime"]["transports"] == 0, out
    assert out["runtime"]["goroutines"] <= out["base_goroutines"], out
    assert out["new_fds"] == [], out


PLUGIN = r'''
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import ecxfer.vllm_plugin as plugin
from ecxfer import _lib
out = {"register": repr(plugin.register())}
try:
    from vllm.distributed.ec_transfer.ec_connector.cpu.data import nixl as data
    import vllm.distributed.nixl_utils as utils
except ImportError as e:
    out["vllm"] = None
else:
    out["first"] = data.NixlDataTransport.__module__ + "." + data.NixlDataTransport.__qualname__
    out["register2"] = repr(plugin.register())  # a second call
    out["second"] = data.NixlDataTransport.__module__ + "." + data.NixlDataTransport.__qualname__
    out["wrapper"] = getattr(utils.NixlWrapper, "__qualname__", repr(utils.NixlWrapper))
    raised = []
    for f in (utils.NixlWrapper, utils.nixl_agent_config):
        try:
            f() if f is not None else None
        except RuntimeError:
            raised.append(True)
    out["stand_ins_raise"] = raised
out["library_loaded"] = _lib.loaded()
print("@@ " + json.dumps(out))
'''


def _plugin(value, pythonpath):
    env = child_env({"ECXFER_VLLM": value} if value is not None else None)
    if value is None:
        env.pop("ECXFER_VLLM", None)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    r = subprocess.run([sys.executable, "-c", PLUGIN], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("@@ ")][-1][3:]), r.stderr


@pytest.mark.parametrize("value", [None, "", "0", "true", "yes", " 1", "1 ", "01", "1\n"])
def test_plugin_off_unless_exactly_one(value):
    out, _ = _plugin(value, [STUB, str(PYDIR)])
    assert out["register"] == "None"
    assert out["first"] == "vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl.NixlDataTransport", out
    assert out["wrapper"] == "None", "stand-ins put in place while off"
    assert out["library_loaded"] is False


def test_plugin_without_vllm_and_twice():
    """ECXFER_VLLM=1 in a process without vLLM: a warning, no exception,
    nothing loaded. With vLLM, a second register() changes nothing and
    leaves the stand-ins that refuse to be used."""
    out, err = _plugin("1", [str(PYDIR)])
    assert out == {"register": "None", "vllm": None, "library_loaded": False}, out
    assert "not patching" in err
    out, _ = _plugin("1", [STUB, str(PYDIR)])
    assert out["first"] == out["second"] == "ecxfer.transport.EcxferDataTransport", out
    assert out["register2"] == "None"
    assert out["wrapper"] == "NixlAbsent"
    assert out["stand_ins_raise"] == [True, True]
    assert out["library_loaded"] is False


def test_wait_timeout_bounds_the_call_with_long_wait_spin(peers, monkeypatch):
    """wait(h, timeout) on a READ still in flight returns "PROC" after
    about timeout seconds, whatever wait_spin_us (an option, also from
    ECXFER_OPTIONS) says. The READ is held in flight as in test_gil: a
    producer stopped by SIGSTOP, read over TCP through the engine."""
    import base64
    import signal

    from conftest import ShmRegion, shm_path

    monkeypatch.setenv("UCX_TLS", "tcp")
    path = shm_path("spin")
    prod = peers([sys.executable, str(HELPERS / "peer.py"), "producer", "encoder-spin", path, "256", "65536", "3"])
    pm = prod.recv()
    reg = ShmRegion(256 * 65536)
    t = ecxfer.EcxferDataTransport(
        agent_name="prefill-spin", base_ptr=reg.addr, num_blocks=256, block_size_bytes=65536,
        total_size_bytes=256 * 65536, direct="off", wait_spin_us=20_000_000,
    )
    try:
        peer = t.add_remote_peer(base64.b64decode(pm["md"]), base64.b64decode(pm["desc"]))
        h = t.post_read([0], peer, [0], b"")
        assert t.wait(h, 30) == "DONE"  # connected
        t.release_xfer_handle(h)
        os.kill(prod.p.pid, signal.SIGSTOP)
        h = t.post_read(list(range(256)), peer, list(range(256)), b"")
        took = {}
        for timeout in (0, 0.05):
            t0 = time.monotonic()
            st = t.wait(h, timeout)
            took[timeout] = (st, round(time.monotonic() - t0, 3))
        t.release_xfer_handle(h)
        assert all(st == "PROC" for st, _ in took.values()), took
        assert all(s < timeout + 5 for timeout, (_, s) in took.items()), f"wait(h, timeout) took {took}"
    finally:
        os.kill(prod.p.pid, signal.SIGCONT)
        t.deregister()
        reg.close()
    prod.send(expect_notifs=0)
    prod.recv()
    assert prod.finish() == 0


FIRST_PAGE = r"""
import ecxfer
bad = []
for ptr in (True, 1, 8, 4095):
    try:
        ecxfer.EcxferDataTransport(agent_name="fp", base_ptr=ptr, num_blocks=1, block_size_bytes=64, total_size_bytes=64)
    except ecxfer.ConfigError as e:
        assert "base_ptr" in str(e), e
    else:
        bad.append(ptr)
assert not bad, f"taken as regions: {bad}"


class Fake:
    # An index "array" whose data pointer lies in the first page.
    def __init__(self, addr):
        self.__array_interface__ = {"typestr": "<i8", "shape": (4,), "data": (addr, False), "version": 3}


t = ecxfer.EcxferDataTransport("fp2", 0, 8, 64, 0, backend="loopback")
peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
for addr in (8, 4095):
    for args in ((Fake(addr), peer, [0, 1, 2, 3], b""), ([0, 1, 2, 3], peer, Fake(addr), b"")):
        try:
            t.post_read(*args)
        except (TypeError, ValueError) as e:
            pass
        else:
            raise AssertionError(f"an index array at {addr:#x} was read")
t.deregister()
print("ok")
"""


def test_first_page_pointers_refused():
    """A base_ptr in the first page (True, 1, 4095) or an index array whose
    __array_interface__ names an address there is refused with a clear
    error. Such a pointer used to reach the library, whose Go runtime
    aborted the interpreter ("invalid pointer found on stack"): the test
    runs in a child so that a regression fails it instead of the suite."""
    r = subprocess.run([sys.executable, "-c", FIRST_PAGE], env=child_env(), capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "ok", f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"


def test_region_not_writable_refused():
    """A base_ptr whose region is mapped read-only (or not at all) is
    refused with ConfigError: READs land in it, and a fault there was
    taken for the producer's death."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    n = 4 * 4096
    addr = libc.mmap(None, n, _mmap.PROT_READ, _mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        with pytest.raises(ecxfer.ConfigError, match="not mapped writable"):
            ecxfer.EcxferDataTransport(agent_name="ro", base_ptr=addr, num_blocks=4, block_size_bytes=4096,
                                       total_size_bytes=n)
    finally:
        libc.munmap(addr, n)
