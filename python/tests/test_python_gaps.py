"""What a review of the Python package found: the plugin importing vLLM
while off, a deregister interrupted between the library's teardown and
the finalizer, repeated keys in ECXFER_OPTIONS, an index list longer than
any C size, and notifications interrupted while they were decoded."""

import json
import os
import subprocess
import sys
import time

import pytest

import ecxfer
from ecxfer import transport
from conftest import HELPERS, PYDIR, child_env, lib_runtime

STUB = str(HELPERS / "stub_vllm")


def test_plugin_off_imports_nothing_of_vllm():
    """vLLM imports the package to load the plugin in every process:
    with ECXFER_VLLM unset neither the import nor register() imports a
    module of vLLM's or loads the library (the package used to import
    vLLM's DataTransport, and its parents, as it was imported)."""
    code = (
        "import sys, json; before = set(sys.modules); "
        "import ecxfer.vllm_plugin; ecxfer.vllm_plugin.register(); "
        "from ecxfer import _lib; "
        "print('@@', json.dumps({'vllm': sorted(m for m in sys.modules if m.startswith('vllm') and m not in before), "
        "'loaded': _lib.loaded(), 'transport': 'ecxfer.transport' in sys.modules}))"
    )
    for value in ("", "0"):
        env = child_env({"ECXFER_VLLM": value})
        env["PYTHONPATH"] = os.pathsep.join([STUB, str(PYDIR)])
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.split("@@")[-1])
        assert out == {"vllm": [], "loaded": False, "transport": False}, (value, out)


def test_class_still_subclasses_datatransport_when_used():
    """The transport module, imported on first use of the class, still
    subclasses vLLM's DataTransport when vLLM (here the stand-in) is
    there."""
    code = (
        "import ecxfer; from vllm.distributed.ec_transfer.ec_connector.cpu.data.base import DataTransport; "
        "print('@@', issubclass(ecxfer.EcxferDataTransport, DataTransport))"
    )
    env = child_env({})
    env["PYTHONPATH"] = os.pathsep.join([STUB, str(PYDIR)])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("@@")[-1].strip() == "True"


def test_deregister_interrupted_after_teardown():
    """A signal handler's exception raised as deregister() lets go of the
    finalizer: the library has torn the transport down by then (the
    finalizer used to be detached first, and an exception there left
    the library's transport, its thread and registration, for good)."""
    before = lib_runtime()["transports"]
    t = ecxfer.EcxferDataTransport("gap-dereg", 0, 8, 64, 8 * 64, backend="loopback")
    assert lib_runtime()["transports"] == before + 1
    real = t._finalizer

    class Interrupted:
        def detach(self):
            real.detach()
            raise KeyboardInterrupt  # what a SIGINT handled here raises

    t._finalizer = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        t.deregister()
    assert t.closed
    assert lib_runtime()["transports"] == before


def test_options_env_repeated_key(monkeypatch):
    """json keeps the last of two repeated keys; the library refuses an
    option given twice, and so does ECXFER_OPTIONS now."""
    monkeypatch.setenv("ECXFER_OPTIONS", '{"backend": "pigeon", "backend": "loopback"}')
    with pytest.raises(ecxfer.ConfigError, match="'backend' twice"):
        ecxfer.EcxferDataTransport("gap-opts", 0, 8, 64, 8 * 64)
    monkeypatch.setenv("ECXFER_OPTIONS", '{"backend": "loopback", "x": {"a": 1, "a": 2}}')
    with pytest.raises(ecxfer.ConfigError, match="'a' twice"):
        ecxfer.EcxferDataTransport("gap-opts", 0, 8, 64, 8 * 64)


def test_post_read_index_list_longer_than_any_size():
    """len() of a range of 2**70 items overflows: an ecxfer error, as
    every exception of post_read is (it used to be OverflowError)."""
    t = ecxfer.EcxferDataTransport("gap-huge", 0, 8, 64, 8 * 64, backend="loopback")
    try:
        peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
        with pytest.raises(ecxfer.IndexRangeError):
            t.post_read(range(2**70), peer, range(2**70), b"")
        with pytest.raises(ecxfer.EcxferError):
            t.post_read([0], peer, range(2**70), b"")
    finally:
        t.deregister()


def test_notifs_interrupted_while_decoded_are_kept(monkeypatch):
    """A signal handler's exception raised while get_new_notifs copies or
    decodes what the library handed over: the notifications are kept for
    the next call (they used to be freed and lost, and a vLLM producer
    then never frees those blocks)."""
    p = ecxfer.EcxferDataTransport("gap-np", 0, 8, 64, 8 * 64, backend="loopback")
    c = ecxfer.EcxferDataTransport("gap-nc", 0, 8, 64, 8 * 64, backend="loopback")
    try:
        peer = c.add_remote_peer(p.get_agent_metadata(), p.get_mem_descriptor())
        for i in range(3):
            h = c.post_read([i], peer, [i], b"sess:hash-%d" % i)
            assert c.wait(h, 10) == "DONE"
            c.release_xfer_handle(h)
        deadline = time.monotonic() + 10
        while p.stats()["notifs_received"] < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert p.stats()["notifs_received"] == 3
        real = transport.decode_notifs

        def interrupted(buf):
            real(buf)
            raise KeyboardInterrupt

        monkeypatch.setattr(transport, "decode_notifs", interrupted)
        with pytest.raises(KeyboardInterrupt):
            p.get_new_notifs()
        monkeypatch.setattr(transport, "decode_notifs", real)
        got = p.get_new_notifs()
        assert got == {"gap-nc": [b"sess:hash-0", b"sess:hash-1", b"sess:hash-2"]}
    finally:
        c.deregister()
        p.deregister()
