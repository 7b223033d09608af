import ctypes
import mmap
import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYDIR = ROOT / "python"
HELPERS = Path(__file__).resolve().parent


class ShmRegion:
    """A MAP_SHARED mapping of a /dev/shm file, as vLLM makes its EC
    region (/dev/shm/vllm_ec_<engine_id>.mmap)."""

    def __init__(self, size: int, path: str | None = None, create: bool = True):
        self.path = path or f"/dev/shm/ecxfer_test_{os.getpid()}_{uuid.uuid4().hex[:8]}.mmap"
        self.size = size
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def close(self):
        del self._anchor
        self.mm.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def pattern(seed: int, block: int, size: int) -> bytes:
    """Block contents a reader can recompute: byte j of block b is
    (b*131 + seed + 7*j) mod 256 (the Go peer uses the same formula)."""
    base = bytes(((block * 131 + seed + 7 * j) & 0xFF) for j in range(256))
    return (base * (size // 256 + 1))[:size]


@pytest.fixture
def region():
    made = []

    def make(size: int) -> ShmRegion:
        r = ShmRegion(size)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def pair(region):
    """A producer and a consumer transport in this process (ucx), the
    consumer knowing the producer. Deregistered at the end."""
    from ecxfer import EcxferDataTransport

    n, bs = 64, 4096
    made = []

    def make(name: str, **opts):
        r = region(n * bs)
        t = EcxferDataTransport(
            agent_name=name, base_ptr=r.addr, num_blocks=n, block_size_bytes=bs, total_size_bytes=n * bs, **opts
        )
        made.append(t)
        return t, r

    prod, preg = make(f"prod-{uuid.uuid4().hex[:6]}")
    cons, creg = make(f"cons-{uuid.uuid4().hex[:6]}")
    peer = cons.add_remote_peer(prod.get_agent_metadata(), prod.get_mem_descriptor())
    yield prod, preg, cons, creg, peer, make
    for t in made:
        t.deregister()


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYDIR), str(HELPERS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("UCX_LOG_LEVEL", "error")
    if extra:
        env.update(extra)
    return env


class Peer:
    """A child process speaking peer.py's / gopeer's line protocol."""

    def __init__(self, argv, env=None):
        import subprocess

        self.p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env or child_env()
        )

    def recv(self, timeout=60.0):
        import json
        import select
        import time

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from {self.p.args} in {timeout}s")
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if not r:
                continue
            line = self.p.stdout.readline()
            if not line:
                raise EOFError(f"{self.p.args} exited with {self.p.wait()}")
            if line.startswith("@@ "):
                msg = json.loads(line[3:])
                if "error" in msg and len(msg) == 1:
                    raise RuntimeError(f"peer failed: {msg['error']}")
                return msg

    def send(self, **msg):
        import json

        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def finish(self, timeout=30):
        try:
            self.send(quit=True)
            self.p.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        return self.p.wait(timeout)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        # A killed peer cannot remove its region's file.
        for a in self.p.args:
            if str(a).startswith("/dev/shm/") and os.path.exists(a):
                os.unlink(a)


@pytest.fixture
def peers():
    made = []

    def start(argv, env=None):
        p = Peer(argv, env)
        made.append(p)
        return p

    yield start
    for p in made:
        p.kill()


@pytest.fixture(scope="session")
def gopeer(tmp_path_factory):
    """The Go peer (python/tests/gopeer), built once."""
    import shutil
    import subprocess

    go = os.environ.get("GO") or shutil.which("go")
    if not go:
        pytest.fail("the Python <-> Go tests need Go on PATH")
    out = tmp_path_factory.mktemp("gopeer") / "gopeer"
    subprocess.run([go, "build", "-o", str(out), "./python/tests/gopeer"], cwd=ROOT, check=True)
    return str(out)


def shm_path(tag: str) -> str:
    return f"/dev/shm/vllm_ec_ecxfer-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}.mmap"


def lib_runtime() -> dict:
    """The library's own count of transports and goroutines (ecx_runtime)."""
    import ctypes
    import json

    from ecxfer import _lib

    p = ctypes.c_void_p()
    n = _lib.lib.ecx_runtime(ctypes.byref(p))
    assert n > 0
    return json.loads(_lib.take_bytes(p, n))


def open_fds() -> set:
    """This process's open descriptors."""
    return set(os.listdir("/proc/self/fd"))
