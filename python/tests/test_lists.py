"""post_read's C path for index lists (cmd/libecxfer/pycalls.c): lists and
tuples of ints, as vLLM passes them, are read in C with the GIL held, each
int object once. It is the path such lists take; it reads the same blocks
as the general path; whatever it does not take (bools, int subclasses,
ints beyond int64, other sequences) goes the general way, with the same
result; and the GIL is released for the post itself."""

import array
import ctypes
import json
import random
import subprocess
import sys

import pytest

import ecxfer
from conftest import PYDIR, child_env
from ecxfer import EcxferDataTransport, _lib, transport


@pytest.fixture
def spied(pair, monkeypatch):
    """The pair, with the C path's calls and what they returned recorded."""
    real = transport._post_py
    assert real is not None, "a CPython with a GIL must have the C path"
    got = []

    def spy(*args):
        rc = real(*args)
        got.append(rc)
        return rc

    monkeypatch.setattr(transport, "_post_py", spy)
    return pair, got


def _mark(preg, bs, n):
    for i in range(n):
        preg.mm[i * bs : i * bs + 8] = i.to_bytes(8, "little")


def _landed(creg, bs, local, remote):
    return all(creg.mm[li * bs : li * bs + 8] == int(ri).to_bytes(8, "little") for li, ri in zip(local, remote))


def test_lists_and_tuples_take_the_c_path(spied):
    (prod, preg, cons, creg, peer, _), got = spied
    bs = prod.block_size_bytes
    _mark(preg, bs, 64)
    rng = random.Random(7)
    for k in range(6):
        local, remote = rng.sample(range(64), 40), rng.sample(range(64), 40)
        if k % 2:
            local, remote = tuple(local), tuple(remote)
        creg.mm[: 16 * bs] = bytes(16 * bs)
        h = cons.post_read(local, peer, remote, b"s:%d" % k)
        assert got[-1] == h > 0
        assert cons.wait(h, 10) == "DONE"
        cons.release_xfer_handle(h)
        assert _landed(creg, bs, local, remote)
    assert len(got) == 6
    notifs = []
    while len(notifs) < 6:
        more = prod.wait_notifs(10)
        assert more, f"notifications missing: have {notifs}"
        notifs += more[cons.agent_name]
    assert sorted(notifs) == [b"s:%d" % k for k in range(6)]


def test_notification_not_bytes_still_takes_the_c_path(spied):
    """A notification given as a bytearray or memoryview: the first try
    leaves it (UNPACKED), the second, with it made bytes, reads the lists
    in C; what arrives is the same bytes."""
    (prod, preg, cons, creg, peer, _), got = spied
    bs = prod.block_size_bytes
    _mark(preg, bs, 8)
    for k, msg in enumerate((bytearray(b"ba:1"), memoryview(b"mv:2"))):
        h = cons.post_read([k], peer, [k + 3], msg)
        assert got[-2:] == [_lib.UNPACKED, h] and h > 0
        assert cons.wait(h, 10) == "DONE"
        cons.release_xfer_handle(h)
        assert _landed(creg, bs, [k], [k + 3])
    assert prod.wait_notifs(10)[cons.agent_name] == [b"ba:1", b"mv:2"]


def test_random_lists_same_as_general_path(spied, monkeypatch):
    """Seeded random index lists of mixed items: the C reader and the
    general path give the same outcome, a READ of the same blocks or the
    same exception type, for every one."""
    (prod, preg, cons, creg, peer, _), got = spied
    bs = prod.block_size_bytes
    _mark(preg, bs, 64)
    rng = random.Random(12)
    items = [
        lambda: rng.randrange(64),
        lambda: rng.randrange(64),
        lambda: rng.randrange(64),
        lambda: rng.choice([True, False]),
        lambda: _Index(rng.randrange(64)),
        lambda: rng.choice([-1, 64, 2**31, 2**62, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**100]),
        lambda: rng.choice([1.0, None, "3", b"3", [3], object()]),
    ]
    c_path = transport._post_py

    def outcome(local, remote):
        try:
            h = cons.post_read(local, peer, remote, b"")
        except Exception as e:  # noqa: BLE001 - the type is the outcome
            return type(e)
        st = cons.wait(h, 10)
        cons.release_xfer_handle(h)
        return st

    for case in range(400):
        n = rng.randrange(1, 9)
        local = [items[rng.randrange(len(items))]() if rng.random() < 0.2 else rng.randrange(64) for _ in range(n)]
        remote = [items[rng.randrange(len(items))]() if rng.random() < 0.2 else rng.randrange(64) for _ in range(n)]
        if rng.random() < 0.3:
            local, remote = tuple(local), tuple(remote)
        monkeypatch.setattr(transport, "_post_py", c_path)
        creg.mm[:] = bytes(len(creg.mm))
        a = outcome(local, remote)
        if a == "DONE" and all(type(x) is int for x in list(local) + list(remote)) and len(set(local)) == n:
            assert _landed(creg, bs, local, remote), (case, local, remote)
        monkeypatch.setattr(transport, "_post_py", None)
        b = outcome(local, remote)
        assert a == b, (case, local, remote, a, b)
    assert any(g > 0 for g in got) and _lib.UNPACKED in got


def test_long_lists_beyond_the_stack_buffer(region):
    """More indices than the C path keeps on its stack (2,048 for both
    lists) go through malloc'd memory: the same blocks land."""
    n, bs = 3000, 64
    made = []
    for name in ("long-prod", "long-cons"):
        r = region(n * bs)
        made.append((EcxferDataTransport(name, r.addr, n, bs, n * bs), r))
    (prod, preg), (cons, creg) = made
    try:
        _mark(preg, bs, n)
        peer = cons.add_remote_peer(prod.get_agent_metadata(), prod.get_mem_descriptor())
        local = list(range(n))
        remote = random.Random(3).sample(range(n), n)
        h = cons.post_read(local, peer, remote, b"")
        assert cons.wait(h, 30) == "DONE"
        assert _landed(creg, bs, local, remote)
    finally:
        cons.deregister()
        prod.deregister()


class _Index(int):
    """An int subclass: struct reads it through __index__, which may run
    any code; the C path must not read it at all."""


def test_what_the_c_path_refuses_goes_the_general_way(spied):
    (prod, preg, cons, creg, peer, _), got = spied
    bs = prod.block_size_bytes
    _mark(preg, bs, 64)
    for local, remote in (
        ([True, False], [3, 4]),  # bool is not an exact int
        ([_Index(5), _Index(6)], [7, 8]),
        ([9, 10], (11, _Index(12))),
    ):
        got.clear()
        h = cons.post_read(local, peer, remote, b"")
        assert got == [_lib.UNPACKED]
        assert cons.wait(h, 10) == "DONE"
        cons.release_xfer_handle(h)
        assert _landed(creg, bs, local, remote)
    # Errors come from the general path, which says what is wrong.
    for local, exc, match in (
        ([2**64], IndexError, None),
        ([-(2**64)], IndexError, None),
        (["a"], ecxfer.BadArgumentTypeError, "ints"),
        ([1.0], ecxfer.BadArgumentTypeError, "ints"),
        ([None], TypeError, None),
    ):
        got.clear()
        with pytest.raises(exc, match=match):
            cons.post_read(local, peer, [0], b"")
        assert got == [_lib.UNPACKED]
    # In int64's range but not a block: the library's own range check.
    for bad in (2**63 - 1, -1, 64):
        got.clear()
        with pytest.raises(ecxfer.IndexRangeError):
            cons.post_read([bad], peer, [0], b"")
        assert got == [_lib.INDEX_RANGE]
    assert cons.stats()["reads_posted"] == 3


def test_an_index_that_changes_the_list(spied):
    """An int subclass whose __index__ empties the list it is in: the C
    path never calls it (it would hold pointers into the list meanwhile);
    the general path reads a copy of the list's items."""
    (prod, preg, cons, creg, peer, _), got = spied
    bs = prod.block_size_bytes
    _mark(preg, bs, 64)
    local = [1, 2, 3]

    class Evil(int):
        def __index__(self):
            local.clear()
            return int(self)

    local.insert(1, Evil(20))
    remote = [5, 6, 7, 8]
    want = list(local)
    h = cons.post_read(local, peer, remote, b"")
    assert got == [_lib.UNPACKED]
    assert cons.wait(h, 10) == "DONE"
    assert _landed(creg, bs, want, remote)


def test_lists_changed_after_the_length_check(spied):
    """Lists whose lengths differ by the time C reads them (here a str
    notification whose encode() grows one; another thread could do the
    same) still raise vLLM's "mismatch" ValueError, from the general
    path, not the library's own wording."""
    (_, _, cons, _, peer, _), got = spied
    local = [1, 2]

    class Msg(str):
        def encode(self, *args):
            local.append(3)
            return b"s:h"

    with pytest.raises(ValueError, match="mismatch"):
        cons.post_read(local, peer, [4, 5], Msg("s:h"))
    # The first try leaves the str notification; the second, with it made
    # bytes (and the list grown), refuses the lengths.
    assert got == [_lib.UNPACKED, _lib.UNPACKED]
    assert cons.stats()["reads_posted"] == 0


def test_other_sequences_refused_by_the_c_path(spied):
    """A list subclass, an array, a range, lists of other lengths: the
    builtin refuses them before it reads an item, and the general path
    posts them (or raises vLLM's mismatch)."""
    (prod, preg, cons, creg, peer, _), got = spied

    class L(list):
        pass

    for local, remote in (
        (L([1, 2]), [3, 4]),
        ([1, 2], array.array("q", [3, 4])),
        (range(2), [3, 4]),
    ):
        h = cons.post_read(local, peer, remote, b"")
        assert cons.wait(h, 10) == "DONE"
        cons.release_xfer_handle(h)
    with pytest.raises(ValueError, match="mismatch"):
        cons.post_read([1, 2], peer, [3], b"")
    assert got == [_lib.UNPACKED] * 4
    assert cons.stats()["reads_posted"] == 3


def test_empty_lists_same_either_way(spied, monkeypatch):
    (_, _, cons, _, peer, _), got = spied
    with pytest.raises(ecxfer.EcxferError) as c_way:
        cons.post_read([], peer, [], b"")
    assert got and got[-1] < 0 and got[-1] != _lib.UNPACKED
    monkeypatch.setattr(transport, "_post_py", None)
    with pytest.raises(ecxfer.EcxferError) as general:
        cons.post_read([], peer, [], b"")
    assert type(c_way.value) is type(general.value)


def test_c_entry_points_hostile(pair):
    """ecx_py_api with a wrong count or a NULL refuses and installs
    nothing; the post_read builtin refuses what is not a list or tuple of
    ints, or an int or bytes where one is due, before it posts, and
    reports the library's own errors."""
    _, _, cons, _, peer, _ = pair
    lib = _lib.lib
    n = len(_lib._PY_API) + len(_lib._PY_OBJS)
    assert n == 26
    assert lib.ecx_py_api(None, n) == _lib.BAD_ARG
    arr = (ctypes.c_void_p * n)()
    assert lib.ecx_py_api(arr, n) == _lib.BAD_ARG  # all NULL
    assert lib.ecx_py_api(arr, n - 1) == _lib.BAD_ARG
    assert lib.ecx_py_api(arr, 12) == _lib.BAD_ARG  # the table of ABI version 4
    post = lib.calls.post_read
    assert post is transport._post_py
    peers = cons._peers
    t = cons._t

    class Name(str):
        def __hash__(self):
            raise AssertionError("the builtin ran Python code")

    for a, b in ((None, None), ({}, [1]), ([1], "ab"), (b"\x01", [1]), ([1], [[1]]), ([1, 2], [1])):
        assert post(t, a, peers, peer, b, b"") == _lib.UNPACKED
    for args in (
        (t, [1], peers, peer, [1]),  # too few
        (t, [1], peers, peer, [1], b"", 0),  # too many
        (t, [1], peers[peer], [1], b""),  # ABI version 4's call
        (t, [1], peers, peer, [1], bytearray(b"x")),  # notif not bytes
        (t, [1], peers, peer, [1], "x"),
        (t, [1], peers, peer, [1], None),
        (True, [1], peers, peer, [1], b""),  # t not an exact int in uint64's range
        (-1, [1], peers, peer, [1], b""),
        (float(t), [1], peers, peer, [1], b""),
        (t, [1], peers, "nobody", [1], b""),  # an agent peers lacks
        (t, [1], peers, Name(peer), [1], b""),  # a name that is not an exact str
        (t, [1], peers, [peer], [1], b""),  # unhashable
        (t, [1], dict(peers), peer.encode(), [1], b""),
        (t, [1], list(peers.items()), peer, [1], b""),  # peers not a dict
        (t, [1], {peer: True}, peer, [1], b""),  # ids not exact ints in uint64's range
        (t, [1], {peer: -1}, peer, [1], b""),
        (t, [1], {peer: 2**64}, peer, [1], b""),
        (t, [1], {peer: str(peers[peer])}, peer, [1], b""),
    ):
        assert post(*args) == _lib.UNPACKED, args
    with pytest.raises(TypeError):
        post(t, [1], peers, peer, [1], notif=b"")
    assert post(987654, [1], peers, peer, [1], b"") == _lib.UNKNOWN_TRANSPORT
    assert post(t, [1], {peer: 99}, peer, [1], b"") == _lib.UNKNOWN_PEER
    assert "peer id 99" in _lib.last_error()
    assert cons.stats()["reads_posted"] == 0
    # Still installed: lists still go through it.
    h = post(t, [1], peers, peer, [1], b"x")
    assert h > 0 and cons.wait(h, 10) == "DONE"
    assert cons.stats()["reads_posted"] == 1
    # Only four builtins; each call of ecx_py_call hands over a reference
    # of its own (ctypes takes it over).
    make = ctypes.PyDLL(_lib.library_path(), handle=lib._handle).ecx_py_call
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_int64]
    check = lib.calls.check
    refs = sys.getrefcount(check)
    same = all(make(1) is check for _ in range(1000))
    assert same and sys.getrefcount(check) == refs
    for i in (-1, 4, 2**40):
        assert make(i) is None


def test_switched_off_by_environment(monkeypatch):
    for var in ("ECXFER_PY_CALLS", "ECXFER_PY_LISTS"):
        monkeypatch.setenv(var, "0")
        assert _lib.calls(_lib.lib, _lib.library_path()) is None
        monkeypatch.delenv(var)
    assert _lib.calls(_lib.lib, _lib.library_path()) is not None


# The handle table full (256 handles, none released) and wait_when_busy:
# the next post_read with lists waits for room in the library. A second
# thread must get the GIL to release a handle; with the GIL held during
# the wait, nothing would ever release one (the parent's timeout fails
# the test).
BLOCKED_POST = r"""
import json, sys, threading, time
import ecxfer
from ecxfer import transport
assert transport._post_py is None
kw = dict(backend="loopback", handles=256, wait_when_busy=True)
p = ecxfer.EcxferDataTransport("gil-prod", 0, 16, 64, 16 * 64, **kw)
c = ecxfer.EcxferDataTransport("gil-cons", 0, 16, 64, 16 * 64, **kw)
assert transport._post_py is not None
name = c.add_remote_peer(p.get_agent_metadata(), p.get_mem_descriptor())
hs = [c.post_read([i % 16], name, [i % 16], b"") for i in range(256)]
released = []
def release():
    time.sleep(0.3)
    released.append(time.monotonic())
    c.release_xfer_handle(hs[0])
threading.Thread(target=release).start()
t0 = time.monotonic()
h = c.post_read([1, 2], name, [3, 4], b"")
out = {"released": bool(released), "waited": time.monotonic() - t0, "state": c.wait(h, 10)}
c.deregister()
p.deregister()
print("@@ " + json.dumps(out))
"""


def test_post_read_releases_the_gil():
    r = subprocess.run(
        [sys.executable, "-c", BLOCKED_POST],
        env=child_env(), capture_output=True, text=True, timeout=60, cwd=str(PYDIR),
    )
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-3000:]}"
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("@@ ")][-1][3:])
    assert out["released"] and out["waited"] >= 0.25, out
    assert out["state"] == "DONE"


def test_numpy_of_other_integer_types(pair, monkeypatch):
    """numpy index arrays of another integer type, byte order or layout
    read the right blocks, converted by numpy itself (one int64 copy),
    never element by element through array('q'), which made a Python
    object of every index."""
    np = pytest.importorskip("numpy")
    prod, preg, cons, creg, peer, _ = pair
    bs = 4096  # the pair's blocks
    _mark(preg, bs, 16)

    def no_q_array(x):
        raise AssertionError(f"array('q') for {x!r}")

    monkeypatch.setattr(transport, "_q_array", no_q_array)
    local = [3, 1, 4, 0, 5, 9, 2, 6]
    remote = [15, 8, 7, 11, 10, 13, 12, 14]
    wide = np.zeros(16, dtype=np.int64)
    wide[::2] = local
    for lo, ro in (
        (np.array(local, dtype=np.int32), np.array(remote, dtype=np.uint64)),
        (np.array(local, dtype=">i8"), np.array(remote, dtype=np.int16)),
        (wide[::2], np.array(remote, dtype=np.uint32)),
    ):
        creg.mm[: 16 * bs] = bytes(16 * bs)
        h = cons.post_read(lo, peer, ro, b"")
        assert cons.wait(h, 10) == "DONE"
        cons.release_xfer_handle(h)
        assert _landed(creg, bs, local, remote), (lo.dtype, ro.dtype)
    with pytest.raises(IndexError):  # 2**64-1 is not a block, even as uint64
        cons.post_read(np.array([1], dtype=np.uint64), peer, np.array([2**64 - 1], dtype=np.uint64), b"")
