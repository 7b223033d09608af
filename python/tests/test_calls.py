"""The builtins libecxfer makes for the calls of every READ (check,
release, wait; post_read is test_lists.py's): what they return for good
and hostile arguments, that the transport's methods go through them and
say the same as the general path, and that they keep the interpreter's
reference counts."""

import sys
import tracemalloc

import pytest

from ecxfer import _lib, transport

# Arguments that are not a handle: the builtins leave them alone.
NOT_HANDLES = (0, -1, 2**64, 2**100, True, False, 1.0, "1", b"1", None, [1], object())


class _Int(int):
    pass


@pytest.fixture
def calls(pair):
    c = _lib.lib.calls
    assert c is not None, "a CPython with a GIL must have the builtins"
    assert (transport._check_py, transport._release_py, transport._wait_py) == (c.check, c.release, c.wait)
    return c


def _read(cons, peer, notif=b""):
    h = cons.post_read([1], peer, [2], notif)
    assert cons.wait(h, 10) == "DONE"
    return h


def test_check_states_are_the_module_strings(pair, calls):
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    done = calls.check(cons._t, h)
    assert done == "DONE" and done is _lib.STATES[1]
    assert cons.check_xfer_state(h) is _lib.STATES[1]
    cons.release_xfer_handle(h)
    assert calls.check(cons._t, h) is _lib.STATES[2]
    # An error's message is not left behind for the thread's next failure.
    assert _lib.last_error() == ""


def test_check_hostile(pair, calls):
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    t = cons._t
    for bad in NOT_HANDLES + (_Int(h),):
        assert calls.check(t, bad) == "ERR", bad
        assert cons.check_xfer_state(bad) == "ERR", bad
    for args in ((), (t,), (t, h, 0), (True, h), (-1, h), (2**64, h), (987654, h), (None, h)):
        assert calls.check(*args) == "ERR", args
    with pytest.raises(TypeError):
        calls.check(t, h=h)
    assert calls.check(t, h) == "DONE"  # nothing above touched it
    assert _lib.last_error() == ""
    cons.release_xfer_handle(h)


def test_release_builtin(pair, calls):
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    t = cons._t
    for bad in NOT_HANDLES + (_Int(h),):
        assert calls.release(t, bad) == _lib.UNPACKED, bad
    for args in ((), (t,), (t, h, 0), (True, h), (-1, h), (None, h)):
        assert calls.release(*args) == _lib.UNPACKED, args
    assert calls.check(t, h) == "DONE"  # none of them released it
    assert calls.release(987654, h) == _lib.UNKNOWN_TRANSPORT
    assert "987654" in _lib.last_error()
    assert calls.release(t, h) == 0
    assert calls.release(t, h) == _lib.BAD_HANDLE  # a second release
    assert "handle" in _lib.last_error()
    assert cons.stats()["live_handles"] == 0


def test_release_method_logs_what_the_builtin_refuses(pair, calls, caplog):
    """release_xfer_handle never raises: a non-handle and a second release
    are logged, each with what is wrong."""
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    cons.release_xfer_handle(h)
    with caplog.at_level("WARNING", logger="ecxfer"):
        cons.release_xfer_handle(h)
        cons.release_xfer_handle(-5)
        cons.release_xfer_handle("x")
    msgs = [r.exc_info[1] for r in caplog.records]
    assert [type(e).__name__ for e in msgs] == ["BadHandleError"] * 3
    assert "stale" in str(msgs[0]) or "unknown" in str(msgs[0])
    assert "not a handle: -5" in str(msgs[1]) and "not a handle: 'x'" in str(msgs[2])


def test_wait_builtin(pair, calls):
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    t = cons._t
    assert calls.wait(t, h, 0) == 1
    assert calls.wait(t, h, -1) == 1
    for args in ((t, h), (t, h, 0, 0), (t, h, 1.0), (t, h, 2**63), (t, h, None), (t, 0, 0), (t, True, 0), (True, h, 0)):
        assert calls.wait(*args) == _lib.UNPACKED, args
    assert calls.wait(987654, h, 0) == _lib.UNKNOWN_TRANSPORT
    _lib.last_error()
    cons.release_xfer_handle(h)
    assert calls.wait(t, h, 0) == _lib.BAD_HANDLE
    _lib.last_error()
    assert cons.wait(h, 1) == "ERR"
    assert _lib.last_error() == ""


def test_wait_on_an_ended_read_still_checks_its_timeout(pair, calls):
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    from ecxfer import BadArgumentError

    with pytest.raises(BadArgumentError):
        cons.wait(h, "1")
    with pytest.raises(BadArgumentError):
        cons.wait(h, float("nan"))
    assert cons.wait(h, 0) == cons.wait(h, 1e300) == cons.wait(h, 2**1100) == "DONE"
    cons.release_xfer_handle(h)


def test_builtins_keep_reference_counts(pair, calls):
    """The states come back with a reference of their own, and the
    handles made for post_read are the caller's alone: many calls move
    neither the strings' counts nor the memory Python holds."""
    _, _, cons, _, peer, _ = pair
    h = _read(cons, peer)
    t = cons._t
    states = _lib.STATES
    before = [sys.getrefcount(s) for s in states]
    for _ in range(20000):
        calls.check(t, h)
        calls.check(t, 0)
    assert [sys.getrefcount(s) for s in states] == before
    cons.release_xfer_handle(h)
    for _ in range(100):  # warm: free lists, the library's handle slots
        assert calls.release(t, calls.post_read(t, [1], cons._peers, peer, [2], b"")) == 0
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            hh = calls.post_read(t, [1], cons._peers, peer, [2], b"")
            assert hh > 2**32  # a handle Python allocates an int for
            assert calls.wait(t, hh, 10**9) == 1
            assert calls.release(t, hh) == 0
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # A reference kept per handle would hold 20,000 ints: over 600 KB.
    assert grown < 64 * 1024, grown
