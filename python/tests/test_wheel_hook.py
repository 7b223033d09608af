"""The wheel's build hook (python/hatch_build.py) says what went wrong with
Go in Go's own words."""

import os
import stat
import sys

import pytest

from conftest import PYDIR

sys.path.insert(0, str(PYDIR))


def test_go_env_failure_says_why(tmp_path, monkeypatch):
    """A Go that cannot even report its architecture (most often: go.mod
    asks for a newer toolchain that cannot be downloaded) fails the build
    with Go's message, not a bare CalledProcessError."""
    pytest.importorskip("hatchling")
    from hatch_build import GoLibraryHook

    repo = tmp_path / "repo"
    (repo / "cmd" / "libecxfer").mkdir(parents=True)
    (repo / "go.mod").write_text("module example\n\ngo 1.99.0\n")
    (repo / "python" / "ecxfer").mkdir(parents=True)
    go = tmp_path / "go"
    go.write_text("#!/bin/sh\necho 'go: downloading go1.99.0: toolchain not available' >&2\nexit 1\n")
    go.chmod(go.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("GO", str(go))

    class Hook(GoLibraryHook):
        def __init__(self):
            pass

        root = str(repo / "python")
        target_name = "wheel"

    with pytest.raises(RuntimeError, match="toolchain not available"):
        Hook().initialize("standard", {})
    assert not os.path.exists(repo / "python" / "ecxfer" / "libecxfer.so")
