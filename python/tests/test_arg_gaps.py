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
from conftest import PYDIR, child_env, lib_runtime


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


class _DataNone(list):
    __array_interface__ = {"typestr": "<i8", "shape": (2,), "data": None, "version": 3}


class _DataBuffer(list):
    # "data" may be a buffer object: its first byte is no address.
    __array_interface__ = {"typestr": "<i8", "shape": (2,), "data": b"\x05\x00", "version": 3}


class _DataOffset(list):
    __array_interface__ = {"typestr": "<i8", "shape": (2,), "data": (8, False), "offset": 16, "version": 3}


def test_array_interface_without_an_address_is_read_as_a_sequence():
    """An __array_interface__ whose "data" is None or a buffer object, or
    that has an offset, is not taken for an address: the object is read as
    the sequence it is (None raised TypeError; a buffer's first byte was
    used as the address)."""
    t = _loopback("arg-ai2")
    try:
        peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
        for cls in (_DataNone, _DataBuffer, _DataOffset):
            h = t.post_read(cls([0, 1]), peer, cls([2, 3]), b"")
            assert t.wait(h, 10) == "DONE", cls.__name__
            t.release_xfer_handle(h)
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
    # NIXL takes any num_threads; the copy workers stop at their limit.
    monkeypatch.delenv("ECXFER_OPTIONS")
    t = ecxfer.EcxferDataTransport("arg-nt", 0, 4, 4096, 0, num_threads=1000)
    try:
        assert t.stats()["copy_workers"] == 256
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


def test_signal_during_wait_notifs_keeps_the_notifications(monkeypatch):
    """A signal handler that raises as ecx_notifs returns (wait_notifs
    waits in slices so that handlers run) used to lose the notifications
    the library had just handed over: its return value, their length, went
    with the exception, and they were never freed. The next call now hands
    them out. The wrapper raises where the handler would."""
    from ecxfer import transport

    p, c = _loopback("arg-held-p"), _loopback("arg-held-c")
    real = transport._lib_
    try:
        peer = c.add_remote_peer(p.get_agent_metadata(), p.get_mem_descriptor())
        for i in range(2):
            h = c.post_read([0], peer, [1], b"sess:hash-%d" % i)
            assert c.wait(h, 10) == "DONE"
            c.release_xfer_handle(h)

        class Lib:
            def __getattr__(self, name):
                return getattr(real, name)

            def ecx_notifs(self, tid, timeout_ns, out):
                n = real.ecx_notifs(tid, timeout_ns, out)
                if n > 0:
                    raise _Alarm()
                return n

        monkeypatch.setattr(transport, "_lib_", Lib())
        with pytest.raises(_Alarm):
            p.wait_notifs(10)
        monkeypatch.setattr(transport, "_lib_", real)
        got = p.get_new_notifs()
        while sum(len(v) for v in got.values()) < 2:  # the second may come after the first
            more = p.wait_notifs(10)
            assert more, f"only {got} arrived"
            for k, v in more.items():
                got.setdefault(k, []).extend(v)
        assert got == {c.agent_name: [b"sess:hash-0", b"sess:hash-1"]}
        assert p.get_new_notifs() == {}
    finally:
        monkeypatch.setattr(transport, "_lib_", real)
        c.deregister()
        p.deregister()


def test_signal_as_calls_return_leaks_nothing(monkeypatch):
    """A signal handler that raises as ecx_new returns used to leave the
    transport just made without an owner (its reactor running, the caller's
    region held, for the life of the process); one that raises as ecx_blob
    or ecx_stats returns, the buffer handed over unfreed. The wrapper
    raises where the handler would."""
    from ecxfer import transport

    real = transport._lib_
    base = lib_runtime()["transports"]

    class Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        def ecx_new(self, *a):
            rc = real.ecx_new(*a)
            raise _Alarm()

    _loopback("arg-new-warm").deregister()  # binds the library
    real = transport._lib_
    monkeypatch.setattr(transport, "_lib_", Lib())
    monkeypatch.setattr(transport, "_bind", lambda: None)  # it would put the library back
    with pytest.raises(_Alarm):
        _loopback("arg-new-sig")
    monkeypatch.setattr(transport, "_lib_", real)
    assert lib_runtime()["transports"] == base, "the transport made as the signal came is left"

    t = _loopback("arg-blob-sig")
    freed = []

    class Lib2:
        def __getattr__(self, name):
            return getattr(real, name)

        def ecx_blob(self, tid, which, out):
            real.ecx_blob(tid, which, out)
            raise _Alarm()

        def ecx_stats(self, tid, out):
            real.ecx_stats(tid, out)
            raise _Alarm()

        def ecx_free(self, p):
            freed.append(p.value)
            real.ecx_free(p)

    try:
        monkeypatch.setattr(transport, "_lib_", Lib2())
        with pytest.raises(_Alarm):
            t.get_agent_metadata()
        with pytest.raises(_Alarm):
            t.stats()
        assert len(freed) == 2 and all(freed), freed
    finally:
        monkeypatch.setattr(transport, "_lib_", real)
        t.deregister()


_REENTER = r"""
import os, signal
import ecxfer
from ecxfer import transport
t = ecxfer.EcxferDataTransport("arg-reenter", 0, 4, 4096, 0, backend="loopback")
real = transport._lib_
class Lib:
    def __getattr__(self, name):
        return getattr(real, name)
    def ecx_deregister(self, tid):
        rc = real.ecx_deregister(tid)
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs as this returns, in deregister()
        return rc
calls = []
def handler(*a):
    calls.append(1)
    t.deregister()
signal.signal(signal.SIGUSR1, handler)
transport._lib_ = Lib()
t.deregister()
print("done", len(calls), t.closed)
"""


def test_deregister_from_a_signal_handler_during_deregister():
    """A handler that calls deregister() (SIGTERM -> clean up) runs in the
    thread a deregister() may be in, which holds the transport's lock: the
    process used to hang there for good. The inner call now returns."""
    r = subprocess.run([sys.executable, "-c", _REENTER], env=child_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["done", "1", "True"]


_FORK_DEREG = r"""
import os, threading, time
import ecxfer
from ecxfer import transport
t = ecxfer.EcxferDataTransport("arg-forkdereg", 0, 4, 4096, 0, backend="loopback")
real = transport._lib_
inside, go = threading.Event(), threading.Event()
class Lib:
    def __getattr__(self, name):
        return getattr(real, name)
    def ecx_deregister(self, tid):
        inside.set()
        go.wait(30)
        return real.ecx_deregister(tid)
transport._lib_ = Lib()
th = threading.Thread(target=t.deregister)
th.start()
inside.wait(30)
pid = os.fork()
if pid == 0:
    t.deregister()  # the lock was held at the fork, by a thread the child does not have
    os._exit(0 if t.closed else 1)
deadline = time.monotonic() + 20
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        result = os.waitstatus_to_exitcode(status)
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        result = "hung"
        break
    time.sleep(0.01)
go.set()
th.join()
print("child", result, t.closed)
"""


def test_deregister_in_a_child_forked_during_deregister():
    """A child forked while another thread of the parent was inside
    deregister() inherited the transport's lock held; its own deregister()
    (or a `with` block's end) waited for it forever. In a forked child it
    only forgets the transport, without the lock."""
    r = subprocess.run([sys.executable, "-c", _FORK_DEREG], env=child_env(), capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["child", "0", "True"]
