"""Calls that wait release the GIL: another Python thread runs, and can
even end the wait, while one thread is blocked in the library."""

import base64
import os
import signal
import sys
import threading
import time

from conftest import HELPERS, ShmRegion, shm_path

from ecxfer import BadHandleError, EcxferDataTransport

PEER = str(HELPERS / "peer.py")


def test_wait_releases_the_gil(peers, monkeypatch):
    """A READ from a stopped producer over TCP stays PROC. One thread
    blocks in wait(); the main thread, which needs the GIL for every line
    it runs, counts, then releases the handle, which ends the wait (ERR);
    a second wait ends in DONE when it lets the producer continue. Were the GIL held during wait(), the main thread could
    not run at all, and the wait would end only at its 60 s timeout, in
    PROC."""
    # TCP only: a get over TCP needs the producer's progress, so it stays
    # in flight while the producer is stopped (shared memory would not).
    monkeypatch.setenv("UCX_TLS", "tcp")
    path = shm_path("gil")
    prod = peers([sys.executable, PEER, "producer", "encoder-gil", path, "256", "65536", "3"])
    pm = prod.recv()
    reg = ShmRegion(256 * 65536)
    # The UCX engine (direct off): the direct path would copy from the
    # stopped producer's file at once.
    t = EcxferDataTransport(
        agent_name="prefill-gil",
        base_ptr=reg.addr,
        num_blocks=256,
        block_size_bytes=65536,
        total_size_bytes=256 * 65536,
        direct="off",
    )
    try:
        peer = t.add_remote_peer(base64.b64decode(pm["md"]), base64.b64decode(pm["desc"]))
        h = t.post_read([0], peer, [0], b"")
        assert t.wait(h, 30) == "DONE"  # connected
        t.release_xfer_handle(h)
        os.kill(prod.p.pid, signal.SIGSTOP)
        h = t.post_read(list(range(256)), peer, list(range(256)), b"")
        assert t.check_xfer_state(h) == "PROC"

        entered = threading.Event()
        out = {}

        def waiter():
            entered.set()
            out["state"] = t.wait(h, 60)
            out["error"] = t.xfer_error(h)

        th = threading.Thread(target=waiter)
        th.start()
        entered.wait()
        counted = 0
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            counted += 1
        assert th.is_alive(), "the READ should still be in flight"
        assert t.check_xfer_state(h) == "PROC"
        # Releasing the handle from this thread ends the other's wait.
        t.release_xfer_handle(h)
        th.join(30)
        assert not th.is_alive()
        assert out["state"] == "ERR" and isinstance(out["error"], BadHandleError), out

        h = t.post_read(list(range(256)), peer, list(range(256)), b"")
        out.clear()
        entered.clear()
        th = threading.Thread(target=waiter)
        th.start()
        entered.wait()
        time.sleep(0.1)
        assert th.is_alive(), "the READ should still be in flight"
        os.kill(prod.p.pid, signal.SIGCONT)
        th.join(60)
        assert not th.is_alive()
        assert counted > 1000
        assert out == {"state": "DONE", "error": None}
        t.release_xfer_handle(h)
    finally:
        os.kill(prod.p.pid, signal.SIGCONT)
        t.deregister()
        reg.close()
    prod.send(expect_notifs=0)
    prod.recv()
    assert prod.finish() == 0


def test_wait_notifs_releases_the_gil(pair):
    """A thread blocked in wait_notifs() does not stop the main thread from
    posting the READ whose notification ends that wait."""
    prod, _, cons, _, peer, _ = pair
    out = {}
    entered = threading.Event()

    def waiter():
        entered.set()
        out["notifs"] = prod.wait_notifs(60)

    th = threading.Thread(target=waiter)
    th.start()
    entered.wait()
    time.sleep(0.1)
    assert th.is_alive()
    h = cons.post_read([1], peer, [2], b"wake:up")
    th.join(60)
    assert not th.is_alive()
    assert out["notifs"] == {cons.agent_name: [b"wake:up"]}
    assert cons.wait(h, 10) == "DONE"
