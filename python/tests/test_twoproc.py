"""Two Python processes, producer and consumer, making vLLM's calls in
vLLM's order over the ucx backend, on MAP_SHARED /dev/shm regions like
vLLM's: bytes verified, the "{session}:{mm_hash}" notification delivered to
the producer."""

import sys
import time

import pytest

from conftest import HELPERS, child_env, shm_path

PEER = str(HELPERS / "peer.py")
NB, BS, SEED = 1024, 5120, 77


@pytest.mark.parametrize(
    "options", ['{"direct": "off"}', None, '{"direct": "on", "inline_bytes": -1}', '{"backend": "nixl"}']
)
def test_producer_consumer_processes(peers, options):
    """Through the UCX engine (direct off, over TCP: over shared memory the
    engine refuses the producer's own region, test_engine_refuses_shm_region);
    with the defaults, the consumer copying from the producer's mapped
    /dev/shm file itself, inline in post_read or (no inline bytes) on its
    copy workers; and through the NIXL engine (NIXL's own agent and
    metadata underneath, make nixl builds it)."""
    extra = {"ECXFER_OPTIONS": options} if options else {}
    if options and '"off"' in options:
        extra["UCX_TLS"] = "tcp"
    env = child_env(extra)
    prod = peers([sys.executable, PEER, "producer", "encoder-0", shm_path("p"), str(NB), str(BS), str(SEED)], env)
    cons = peers([sys.executable, PEER, "consumer", "prefill-0", shm_path("c"), str(NB), str(BS)], env)
    pm = prod.recv()
    cons.recv()
    reads = [
        # one image's blocks, contiguous
        {"local": list(range(0, 880)), "remote": list(range(100, 980)), "notif": "sess-1:mm-aaaa"},
        # scattered
        {"local": list(range(1023, 143, -1)), "remote": [(i * 37) % NB for i in range(880)], "notif": "sess-1:mm-bbbb"},
        # one block, no notification
        {"local": [7], "remote": [1000], "notif": ""},
    ]
    prod.send(expect_notifs=2)
    cons.send(md=pm["md"], desc=pm["desc"], seed=SEED, reads=reads)
    got = cons.recv()
    res, st = got["results"], got["stats"]
    if options is not None and ("off" in options or "nixl" in options):
        assert st["direct_reads"] == 0 and st["direct_peers"] == 0, st
    else:
        assert st["direct_reads"] == 3 and st["direct_peers"] == 1, st
        assert st["inline_reads"] == (0 if options and "inline_bytes" in options else 1), st
    assert [r["state"] for r in res] == ["DONE"] * 3
    assert [r["bad_blocks"] for r in res] == [[]] * 3
    got = prod.recv()["notifs"]
    assert sorted(got) == [["prefill-0", "sess-1:mm-aaaa"], ["prefill-0", "sess-1:mm-bbbb"]]
    assert cons.finish() == 0
    assert prod.finish() == 0


def test_producer_killed(peers):
    """A READ from a producer that was SIGKILLed ends in ERR, and the
    reason is a RemoteDisconnectError."""
    from conftest import ShmRegion

    from ecxfer import EcxferDataTransport, RemoteDisconnectError

    prod = peers([sys.executable, PEER, "producer", "encoder-k", shm_path("k"), "64", "4096", "1"])
    pm = prod.recv()
    import base64

    reg = ShmRegion(64 * 4096)
    t = EcxferDataTransport(
        agent_name="prefill-k", base_ptr=reg.addr, num_blocks=64, block_size_bytes=4096, total_size_bytes=64 * 4096
    )
    try:
        peer = t.add_remote_peer(base64.b64decode(pm["md"]), base64.b64decode(pm["desc"]))
        h = t.post_read([0], peer, [0], b"")
        assert t.wait(h, 10) == "DONE"
        t.release_xfer_handle(h)
        prod.kill()
        state, err = "DONE", None
        deadline = time.monotonic() + 20
        while state == "DONE" and time.monotonic() < deadline:
            try:
                h = t.post_read(list(range(64)), peer, list(range(64)), b"x:y")
            except Exception as e:  # the peer may already be gone
                err = e
                break
            state = t.wait(h, 10)
            err = t.xfer_error(h)
            t.release_xfer_handle(h)
        print("after the kill:", repr(err))
        assert isinstance(err, RemoteDisconnectError), repr(err)
    finally:
        t.deregister()
        reg.close()


def test_example_runs():
    """The README's two-command example (python/examples/vllm_pair.py)."""
    import subprocess

    ex = str(HELPERS.parent / "examples" / "vllm_pair.py")
    r = subprocess.run([sys.executable, ex], env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DONE" in r.stdout and "bytes verified" in r.stdout, r.stdout
    assert "'session-1:mm-hash-abc'" in r.stdout, r.stdout


def test_example_failure_stops_producer():
    """When the example's consumer fails (here: direct off over shared
    memory, which the README says is refused), its producer stops too and
    removes its region file; it used to poll forever."""
    import glob
    import subprocess

    ex = str(HELPERS.parent / "examples" / "vllm_pair.py")
    before = set(glob.glob("/dev/shm/vllm_ec_encoder-*.mmap"))
    env = child_env()
    env["ECXFER_OPTIONS"] = '{"direct": "off"}'
    env.pop("UCX_TLS", None)
    r = subprocess.run([sys.executable, ex], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "ConfigError" in r.stderr, r.stderr
    left = set(glob.glob("/dev/shm/vllm_ec_encoder-*.mmap")) - before
    assert not left, f"the producer left {left}"
    for d in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(d, "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        assert not (ex.encode() in cmd and b"producer" in cmd), f"the producer still runs ({d})"


def test_engine_refuses_shm_region(peers, monkeypatch):
    """With direct off, over shared memory, a producer's own /dev/shm region
    is refused at add_remote_peer with a ConfigError (a ValueError) that
    says why and what to do; nothing is loaded. With the defaults the same
    producer is read directly."""
    import base64

    from conftest import ShmRegion

    from ecxfer import ConfigError, EcxferDataTransport, UnknownPeerError

    monkeypatch.delenv("UCX_TLS", raising=False)
    prod = peers([sys.executable, PEER, "producer", "encoder-r", shm_path("r"), "64", "4096", "5"])
    pm = prod.recv()
    md, desc = base64.b64decode(pm["md"]), base64.b64decode(pm["desc"])
    reg = ShmRegion(64 * 4096)
    kw = dict(base_ptr=reg.addr, num_blocks=64, block_size_bytes=4096, total_size_bytes=64 * 4096)
    off = EcxferDataTransport(agent_name="prefill-r-off", direct="off", **kw)
    on = None
    try:
        with pytest.raises(ConfigError, match="shared-memory receive queue") as ei:
            off.add_remote_peer(md, desc)
        assert isinstance(ei.value, ValueError)
        with pytest.raises(UnknownPeerError):
            off.post_read([0], "encoder-r", [0], b"")
        on = EcxferDataTransport(agent_name="prefill-r-on", **kw)
        peer = on.add_remote_peer(md, desc)
        h = on.post_read(list(range(64)), peer, list(range(64)), b"")
        assert on.wait(h, 10) == "DONE"
        on.release_xfer_handle(h)
    finally:
        off.deregister()
        if on is not None:
            on.deregister()
        reg.close()

def test_example_failed_read_ends():
    """A READ of the example that ends ERR (a timeout of a microsecond
    over tcp) ends the example at once, with the error and exit status
    1, and leaves no region file: it used to wait forever for the
    notification a failed READ never sends."""
    import glob
    import subprocess

    ex = str(HELPERS.parent / "examples" / "vllm_pair.py")
    before = set(glob.glob("/dev/shm/vllm_ec_*.mmap"))
    env = child_env()
    env["ECXFER_OPTIONS"] = '{"direct": "off", "xfer_timeout_s": 0.000001}'
    env["UCX_TLS"] = "tcp"
    r = subprocess.run([sys.executable, ex], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ERR after" in r.stdout and "timed out" in r.stdout, r.stdout
    left = set(glob.glob("/dev/shm/vllm_ec_*.mmap")) - before
    assert not left, f"the example left {left}"
