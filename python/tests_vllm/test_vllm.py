"""ecxfer inside real vLLM (make test-vllm): vLLM 0.33.0 in .venv-vllm with
the ecxfer wheel installed. vLLM's own plugin loader loads ecxfer's plugin;
the class vLLM's EC CPU scheduler imports is ecxfer's, a subclass of vLLM's
real DataTransport; and vLLM's own producer and consumer session code runs
between two processes over vLLM's ZMQ control plane, on vLLM's shared
regions, with ecxfer as the transport: the blocks arrive intact and the
READ's notification unpins them on the producer; and vLLM's ECCPUConnector
in its scheduler role, on both ends, runs the same exchange from its own
_setup_nixl, request_finished, ensure_cache_available and step. A missing
vLLM fails it."""

import json
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER = str(Path(__file__).resolve().parent / "vllm_peer.py")
VLLM_PY = os.environ.get("ECXFER_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ECXFER_LIB")}
    e.update(UCX_LOG_LEVEL="error", VLLM_PLUGINS="ecxfer", ECXFER_VLLM="1", VLLM_LOGGING_LEVEL="WARNING")
    e.update(extra)
    return e


class Proc:
    def __init__(self, argv, environ):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ, cwd="/")

    def recv(self, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.p.stdout], [], [], 1)
            if r:
                line = self.p.stdout.readline()
                if not line:
                    raise EOFError(f"{self.p.args[2]} exited with {self.p.wait()}")
                if line.startswith("@@ "):
                    return json.loads(line[3:])
        raise TimeoutError(self.p.args)

    def finish(self):
        try:
            self.p.stdin.write("\n")
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        return self.p.wait(60)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def unpinned_then_finish(prod, cons):
    """The producer saw the encoding pinned for the READ and unpinned by its
    notification; both sides then exit cleanly."""
    pr = prod.recv()
    assert pr == {"pinned_seen": True, "unpinned": True, "held": False}, pr
    assert cons.finish() == 0
    assert prod.finish() == 0


def kill(*procs):
    for x in procs:
        if x is not None:
            x.kill()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_is_installed():
    assert os.path.exists(VLLM_PY), f"{VLLM_PY} missing: run make test-vllm"
    out = subprocess.run(
        [VLLM_PY, "-c", "import vllm, ecxfer; print(vllm.__version__, ecxfer.__file__)"],
        env=env(), capture_output=True, text=True, cwd="/", timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    version, where = out.stdout.split()[-2:]
    assert version == "0.33.0"
    assert "site-packages" in where, "ecxfer comes from the installed wheel"


def test_plugin_off_keeps_vllms_transport():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.distributed.ec_transfer.ec_connector.cpu.data import nixl; "
        "print('@@', nixl.NixlDataTransport.__module__)"
    )
    out = subprocess.run([VLLM_PY, "-c", code], env=env(ECXFER_VLLM="0"), capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("@@ ")[-1].strip() == "vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl"


def test_vllm_sessions_over_ecxfer():
    port, tag = free_port(), uuid.uuid4().hex[:8]
    nb, bs, n, mm_hash = 1024, 5120, 880, f"mm-{tag}"
    prod = Proc([VLLM_PY, PEER, "producer", f"ecx-enc-{tag}", str(port), str(nb), str(bs), mm_hash, str(n)], env())
    cons = None
    try:
        p = prod.recv()
        assert p["ready"] and p["vllm"] == "0.33.0"
        cons = Proc([VLLM_PY, PEER, "consumer", f"ecx-pre-{tag}", str(port), str(nb), str(bs), mm_hash, str(n)], env())
        c = cons.recv()
        for side in (p, c):
            assert side["class"] == "ecxfer.transport.EcxferDataTransport", side
            assert side["is_ecxfer"] and side["subclass_of_vllm"] and side["instance_is_vllm_datatransport"], side
            assert side["nixl_check_passes"], side
        assert c["done"], c
        assert c["bad_blocks"] == [], c
        # vLLM's one READ took the C reader of index lists, not the fallback.
        assert len(c["c_reader"]) == 1 and c["c_reader"][0] > 0, c
        unpinned_then_finish(prod, cons)
    finally:
        kill(prod, cons)


SCHED_PEER = str(Path(__file__).resolve().parent / "vllm_sched_peer.py")


def test_vllm_scheduler_over_ecxfer():
    """vLLM's ECCPUConnector in its scheduler role on both ends: its
    _setup_nixl builds ecxfer's transport, request_finished announces the
    producer's encoding, ensure_cache_available admits the consumer's
    request once the READ is done, the load the scheduler hands the worker
    holds the producer's bytes, and the READ's notification unpins the
    encoding on the producer."""
    port, tag = free_port(), uuid.uuid4().hex[:8]
    nb, hidden, n, mm_hash = 1024, 2560, 880, f"mm-{tag}"
    argv = [str(port), str(nb), str(hidden), mm_hash, str(n)]
    prod = Proc([VLLM_PY, SCHED_PEER, "producer", f"ecx-{tag}"] + argv, env())
    cons = None
    try:
        p = prod.recv()
        assert p["ready"] and p["blocks"] == n, p
        item = p["params"][mm_hash]
        assert (item["peer_host"], item["peer_port"]) == ("127.0.0.1", port), item
        assert item["shape"] == [n, hidden] and item["size_bytes"] == n * hidden * 2, item
        cons = Proc([VLLM_PY, SCHED_PEER, "consumer", f"ecx-{tag}"] + argv, env())
        cons.p.stdin.write(json.dumps(p["params"]) + "\n")
        cons.p.stdin.flush()
        c = cons.recv()
        for side in (p, c):
            assert side["class"] == "ecxfer.transport.EcxferDataTransport", side
            assert side["is_ecxfer"] and side["instance_is_vllm_datatransport"], side
        assert c["failed"] == [] and c["ready"], c
        assert c["loaded"] and c["shape"] == [n, hidden], c
        assert c["bad_blocks"] == [], c
        unpinned_then_finish(prod, cons)
    finally:
        kill(prod, cons)
