"""libecxfer's C ABI called directly with what a careless or hostile C
caller passes: null pointers, negative and absurd lengths, unknown ids,
small buffers. Every call returns a code; none crashes."""

import ctypes
import json

import pytest

from ecxfer import _lib

lib = _lib.lib
P = ctypes.c_void_p


@pytest.fixture
def tid():
    out = ctypes.c_uint64()
    opts = json.dumps({"agent_name": "abi-0", "backend": "loopback", "block_size": 64, "num_blocks": 8}).encode()
    assert lib.ecx_new(opts, len(opts), None, 0, ctypes.byref(out)) == 0
    yield out.value
    assert lib.ecx_deregister(out.value) == 0


def test_new_hostile():
    out = ctypes.c_uint64()
    opts = b'{"agent_name":"x","backend":"loopback","block_size":64,"num_blocks":8}'
    assert lib.ecx_new(None, 5, None, 0, ctypes.byref(out)) == _lib.BAD_ARG
    assert lib.ecx_new(opts, -1, None, 0, ctypes.byref(out)) == _lib.BAD_ARG
    assert lib.ecx_new(opts, 1 << 62, None, 0, ctypes.byref(out)) == _lib.BAD_ARG
    assert lib.ecx_new(opts, len(opts), None, 0, None) == _lib.BAD_ARG
    assert "null out" in _lib.last_error()
    # No region but a length: refused (a negative one was taken).
    for n in (-1, 4096):
        assert lib.ecx_new(opts, len(opts), None, n, ctypes.byref(out)) == _lib.BAD_ARG
        assert "no region, but a length" in _lib.last_error()
    assert lib.ecx_new(opts, 3, None, 0, ctypes.byref(out)) == _lib.CONFIG  # cut JSON
    buf = ctypes.create_string_buffer(64)
    assert lib.ecx_new(opts, len(opts), buf, -5, ctypes.byref(out)) == _lib.BAD_ARG
    assert lib.ecx_new(opts, len(opts), buf, 64, ctypes.byref(out)) == _lib.CONFIG  # region too small
    # A region without a length is refused, not silently replaced by a
    # region of the transport's own (READs would land where nobody looks).
    assert lib.ecx_new(opts, len(opts), buf, 0, ctypes.byref(out)) == _lib.BAD_ARG
    assert "0 bytes" in _lib.last_error()
    assert out.value == 0


def test_calls_on_unknown_transport():
    p = P()
    for rc in (
        lib.ecx_blob(987654, 1, ctypes.byref(p)),
        lib.ecx_check(987654, 1),
        lib.ecx_wait(987654, 1, 0),
        lib.ecx_release(987654, 1),
        lib.ecx_notifs(987654, 0, ctypes.byref(p)),
        lib.ecx_stats(987654, ctypes.byref(p)),
        lib.ecx_remove_peer(987654, b"x", 1),
        lib.ecx_post_read(987654, None, 0, 1, None, 0, None, 0),
    ):
        assert rc == _lib.UNKNOWN_TRANSPORT
    assert "unknown transport" in _lib.last_error()
    assert lib.ecx_deregister(987654) == 0  # deregistering the unknown is a no-op


def test_pointer_and_length_checks(tid):
    p = P()
    idx = (ctypes.c_int64 * 2)(0, 1)
    assert lib.ecx_blob(tid, 1, None) == _lib.BAD_ARG
    assert lib.ecx_blob(tid, 7, ctypes.byref(p)) == _lib.BAD_ARG
    assert lib.ecx_post_read(tid, None, 2, 1, idx, 2, None, 0) == _lib.BAD_ARG
    assert lib.ecx_post_read(tid, idx, -2, 1, idx, 2, None, 0) == _lib.BAD_ARG
    assert lib.ecx_post_read(tid, idx, 1 << 60, 1, idx, 2, None, 0) == _lib.BAD_ARG
    assert lib.ecx_post_read(tid, idx, 2, 1, idx, 2, None, 9) == _lib.BAD_ARG
    assert lib.ecx_post_read(tid, idx, 2, 1, idx, 2, b"x", -1) == _lib.BAD_ARG
    assert lib.ecx_post_read(tid, idx, 2, 99, idx, 2, None, 0) == _lib.UNKNOWN_PEER
    assert lib.ecx_remove_peer(tid, None, 3) == _lib.BAD_ARG
    assert lib.ecx_remove_peer(tid, b"nobody", 6) == _lib.UNKNOWN_PEER
    assert lib.ecx_notifs(tid, 0, None) == _lib.BAD_ARG
    assert lib.ecx_stats(tid, None) == _lib.BAD_ARG
    assert lib.ecx_runtime(None) == _lib.BAD_ARG
    for h in (0, 1, 2**64 - 1):
        assert lib.ecx_check(tid, h) == _lib.BAD_HANDLE
        assert lib.ecx_release(tid, h) == _lib.BAD_HANDLE
    _lib.last_error()


def test_add_peer_buffers(tid):
    md, desc = P(), P()
    n_md = lib.ecx_blob(tid, 1, ctypes.byref(md))
    n_desc = lib.ecx_blob(tid, 2, ctypes.byref(desc))
    assert n_md > 0 and n_desc > 0
    pid = ctypes.c_uint64()
    small = ctypes.create_string_buffer(3)
    big = ctypes.create_string_buffer(257)
    try:
        assert lib.ecx_add_peer(tid, md, n_md, desc, n_desc, None, 0, ctypes.byref(pid)) == _lib.BAD_ARG
        assert lib.ecx_add_peer(tid, md, n_md, desc, n_desc, big, 257, None) == _lib.BAD_ARG
        assert lib.ecx_add_peer(tid, md, n_md, desc, n_desc, small, 3, ctypes.byref(pid)) == _lib.BAD_ARG
        assert "name buffer" in _lib.last_error()
        # Too small for the longest name: refused before anything is added,
        # even though this peer's name (5 bytes) would fit.
        assert lib.ecx_add_peer(tid, md, n_md, desc, n_desc, big, 256, ctypes.byref(pid)) == _lib.BAD_ARG
        assert "need 257" in _lib.last_error()
        assert _stats(tid)["peers"] == 0
        assert lib.ecx_add_peer(tid, None, 4, desc, n_desc, big, 257, ctypes.byref(pid)) == _lib.BAD_ARG
        assert lib.ecx_add_peer(tid, md, n_md, None, 0, big, 257, ctypes.byref(pid)) == _lib.BAD_DESCRIPTOR
        assert lib.ecx_add_peer(tid, md, n_md, desc, n_desc, big, 257, ctypes.byref(pid)) == 0
        assert big.value == b"abi-0" and pid.value > 0
        assert _stats(tid)["peers"] == 1
    finally:
        lib.ecx_free(md)
        lib.ecx_free(desc)
    _lib.last_error()


def _stats(tid):
    p = P()
    n = lib.ecx_stats(tid, ctypes.byref(p))
    assert n > 0
    return json.loads(_lib.take_bytes(p, n))


def test_last_error_is_cut_to_the_buffer():
    assert lib.ecx_check(424242, 1) == _lib.UNKNOWN_TRANSPORT
    buf = ctypes.create_string_buffer(8)
    n = lib.ecx_last_error(buf, 8)
    assert n > 8 and len(buf.value) == 7  # NUL-terminated, cut
    assert lib.ecx_last_error(buf, 8) == 0  # taken
    assert lib.ecx_check(424242, 1) == _lib.UNKNOWN_TRANSPORT
    assert lib.ecx_last_error(None, 0) > 0  # null buffer: length only, still forgotten
    assert lib.ecx_last_error(None, 0) == 0
    lib.ecx_free(None)  # freeing NULL is fine


@pytest.mark.parametrize(
    "source, match",
    [
        # A library of another ABI version may lack entries this package
        # binds: its version is what is reported, not a missing symbol.
        ("int ecx_abi_version(void) { return 2; }", "ABI version 2, this package needs"),
        ("int some_other_entry(void) { return 0; }", "not an ecxfer library"),
    ],
)
def test_load_other_library(tmp_path, monkeypatch, source, match):
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "fake.c"
    src.write_text(source + "\n")
    so = tmp_path / "libfake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    monkeypatch.setenv("ECXFER_LIB", str(so))
    with pytest.raises(ImportError, match=match):
        _lib.load()
