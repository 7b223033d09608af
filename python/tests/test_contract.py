"""vLLM's DataTransport contract on the real class (ucx backend), and what
vLLM's own tests do not check."""

import array
import collections
import ctypes
import json
import logging
import math
import random
import string
import struct
import threading
import uuid

import pytest

import ecxfer
from ecxfer import EcxferDataTransport, _lib
from ecxfer.transport import decode_notifs


def test_metadata_and_descriptor_are_bytes(pair):
    prod, _, cons, _, peer, _ = pair
    for t in (prod, cons):
        md, desc = t.get_agent_metadata(), t.get_mem_descriptor()
        assert isinstance(md, bytes) and md
        assert isinstance(desc, bytes) and desc
    assert peer == prod.agent_name


def test_read_moves_bytes_and_notifies_once(pair):
    prod, preg, cons, creg, peer, _ = pair
    bs = prod.block_size_bytes
    for i in range(8):
        preg.mm[i * bs : (i + 1) * bs] = bytes([i + 1]) * bs
    h = cons.post_read([10, 11, 12], peer, [1, 3, 5], b"sess-1:hash-a")
    assert isinstance(h, int) and h > 0
    assert cons.wait(h, timeout=10) == "DONE"
    assert cons.check_xfer_state(h) == "DONE"
    assert cons.xfer_error(h) is None
    assert creg.mm[10 * bs : 11 * bs] == bytes([2]) * bs
    assert creg.mm[11 * bs : 12 * bs] == bytes([4]) * bs
    assert creg.mm[12 * bs : 13 * bs] == bytes([6]) * bs
    cons.release_xfer_handle(h)
    got = prod.wait_notifs(timeout=10)
    assert got == {cons.agent_name: [b"sess-1:hash-a"]}
    assert isinstance(got, dict) and all(isinstance(v, list) for v in got.values())
    assert prod.get_new_notifs() == {}, "a notification is handed out once"
    assert prod.wait_notifs(timeout=0.05) == {}


def test_empty_notif_sends_none(pair):
    prod, _, cons, _, peer, _ = pair
    h = cons.post_read([0], peer, [0], b"")
    assert cons.wait(h, 10) == "DONE"
    h2 = cons.post_read([1], peer, [1], b"marker")
    assert cons.wait(h2, 10) == "DONE"
    assert prod.wait_notifs(10) == {cons.agent_name: [b"marker"]}


def test_mismatch_is_value_error(pair):
    _, _, cons, _, peer, _ = pair
    with pytest.raises(ValueError, match="mismatch"):
        cons.post_read([1, 2, 3], peer, [1, 2], b"x")
    with pytest.raises(ecxfer.IndexMismatchError):
        cons.post_read(array.array("q", [1]), peer, array.array("q", []), b"x")
    assert cons.stats()["reads_posted"] == 0


def test_indices_one_dimensional_and_ordered(pair):
    """A 2-D index array (whose len() is not its number of indices), or
    an unordered collection (a set, a dict: the i-th local block goes with
    the i-th remote one), is refused, whatever the other list; nothing is
    posted. A 2-D array was flattened when both sides were 2-D, its
    rows counted against the other side's indices otherwise, and a set
    posted its blocks in hash order."""
    np = pytest.importorskip("numpy")
    _, _, cons, _, peer, _ = pair
    sq = np.arange(4, dtype=np.int64).reshape(2, 2)
    for local, remote in (
        (sq, [0, 1, 2, 3]),
        (sq, sq),
        (np.asfortranarray(sq), [0, 1, 2, 3]),
        ([0, 1, 2, 3], memoryview(sq)),
        ({1, 2}, [3, 4]),
        ([1, 2], frozenset({3, 4})),
        ({1: 0, 2: 0}, [3, 4]),
    ):
        with pytest.raises(ecxfer.BadArgumentTypeError):
            cons.post_read(local, peer, remote, b"x")
    assert cons.stats()["reads_posted"] == 0


def test_concurrent_deregister_waits_for_the_first(region):
    """A second deregister() while the first is tearing down returns only
    after the teardown: vLLM may unmap the region once its call returns."""
    n, bs = 16, 4096
    for _ in range(5):
        before = _live_transports()
        r = region(n * bs)
        t = ecxfer.EcxferDataTransport(f"dereg-{uuid.uuid4().hex[:6]}", r.addr, n, bs, n * bs)
        t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
        a = threading.Thread(target=t.deregister)
        a.start()
        while t._t != 0 and a.is_alive():
            pass  # until the first call has taken the transport
        t.deregister()
        assert _live_transports() == before  # torn down, not still going
        a.join()


def _live_transports():
    p = ctypes.c_void_p()
    n = _lib.lib.ecx_runtime(ctypes.byref(p))
    assert n > 0
    return json.loads(_lib.take_bytes(p, n))["transports"]


def test_unknown_agent_is_key_error(pair):
    _, _, cons, _, _, _ = pair
    with pytest.raises(KeyError, match="unknown agent"):
        cons.post_read([1], "nobody", [1], b"")
    with pytest.raises(ecxfer.UnknownPeerError):
        cons.post_read([1], "", [1], b"")


def test_index_out_of_range(pair):
    _, _, cons, _, peer, _ = pair
    for local, remote in (([64], [0]), ([0], [64]), ([-1], [0]), ([2**63 - 1], [0])):
        with pytest.raises(IndexError):
            cons.post_read(local, peer, remote, b"")
    with pytest.raises(IndexError):
        cons.post_read([2**64], peer, [0], b"")
    with pytest.raises(IndexError):  # any other iterable takes the same path
        cons.post_read(collections.deque([2**64]), peer, [0], b"")
    with pytest.raises(TypeError):
        cons.post_read(None, peer, None, b"")
    with pytest.raises(TypeError):
        cons.post_read(["a"], peer, ["b"], b"")
    assert cons.stats()["reads_posted"] == 0


def test_states_and_errors(pair, region):
    prod, _, cons, _, peer, _ = pair
    # PROC: a READ of 64 blocks of 1 MiB is in flight when first checked,
    # at least once in a few tries. (The pair's 64 x 4 KiB READ is copied
    # by the copy workers within microseconds, and a check copies a piece
    # of it too: on a quiet machine most first checks found it DONE, and
    # now and then all 50.)
    big, bs = 64, 1 << 20
    tall = []
    try:
        for role in ("prod", "cons"):
            r = region(big * bs)
            tall.append(
                EcxferDataTransport(
                    agent_name=f"{role}-big-{uuid.uuid4().hex[:6]}",
                    base_ptr=r.addr,
                    num_blocks=big,
                    block_size_bytes=bs,
                    total_size_bytes=big * bs,
                )
            )
        bpeer = tall[1].add_remote_peer(tall[0].get_agent_metadata(), tall[0].get_mem_descriptor())
        seen = set()
        for _ in range(50):
            h = tall[1].post_read(list(range(big)), bpeer, list(range(big)), b"")
            seen.add(tall[1].check_xfer_state(h))
            assert tall[1].wait(h, 10) == "DONE"
            tall[1].release_xfer_handle(h)
            if "PROC" in seen:
                break
        assert "PROC" in seen
    finally:
        for t in tall:
            t.deregister()
    h = cons.post_read(list(range(64)), peer, list(range(64)), b"")
    assert cons.wait(h, 10) == "DONE"
    cons.release_xfer_handle(h)
    # ERR: a released handle, a handle never issued, things that are not handles.
    assert cons.check_xfer_state(h) == "ERR"
    assert isinstance(cons.xfer_error(h), ecxfer.BadHandleError)
    for bad in (None, "h", -1, 0, 2**64, 1.5, 123456789):
        assert cons.check_xfer_state(bad) == "ERR"
        assert cons.wait(bad, 0.01) == "ERR"
    # ERR with the reason: READs in flight when their peer is removed are canceled.
    h = cons.post_read(list(range(64)), peer, list(range(64)), b"")
    cons.remove_remote_peer(peer)
    st = cons.wait(h, 10)
    assert st in ("DONE", "ERR")
    if st == "ERR":
        assert isinstance(cons.xfer_error(h), ecxfer.CanceledError)
    cons.release_xfer_handle(h)
    with pytest.raises(KeyError):
        cons.post_read([0], peer, [0], b"")


def test_never_raising_methods(pair, caplog):
    _, _, cons, _, peer, _ = pair
    h = cons.post_read([0], peer, [0], b"")
    assert cons.wait(h, 10) == "DONE"
    cons.release_xfer_handle(h)
    with caplog.at_level(logging.WARNING, logger="ecxfer"):
        cons.release_xfer_handle(h)  # double release
        cons.release_xfer_handle(None)
        cons.release_xfer_handle("x")
        cons.remove_remote_peer("nobody")
        cons.remove_remote_peer(None)
    assert len([r for r in caplog.records if r.name == "ecxfer"]) == 5
    cons.deregister()
    cons.deregister()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ecxfer"):
        cons.remove_remote_peer(peer)
        cons.release_xfer_handle(h)
    logged = [r.exc_info[1] for r in caplog.records if r.name == "ecxfer"]
    assert len(logged) == 2 and all(
        isinstance(e, ecxfer.ClosedError) and str(e) == "ecxfer: transport deregistered" for e in logged
    ), logged
    err = cons.xfer_error(h)
    assert isinstance(err, ecxfer.ClosedError) and str(err) == "ecxfer: transport deregistered", err
    assert cons.check_xfer_state(h) == "ERR"
    assert cons.get_new_notifs() == {}
    assert cons.closed
    # One message for every call after deregister(), not the library's
    # internal id.
    closed = "^ecxfer: transport deregistered$"
    with pytest.raises(ecxfer.ClosedError, match=closed):
        cons.post_read([0], peer, [0], b"")
    with pytest.raises(ecxfer.ClosedError, match=closed):
        cons.get_agent_metadata()
    with pytest.raises(ecxfer.ClosedError, match=closed):
        cons.get_mem_descriptor()
    with pytest.raises(ecxfer.ClosedError, match=closed):
        cons.add_remote_peer(b"x", b"y")
    with pytest.raises(ecxfer.ClosedError, match=closed):
        cons.stats()


def test_bad_metadata_and_descriptor(pair):
    prod, _, cons, _, _, _ = pair
    md, desc = prod.get_agent_metadata(), prod.get_mem_descriptor()
    with pytest.raises(ecxfer.BadMetadataError):
        cons.add_remote_peer(b"", desc)
    with pytest.raises(ValueError):
        cons.add_remote_peer(b"\x00garbage" * 10, desc)
    with pytest.raises(ecxfer.BadDescriptorError):
        cons.add_remote_peer(md, b"\xc1")
    with pytest.raises(ecxfer.BadDescriptorError):
        cons.add_remote_peer(md, b"\x90")  # an empty msgpack list
    with pytest.raises(ValueError):
        cons.add_remote_peer(md[: len(md) // 2], desc)
    assert cons.add_remote_peer(md, desc) == prod.agent_name, "the same peer again is fine"


def test_notif_limits(pair):
    _, _, cons, _, peer, _ = pair
    with pytest.raises(ecxfer.BadNotifError):
        cons.post_read([0], peer, [0], b"x" * (64 * 1024 + 1))
    h = cons.post_read([0], peer, [0], "str:is-encoded")
    assert cons.wait(h, 10) == "DONE"


def test_index_inputs_are_read_in_place(pair):
    """Lists, tuples, ranges, array('q'), memoryviews and numpy int64 all
    read the same blocks."""
    prod, preg, cons, creg, peer, _ = pair
    bs = prod.block_size_bytes
    for i in range(64):
        preg.mm[i * bs : i * bs + 8] = i.to_bytes(8, "little")
    a = array.array("q", [40, 41])
    inputs = [
        ([20, 21], [5, 6]),
        ((22, 23), (7, 8)),
        (range(24, 26), range(9, 11)),
        (array.array("q", [26, 27]), array.array("q", [11, 12])),
        (memoryview(array.array("q", [28, 29])), memoryview(bytes(array.array("q", [13, 14]))).cast("q")),
        (a, a),
    ]
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        inputs.append((np.array([30, 31], dtype=np.int64), np.array([15, 16], dtype=np.int64)))
        inputs.append((np.array([32, 33], dtype=np.int32), np.arange(17, 19)))
        inputs.append((np.array([34, 35, 36, 37], dtype=np.int64)[::2], np.array([19, 20], dtype=np.int64)))
    for local, remote in inputs:
        h = cons.post_read(local, peer, remote, b"")
        assert cons.wait(h, 10) == "DONE"
        cons.release_xfer_handle(h)
        for li, ri in zip(list(local), list(remote)):
            assert creg.mm[li * bs : li * bs + 8] == int(ri).to_bytes(8, "little")


def test_options_reach_config(region):
    n, bs = 4, 4096
    r = region(n * bs)
    kw = dict(base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=n * bs)
    with pytest.raises(ecxfer.ConfigError, match="bogus"):
        EcxferDataTransport(agent_name="o1", bogus=1, **kw)
    with pytest.raises(ecxfer.ConfigError, match="idle"):
        EcxferDataTransport(agent_name="o2", idle="sometimes", **kw)
    with pytest.raises(ecxfer.ConfigError):
        EcxferDataTransport(agent_name="o3", pin_cpu=100000, **kw)
    with pytest.raises(ecxfer.ConfigError, match="backend"):
        EcxferDataTransport(agent_name="o4", backend="pigeon", **kw)
    with pytest.raises(ecxfer.ConfigError):
        EcxferDataTransport(agent_name="has space", **kw)
    with pytest.raises(ecxfer.ConfigError):
        EcxferDataTransport(agent_name="o5", base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=bs)
    with pytest.raises(ecxfer.ConfigError):
        EcxferDataTransport(agent_name="o6", base_ptr=r.addr, num_blocks=0, block_size_bytes=bs, total_size_bytes=bs)
    # A caller's region of 0 bytes, or of more than the library takes
    # (1 TiB): ConfigError as README says, not BadArgumentError.
    for size in (0, (1 << 40) + 1):
        with pytest.raises(ecxfer.ConfigError, match="total_size_bytes"):
            EcxferDataTransport(agent_name="o9", base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=size)
    # Options that are fine: the transport works with them.
    t = EcxferDataTransport(
        agent_name="o7", pin_cpu=0, idle="park", xfer_timeout_s=5, wait_spin_us=10, handles=64, max_notif=16, **kw
    )
    try:
        peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
        with pytest.raises(ecxfer.BadNotifError):  # max_notif reached the reactor
            t.post_read([0], peer, [1], b"x" * 17)
        h = t.post_read([0], peer, [1], b"x" * 16)
        assert t.wait(h, 10) == "DONE"
    finally:
        t.deregister()
    # Without base_ptr the transport allocates its own region.
    t = EcxferDataTransport(agent_name="o8", base_ptr=0, num_blocks=n, block_size_bytes=bs, total_size_bytes=0)
    assert t.get_mem_descriptor()
    t.deregister()


def test_options_from_environment(region, monkeypatch):
    n, bs = 4, 4096
    r = region(n * bs)
    kw = dict(base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=n * bs)
    monkeypatch.setenv("ECXFER_OPTIONS", '{"idle": "sometimes"}')
    with pytest.raises(ecxfer.ConfigError, match="idle"):
        EcxferDataTransport(agent_name="e1", **kw)
    EcxferDataTransport(agent_name="e2", idle="park", **kw).deregister()  # keywords win
    monkeypatch.setenv("ECXFER_OPTIONS", "not json")
    with pytest.raises(ecxfer.ConfigError, match="ECXFER_OPTIONS"):  # a ValueError too
        EcxferDataTransport(agent_name="e3", **kw)
    monkeypatch.setenv("ECXFER_OPTIONS", "[]")
    with pytest.raises(ecxfer.ConfigError, match="JSON object"):
        EcxferDataTransport(agent_name="e4", **kw)
    # Nested past the parser's recursion limit: a ConfigError, not a
    # RecursionError.
    monkeypatch.setenv("ECXFER_OPTIONS", "[" * 100000)
    with pytest.raises(ecxfer.ConfigError, match="ECXFER_OPTIONS"):
        EcxferDataTransport(agent_name="e5", **kw)
    # Python's json reads Infinity and NaN; JSON has neither, so the
    # option is named instead of the library failing on a character.
    for raw in ('{"xfer_timeout_s": Infinity}', '{"spin_for_us": NaN}', '{"xfer_timeout_s": 1e999}'):
        monkeypatch.setenv("ECXFER_OPTIONS", raw)
        with pytest.raises(ecxfer.ConfigError, match=r"option (xfer_timeout_s|spin_for_us)=(inf|nan)"):
            EcxferDataTransport(agent_name="e6", **kw)
    # The constructor's arguments are not options: a key of the library's
    # name for one is refused, not silently overwritten.
    for raw in ('{"block_size": 8192}', '{"num_blocks": 2}', '{"agent_name": "other"}'):
        monkeypatch.setenv("ECXFER_OPTIONS", raw)
        with pytest.raises(ecxfer.ConfigError, match="constructor"):
            EcxferDataTransport(agent_name="e8", **kw)
    monkeypatch.delenv("ECXFER_OPTIONS")
    with pytest.raises(ecxfer.ConfigError, match="constructor"):
        EcxferDataTransport(agent_name="e9", block_size=8192, **kw)
    with pytest.raises(ecxfer.ConfigError, match=r"option xfer_timeout_s=nan"):
        EcxferDataTransport(agent_name="e7", xfer_timeout_s=float("nan"), **kw)


def test_nixl_backend_without_nixl(region, monkeypatch, tmp_path):
    monkeypatch.delenv("NIXL_PREFIX", raising=False)
    monkeypatch.delenv("ECXFER_NIXL_LIB", raising=False)
    # The Go side reads its environment once, when libecxfer loads, but the
    # working directory each time: away from the project's .venv (where
    # make nixl puts the NIXL engine), NIXL is found nowhere.
    monkeypatch.chdir(tmp_path)
    r = region(4096)
    with pytest.raises(ecxfer.NoBackendError):
        EcxferDataTransport(
            agent_name="n1", base_ptr=r.addr, num_blocks=1, block_size_bytes=4096, total_size_bytes=4096, backend="nixl"
        )


def test_decode_notifs_hostile():
    assert decode_notifs(b"\x00\x00\x00\x00") == {}
    for bad in (b"", b"\x01\x00\x00", b"\x01\x00\x00\x00\x05\x00\x00\x00ab", b"\x00\x00\x00\x00x",
                b"\x01\x00\x00\x00\x01\x00\x00\x00a\x01\x00\x00\x00\xff\xff\xff\xff"):
        with pytest.raises(ValueError):
            decode_notifs(bad)


def _encode_notifs(d):
    """ecx_notifs' encoding, written out from its description: a count,
    then per sender its name and its messages, each with a uint32 length
    before it, all little-endian."""
    out = [struct.pack("<I", len(d))]
    for name, msgs in d.items():
        b = name.encode("ascii")
        out += [struct.pack("<I", len(b)), b, struct.pack("<I", len(msgs))]
        for m in msgs:
            out += [struct.pack("<I", len(m)), m]
    return b"".join(out)


def test_decode_notifs_fuzz():
    """Seeded random input for the decoder: what an encoding of random
    notifications decodes to is those notifications, and every mutation of
    one (cut short, bytes changed, bytes added, bytes removed) and random
    bytes decode to a dict of bytes lists or raise ValueError, nothing
    else, without reading a length as an amount to allocate."""
    rng = random.Random(20261204)
    for _ in range(2000):
        d = {}
        for _ in range(rng.randrange(4)):
            name = "".join(rng.choice(string.ascii_letters + "-_:.") for _ in range(rng.randrange(1, 12)))
            d[name] = [rng.randbytes(rng.choice((0, 1, 5, 40))) for _ in range(rng.randrange(4))]
        enc = _encode_notifs(d)
        assert decode_notifs(enc) == d
        for _ in range(4):
            b = bytearray(enc)
            op = rng.randrange(4)
            if op == 0:
                del b[rng.randrange(len(b) + 1) :]
            elif op == 1:
                for _ in range(rng.randrange(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 2:
                b[rng.randrange(len(b) + 1) : 0] = rng.randbytes(rng.randrange(1, 9))
            else:
                i = rng.randrange(len(b))
                del b[i : i + rng.randrange(1, 9)]
            for data in (bytes(b), rng.randbytes(rng.randrange(24))):
                try:
                    got = decode_notifs(data)
                except ValueError:
                    continue
                assert isinstance(got, dict)
                for k, v in got.items():
                    assert isinstance(k, str) and isinstance(v, list)
                    assert all(isinstance(m, bytes) for m in v)


def test_num_threads_sets_copy_workers(region):
    """vLLM's num_threads (NIXL's transfer threads) becomes the number of
    copy workers when above 1; 1, vLLM's default, keeps ecxfer's default;
    an explicit copy_workers wins; anything but an int >= 1 is refused."""
    n, bs = 4, 4096
    r = region(n * bs)
    kw = dict(base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=n * bs)
    for name, extra, want in (
        ("nt1", {}, 2),
        ("nt2", {"num_threads": 1}, 2),
        ("nt3", {"num_threads": 3}, 3),
        ("nt4", {"num_threads": 4, "copy_workers": 1}, 1),
    ):
        t = EcxferDataTransport(agent_name=name, **extra, **kw)
        try:
            assert t.stats()["copy_workers"] == want, (name, extra)
        finally:
            t.deregister()
    for bad in (0, -1, 2.5, "2", True):
        with pytest.raises(ecxfer.ConfigError, match="num_threads"):
            EcxferDataTransport(agent_name="ntbad", num_threads=bad, **kw)


def test_bad_arguments_are_ecxfer_errors(pair, region):
    """Arguments of the wrong type or range raise ecxfer errors (the README
    promises every exception is one), and nothing is silently bent into
    something else."""
    _, _, cons, _, peer, _ = pair
    with pytest.raises(ecxfer.BadArgumentTypeError, match="ints"):
        cons.post_read([1.0], peer, [0], b"")
    with pytest.raises(TypeError):  # still a TypeError too
        cons.post_read([None], peer, [0], b"")
    with pytest.raises(ecxfer.BadArgumentTypeError, match="sized"):
        cons.post_read(None, peer, None, b"")
    # An int is not a notification (bytes(3) would send three zero bytes).
    with pytest.raises(ecxfer.BadArgumentTypeError, match="notification"):
        cons.post_read([0], peer, [0], 3)
    h = cons.post_read([0], peer, [0], bytearray(b"s:h"))  # any bytes-like is
    assert cons.wait(h, 10) == "DONE"
    cons.release_xfer_handle(h)
    assert cons.stats()["reads_posted"] == 1
    with pytest.raises(ecxfer.BadArgumentTypeError, match="metadata"):
        cons.add_remote_peer(None, b"")
    with pytest.raises(ecxfer.BadArgumentTypeError, match="mem_descriptor"):
        cons.add_remote_peer(b"x", 5)
    # Timeouts: infinite is no limit, NaN and non-numbers are refused.
    h = cons.post_read([1], peer, [1], b"")
    assert cons.wait(h, float("inf")) == "DONE"
    cons.release_xfer_handle(h)
    with pytest.raises(ecxfer.BadArgumentError, match="NaN"):
        cons.wait(h, float("nan"))
    with pytest.raises(ecxfer.BadArgumentTypeError):
        cons.wait_notifs("soon")
    # float() would parse a string: "1" is not one second.
    with pytest.raises(ecxfer.BadArgumentTypeError, match="timeout"):
        cons.wait(h, "1")
    with pytest.raises(ecxfer.BadArgumentTypeError, match="timeout"):
        cons.wait_notifs(b"1")
    # Past a float's or int64's range: no limit, or none at all, never an
    # OverflowError. (h is released: "ERR" at once either way.)
    for t in (-math.inf, -1e300, -(10**400)):
        assert cons.wait_notifs(t) == {}
        assert cons.wait(h, t) == "ERR"
    h = cons.post_read([2], peer, [2], b"")
    assert cons.wait(h, 10**400) == "DONE"
    cons.release_xfer_handle(h)
    # bytes are a sequence of ints, but array('q') would read their bytes
    # as raw int64s: refused rather than read as other blocks.
    for b in (bytes([0, 1]), bytearray([0, 1])):
        with pytest.raises(ecxfer.BadArgumentTypeError, match="not " + type(b).__name__):
            cons.post_read(b, peer, [0, 1], b"")
        with pytest.raises(ecxfer.BadArgumentTypeError, match="not " + type(b).__name__):
            cons.post_read([0, 1], peer, b, b"")
    # ctypes would wrap these: 2**64 + 256 bytes passed as 256, a base of
    # 2**64 as NULL (a region of the transport's own).
    n, bs = 4, 4096
    r = region(n * bs)
    kw = dict(agent_name="range-0", num_blocks=n, block_size_bytes=bs)
    with pytest.raises(ecxfer.ConfigError, match="total_size_bytes"):
        EcxferDataTransport(base_ptr=r.addr, total_size_bytes=2**64 + 256, **kw)
    with pytest.raises(ecxfer.ConfigError, match="base_ptr"):
        EcxferDataTransport(base_ptr=2**64, total_size_bytes=n * bs, **kw)
    with pytest.raises(ecxfer.ConfigError, match="base_ptr"):
        EcxferDataTransport(base_ptr=-4096, total_size_bytes=n * bs, **kw)
    with pytest.raises(ecxfer.ConfigError, match="base_ptr"):
        EcxferDataTransport(base_ptr=1.5, total_size_bytes=n * bs, **kw)
    # Counts are ints, not bent into one; names are str; options are JSON.
    good = dict(agent_name="range-1", base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=n * bs)
    for bad, match in (
        (dict(num_blocks=4.5), "num_blocks"),
        (dict(num_blocks="4"), "num_blocks"),
        (dict(block_size_bytes=None), "block_size_bytes"),
        (dict(block_size_bytes=4096.0), "block_size_bytes"),
        (dict(agent_name=b"range-1"), "agent_name"),
        (dict(agent_name=None), "agent_name"),
        (dict(xfer_timeout_s=object()), "not JSON serializable"),
        # Only None means "not given": other falsy values are not bent
        # into it, and a misspelt name is refused whatever its value.
        (dict(base_ptr=0.0), "base_ptr"),
        (dict(total_size_bytes=""), "total_size_bytes"),
        (dict(xfer_timeout=None), "xfer_timeout"),
        # Exactly int64's largest nanosecond count: it used to pass the
        # range check and come out negative (no timeout at all).
        (dict(xfer_timeout_s=9223372036.854776), "xfer_timeout_s"),
    ):
        with pytest.raises(ecxfer.ConfigError, match=match):
            EcxferDataTransport(**{**good, **bad})
    with pytest.raises(ecxfer.BadArgumentTypeError, match="agent name"):
        cons.post_read([0], [peer], [0], b"")
