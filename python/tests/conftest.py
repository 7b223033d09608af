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
    """Verifiable contents of one block: the same formula as the Go peer's."""
    return bytes(((block * 131 + j * 7 + seed) & 0xFF) for j in range(min(size, 256))) * (size // 256) + bytes(
        ((block * 131 + j * 7 + seed) & 0xFF) for j in range(size % 256)
    )


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


def run_py(code: str, *args, env=None, **kw):
    """The command line that runs code in a fresh interpreter that imports
    this checkout's ecxfer."""
    return [sys.executable, "-c", code, *args]


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYDIR), str(HELPERS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("UCX_LOG_LEVEL", "error")
    if extra:
        env.update(extra)
    return env
