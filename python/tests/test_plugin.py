"""The vLLM plugin against a stand-in module tree laid out like vLLM's
(tests/stub_vllm), and the wheel: built with Go, installed into a fresh
virtual environment, loaded through its entry point."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import HELPERS, PYDIR, child_env

STUB = str(HELPERS / "stub_vllm")

SCRIPT = r'''
import json, mmap, ctypes, os, sys
from vllm.distributed.ec_transfer.ec_connector.cpu import scheduler
from vllm.distributed.ec_transfer.ec_connector.cpu.data.base import DataTransport
out = {}
if sys.argv[1] == "entrypoints":
    out["loaded"] = scheduler.load_general_plugins()
else:
    import ecxfer.vllm_plugin
    ecxfer.vllm_plugin.register()
m = mmap.mmap(-1, 16 * 4096)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
try:
    t = scheduler.setup_transport("plug-0", addr, 16, 4096, 16 * 4096)
except RuntimeError as e:
    out["error"] = str(e)
else:
    import ecxfer
    out["class"] = type(t).__module__ + "." + type(t).__qualname__
    out["is_ecxfer"] = isinstance(t, ecxfer.EcxferDataTransport)
    out["is_datatransport"] = isinstance(t, DataTransport)
    out["ecxfer_file"] = ecxfer.__file__
    peer = t.add_remote_peer(t.get_agent_metadata(), t.get_mem_descriptor())
    m[0:4096] = b"z" * 4096
    h = t.post_read([5], peer, [0], b"s:h")
    out["state"] = t.wait(h, 10)
    out["copied"] = m[5 * 4096 : 6 * 4096] == b"z" * 4096
    out["notifs"] = {k: [x.decode() for x in v] for k, v in t.wait_notifs(10).items()}
    # On a CPython with a GIL the calls of every READ are builtins the
    # library makes with this interpreter's own functions (pycalls.c), and
    # lists of ints are read in C.
    tr = ecxfer.transport
    out["c_path"] = None not in (tr._post_py, tr._check_py, tr._release_py, tr._wait_py)
    for i in range(8):
        m[i * 4096 : i * 4096 + 8] = i.to_bytes(8, "little")
    h = t.post_read(list(range(8, 16)), peer, tuple(range(7, -1, -1)), b"")
    out["scattered"] = t.wait(h, 10) == "DONE" and t.check_xfer_state(h) == "DONE" and all(
        m[(8 + k) * 4096 : (8 + k) * 4096 + 8] == (7 - k).to_bytes(8, "little") for k in range(8))
    t.release_xfer_handle(h)
    out["scattered"] = out["scattered"] and t.check_xfer_state(h) == "ERR" and t.stats()["live_handles"] == 1
    try:
        t.post_read([2**40], peer, [0], b"")
    except ecxfer.IndexRangeError:
        out["range"] = "IndexRangeError"
    t.deregister()
print("@@ " + json.dumps(out))
'''


def run(python, mode, env_extra, pythonpath):
    env = child_env(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    r = subprocess.run(
        [python, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    import json

    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("@@ ")][-1][3:])


def test_plugin_off_by_default():
    out = run(sys.executable, "direct", {"ECXFER_VLLM": ""}, [STUB, str(PYDIR)])
    assert out == {"error": "NIXL is not available"}


def test_plugin_off_for_other_values_says_so():
    """Only ECXFER_VLLM=1 turns the plugin on; another value ("true",
    "yes") leaves it off, with a warning naming the value; 0 and unset
    are quietly off."""
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.WARNING); "
        "from ecxfer import vllm_plugin; vllm_plugin.register(); "
        "import vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl as d; "
        "print('@@', d.NixlDataTransport.__module__)"
    )
    for value, warned in (("true", True), ("yes", True), ("0", False), ("", False)):
        env = child_env({"ECXFER_VLLM": value})
        env["PYTHONPATH"] = os.pathsep.join([STUB, str(PYDIR)])
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        assert "ecxfer" not in r.stdout.split("@@")[-1], (value, r.stdout)
        assert ("only ECXFER_VLLM=1 turns it on" in r.stdout) == warned, (value, r.stdout)


def test_plugin_patches_the_transport():
    out = run(sys.executable, "direct", {"ECXFER_VLLM": "1"}, [STUB, str(PYDIR)])
    assert out["class"] == "ecxfer.transport.EcxferDataTransport"
    assert out["is_ecxfer"] and out["is_datatransport"]
    assert out["state"] == "DONE" and out["copied"]
    assert out["notifs"] == {"plug-0": ["s:h"]}
    assert out["c_path"] and out["scattered"] and out["range"] == "IndexRangeError", out


def test_plugin_keeps_a_present_nixl(tmp_path):
    """With NIXL present the presence check is vLLM's own; the plugin
    replaces only the transport."""
    tree = tmp_path / "withnixl"
    subprocess.run(["cp", "-r", STUB, str(tree)], check=True)
    (tree / "vllm/distributed/nixl_utils.py").write_text(
        "class NixlWrapper:\n    pass\n\ndef nixl_agent_config(**kw):\n    return kw\n"
    )
    code = (
        "import ecxfer.vllm_plugin as p, vllm.distributed.nixl_utils as u; p.register(); "
        "print('@@', u.NixlWrapper.__module__, u.nixl_agent_config.__module__)"
    )
    env = child_env({"ECXFER_VLLM": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(PYDIR)])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("@@ ")[-1].split() == ["vllm.distributed.nixl_utils", "vllm.distributed.nixl_utils"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel pip builds from python/ (its build hook runs Go)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(PYDIR)],
        check=True,
        timeout=600,
    )
    (whl,) = out.glob("ecxfer-*.whl")
    return whl


def test_wheel_contents(wheel):
    import zipfile

    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "ecxfer/libecxfer.so" in names
    assert "ecxfer/__init__.py" in names and "ecxfer/vllm_plugin.py" in names
    (ep,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "[vllm.general_plugins]" in text and "ecxfer = ecxfer.vllm_plugin:register" in text


def test_wheel_installs_and_vllm_loader_finds_it(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], check=True, timeout=300)
    out = run(py, "entrypoints", {"ECXFER_VLLM": "1"}, [STUB])
    assert out["loaded"] == ["ecxfer"]
    assert out["ecxfer_file"].startswith(str(env_dir)), "the installed package, not the source tree"
    assert out["is_datatransport"] and out["state"] == "DONE" and out["copied"]
    out = run(py, "entrypoints", {"ECXFER_VLLM": "0"}, [STUB])
    assert out["loaded"] == ["ecxfer"] and out["error"] == "NIXL is not available"


def _python(version):
    """A python<version> that runs: on PATH, or installed by pyenv; else None."""
    import shutil

    want = str(tuple(map(int, version.split("."))))
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for exe in [shutil.which(f"python{version}")] + sorted(map(str, root.glob(f"versions/{version}.*/bin/python{version}"))):
        if exe is None:
            continue
        r = subprocess.run([exe, "-c", "import sys, venv; print(sys.version_info[:2])"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == want:
            return exe
    return None


@pytest.mark.parametrize("version", ["3.10", "3.12", "3.13"])
def test_wheel_on_other_pythons(wheel, tmp_path, version):
    """The same wheel installs into, and works from, the other Pythons it
    claims (Requires-Python >= 3.10) when this machine has them."""
    exe = _python(version)
    if exe is None:
        pytest.skip(f"no working python{version} on PATH or under pyenv")
    env_dir = tmp_path / "venv"
    subprocess.run([exe, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], check=True, timeout=300)
    out = run(py, "entrypoints", {"ECXFER_VLLM": "1"}, [STUB])
    assert out["loaded"] == ["ecxfer"]
    assert out["ecxfer_file"].startswith(str(env_dir))
    assert out["is_datatransport"] and out["state"] == "DONE" and out["copied"]
    assert out["notifs"] == {"plug-0": ["s:h"]}
    assert out["c_path"] and out["scattered"] and out["range"] == "IndexRangeError", out
