"""The library's builtins (cmd/libecxfer/pycalls.c) are the process's: only
the main interpreter uses them, and an embedder that finalizes Python and
initializes it again gets builtins of the new interpreter."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import PYDIR, child_env

READ = r"""
import sys
import ecxfer
from ecxfer import _lib
a = ecxfer.EcxferDataTransport("{p}-a", 0, 8, 4096, 0, backend="loopback")
b = ecxfer.EcxferDataTransport("{p}-b", 0, 8, 4096, 0, backend="loopback")
peer = b.add_remote_peer(a.get_agent_metadata(), a.get_mem_descriptor())
h = b.post_read([1], peer, [2], b"")
st = b.wait(h, 5)
again = b.check_xfer_state(h)  # from the builtin where there is one
print("{p}", _lib.lib.calls is not None, st, again is _lib.STATES[1], flush=True)
b.release_xfer_handle(h)
a.deregister()
b.deregister()
"""

SUB = (
    "import _xxsubinterpreters as si\n"
    "exec(" + repr(READ.replace("{p}", "main")) + ")\n"
    "for k in range(2):\n"
    "    i = si.create()\n"
    "    si.run_string(i, " + repr(READ.replace("{p}", "sub")) + ")\n"
    "    si.destroy(i)\n"
    "exec(" + repr(READ.replace("{p}", "main")) + ")\n"
)


def test_sub_interpreters_take_the_ctypes_path():
    """A sub-interpreter's READs work, through ctypes; the main
    interpreter's, before and after, through the builtins."""
    try:
        import _xxsubinterpreters  # noqa: F401
    except ImportError:
        pytest.skip("no _xxsubinterpreters in this Python")
    r = subprocess.run([sys.executable, "-c", SUB], env=child_env(), capture_output=True, text=True, timeout=120,
                       cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:4] == [
        "main True DONE True",
        "sub False DONE True",
        "sub False DONE True",
        "main True DONE True",
    ], r.stdout


EMBED = r"""
#include <Python.h>
int main(int argc, char **argv) {
    for (int round = 0; round < 3; round++) {
        Py_Initialize();
        if (PyRun_SimpleString(argv[1]) != 0)
            return 10 + round;
        if (Py_FinalizeEx() != 0)
            return 20 + round;
    }
    return 0;
}
"""


def test_embedder_initializing_python_again(tmp_path):
    """A program that initializes Python, runs ecxfer, finalizes Python and
    does it again gets, in every round, the builtins and states of the
    interpreter it runs (they used to be the first round's, freed with
    it)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    inc = sysconfig.get_paths()["include"]
    if cc is None or not os.path.exists(os.path.join(inc, "Python.h")) or sysconfig.get_config_var("Py_ENABLE_SHARED") != 1:
        pytest.skip("no C compiler, Python headers or shared libpython")
    src = tmp_path / "embed.c"
    src.write_text(EMBED)
    exe = tmp_path / "embed"
    libdir = sysconfig.get_config_var("LIBDIR")
    ver = sysconfig.get_config_var("LDVERSION")
    subprocess.run([cc, str(src), "-o", str(exe), f"-I{inc}", f"-L{libdir}", f"-lpython{ver}",
                    f"-Wl,-rpath,{libdir}"], check=True, capture_output=True)
    code = f"import sys; sys.path[:0] = [{str(PYDIR)!r}]\n" + READ.replace("{p}", "round")
    r = subprocess.run([str(exe), code], env=child_env(), capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    assert r.stdout.split("\n")[:3] == ["round True DONE True"] * 3, r.stdout
