"""Calls that wait release the GIL: another Python thread runs, and can
even end the wait, while one thread is blocked in the library.

wait() and wait_notifs() block in slices of at most 100 ms and come back
to Python between them, so another thread that merely gets to run says
nothing: it could run between slices with the GIL held inside each. The
probe below says it: with the interpreter's switch interval raised out of
reach, a thread holding the GIL keeps it until it releases it itself, so
the main thread's counter moves while the waiter is inside a library call
only if that call released the GIL."""

import base64
import contextlib
import os
import signal
import sys
import threading
import time

from conftest import HELPERS, ShmRegion, shm_path

import ecxfer.transport as transport
from ecxfer import BadHandleError, EcxferDataTransport

PEER = str(HELPERS / "peer.py")


class GILProbe:
    """Counts, on the main thread, and records how far the count moved
    during each call of a wrapped library function on another thread."""

    def __init__(self):
        self.count = 0
        self.moved = []  # per wrapped call: the count after minus before

    def wrap(self, fn):
        def probed(*args):
            before = self.count
            try:
                return fn(*args)
            finally:
                self.moved.append(self.count - before)

        return probed

    def run(self, seconds):
        """Count for seconds, letting go of the GIL after each step (or a
        waiter whose call returned could not take it back)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.count += 1
            time.sleep(0)

    def released(self):
        return max(self.moved, default=0) > 0


@contextlib.contextmanager
def no_forced_switch():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


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

        probe = GILProbe()
        if transport._wait_py is not None:
            monkeypatch.setattr(transport, "_wait_py", probe.wrap(transport._wait_py))
        else:
            monkeypatch.setattr(transport._lib_, "ecx_wait", probe.wrap(transport._lib_.ecx_wait))
        th = threading.Thread(target=waiter)
        with no_forced_switch():
            th.start()
            entered.wait()
            probe.run(0.5)
        assert probe.moved, "wait() made no library call"
        assert probe.released(), f"the main thread never ran during one of wait()'s calls: {probe.moved[:20]}"
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
        assert out == {"state": "DONE", "error": None}
        t.release_xfer_handle(h)
    finally:
        os.kill(prod.p.pid, signal.SIGCONT)
        t.deregister()
        reg.close()
    prod.send(expect_notifs=0)
    prod.recv()
    assert prod.finish() == 0


def test_wait_notifs_releases_the_gil(pair, monkeypatch):
    """A thread blocked in wait_notifs() does not stop the main thread from
    running (the probe) and posting the READ whose notification ends that
    wait."""
    prod, _, cons, _, peer, _ = pair
    out = {}
    entered = threading.Event()

    def waiter():
        entered.set()
        out["notifs"] = prod.wait_notifs(60)

    probe = GILProbe()
    monkeypatch.setattr(transport._lib_, "ecx_notifs", probe.wrap(transport._lib_.ecx_notifs))
    th = threading.Thread(target=waiter)
    with no_forced_switch():
        th.start()
        entered.wait()
        probe.run(0.3)
    assert probe.moved, "wait_notifs() made no library call"
    assert probe.released(), f"the main thread never ran during one of wait_notifs()'s calls: {probe.moved[:20]}"
    assert th.is_alive()
    h = cons.post_read([1], peer, [2], b"wake:up")
    th.join(60)
    assert not th.is_alive()
    assert out["notifs"] == {cons.agent_name: [b"wake:up"]}
    assert cons.wait(h, 10) == "DONE"
