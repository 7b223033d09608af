"""The wheel is tagged py3-none-linux_x86_64 with Requires-Python >= 3.10.
Whatever interpreters a machine has (test_plugin runs the wheel under each
python3.x it finds), every module of the package and the example must
parse as Python 3.10 grammar and import only standard-library modules that
Python 3.10 has."""

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]
SOURCES = sorted((PKG / "ecxfer").glob("*.py")) + sorted((PKG / "examples").glob("*.py"))

# Standard-library modules the package may import: all of them were in 3.10.
STDLIB_310 = {
    "array", "ast", "atexit", "base64", "contextlib", "ctypes", "importlib", "json", "logging", "math", "mmap", "operator", "os",
    "pathlib", "reprlib", "signal", "struct", "subprocess", "sys", "threading", "time", "typing", "weakref", "__future__",
}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_parses_as_python_310(path):
    src = path.read_text()
    ast.parse(src, filename=str(path), feature_version=(3, 10))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_imports_exist_in_310(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in ("ecxfer", "vllm"):  # the package itself; vLLM only when present
                continue
            assert top in sys.stdlib_module_names, f"{path.name}: {name} is not in the standard library"
            assert top in STDLIB_310, f"{path.name}: {name}: not known to be in Python 3.10 (add it here once checked)"
