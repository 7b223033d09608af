"""Arguments and situations found by probing the package from outside:
peer names that are not names, notifications that are not UTF-8,
index objects with a broken array interface, options given as None,
waits without a time limit and signals, and fault handlers installed
after the library loaded."""

import logging
import signal
import subprocess
import sys

import pytest

import ecxfer
from conftest import PYDIR, child_env


def _loopback(name: str, **kw):
    return ecxfer.EcxferDataTransport(name, 0, 4, 4096, 0, backend="loopback", **kw)


def test_remove_remote_peer_refuses_non_names_cheaply(caplog):
    """remove_remote_peer never raises; an int is refused as a bad
    argument (bytes(n) would have made n zero bytes: 100,000,000 took
    2.4 GB), and an unknown name of 50 MB is logged and reported with at
    most 256 of its bytes quoted."""
    t = _loopback("arg-rm")
    try:
        with caplog.at_level(logging.WARNING, logger="ecxfer"):
            t.remove_remote_peer(100_000_000)
        assert any(isinstance(r.exc_info[1], ecxfer.BadArgumentTypeError) for r in caplog.records if r.exc_info)
        caplog.clear()
        big = "\x01" * 50_000_000
        with caplog.at_level(logging.WARNING, logger="ecxfer"):
            t.remove_remote_peer(big)
        (rec,) = [r for r in caplog.records if r.exc_info]
        err = rec.exc_info[1]
        assert isinstance(err, ecxfer.UnknownPeerError)
        assert "(50000000 bytes)" in str(err) and len(str(err)) < 2000, str(err)[:200]
        assert len(rec.getMessage()) < 2000
    finally:
        t.deregister()


def test_unencodable_notification_is_an_ecxfer_error():
    """A str notification with a lone surrogate cannot be UTF-8: a
    BadArgumentError (every exception is an EcxferError), not
    UnicodeEncodeError."""
    t = _loopback("arg-sur")
    try:
        peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
        with pytest.raises(ecxfer.BadArgumentError):
            t.post_read([0], peer, [1], "s:\ud800")
        h = t.post_read([0], peer, [1], "s:ok")  # the transport is fine
        assert t.wait(h, 10) == "DONE"
        t.release_xfer_handle(h)
    finally:
        t.deregister()


class _BrokenInterface(list):
    __array_interface__ = "not a dict"


def test_array_interface_that_is_not_a_dict_is_ignored():
    """An object whose __array_interface__ is not a dict is read as the
    sequence it is (it used to raise AttributeError from .get)."""
    t = _loopback("arg-ai")
    try:
        peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
        h = t.post_read(_BrokenInterface([0, 1]), peer, _BrokenInterface([2, 3]), b"")
        assert t.wait(h, 10) == "DONE"
        t.release_xfer_handle(h)
        with pytest.raises(ecxfer.BadArgumentTypeError):
            t.post_read(_BrokenInterface(["x"]), peer, [0], b"")
    finally:
        t.deregister()


def test_copy_workers_none_is_not_given(monkeypatch):
    """num_threads sets copy_workers when that option is not given, and a
    keyword (or ECXFER_OPTIONS value) of None is not given."""
    for kw in ({}, {"copy_workers": None}):
        t = ecxfer.EcxferDataTransport("arg-nt", 0, 4, 4096, 0, num_threads=4, **kw)
        try:
            assert t.stats()["copy_workers"] == 4, kw
        finally:
            t.deregister()
    monkeypatch.setenv("ECXFER_OPTIONS", '{"copy_workers": null}')
    t = ecxfer.EcxferDataTransport("arg-nt", 0, 4, 4096, 0, num_threads=3)
    try:
        assert t.stats()["copy_workers"] == 3
    finally:
        t.deregister()
    t = ecxfer.EcxferDataTransport("arg-nt", 0, 4, 4096, 0, num_threads=3, copy_workers=1)
    try:
        assert t.stats()["copy_workers"] == 1, "an explicit copy_workers wins"
    finally:
        t.deregister()


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm()


def test_unbounded_wait_notifs_lets_signal_handlers_run():
    """wait_notifs(None) blocks in slices, so a signal handler (Ctrl-C's
    KeyboardInterrupt, here SIGALRM's) runs and its exception ends the
    wait; the library alone would block until a notification came."""
    t = _loopback("arg-sig")
    old = signal.signal(signal.SIGALRM, _raise_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Alarm):
            t.wait_notifs(None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t.deregister()


_FAULTS = """
import faulthandler, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
import ecxfer
def make(name):
    return ecxfer.EcxferDataTransport(name, 0, 4, 4096, 0, backend="loopback")
a = make("fh-a")
faulthandler.enable()
b = make("fh-b")
peer = b.add_remote_peer(a.get_agent_metadata(), a.get_mem_descriptor())
c = make("fh-c")
for t in (a, b, c):
    t.deregister()
print("done")
"""


@pytest.mark.parametrize("early", [False, True])
def test_fault_handlers_installed_after_load_are_reported(early):
    """A SIGBUS/SIGSEGV handler installed after the library loaded
    (faulthandler.enable()) replaces the one that turns a truncated
    producer file into a failed READ: the next transport made (or peer
    added) logs a warning, once. With faulthandler enabled before the
    library loads (-X faulthandler), Go's handlers sit on top of it and
    nothing is logged."""
    args = [sys.executable] + (["-X", "faulthandler"] if early else []) + ["-c", _FAULTS]
    env = child_env()
    env.pop("PYTHONFAULTHANDLER", None)
    out = subprocess.run(args, env=env, cwd=PYDIR, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "done"
    warned = [line for line in lines if "handler was installed after libecxfer loaded" in line]
    if early:
        assert warned == [], out.stdout
    else:
        assert len(warned) == 1, out.stdout
        assert "SIGBUS and SIGSEGV" in warned[0]
