"""Builds libecxfer.so with Go into the wheel.

The wheel carries the shared library, so it is tagged for Linux x86_64 and
any Python 3 (the package reaches the library through ctypes only). The Go
sources are the repository around this directory; Go is the only compiler
needed. When they are not there (a copy of python/ alone), a library
already built by `make python` is used.
"""

import os
import shutil
import subprocess
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class GoLibraryHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        pkg = Path(self.root) / "ecxfer"
        lib = pkg / "libecxfer.so"
        repo = Path(self.root).parent
        go = os.environ.get("GO") or shutil.which("go")
        if (repo / "go.mod").is_file() and (repo / "cmd" / "libecxfer").is_dir():
            if not go:
                raise RuntimeError("building ecxfer's wheel needs Go (https://go.dev/dl/) on PATH, or GO=/path/to/go")
            subprocess.run(
                [go, "build", "-buildmode=c-shared", "-trimpath", "-o", str(lib), "./cmd/libecxfer"],
                cwd=repo,
                check=True,
            )
            # The header is for C users; the wheel does not need it.
            (pkg / "libecxfer.h").unlink(missing_ok=True)
        elif not lib.is_file():
            raise RuntimeError(f"{lib} is missing and the Go sources are not at {repo}: run `make python` first")
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-linux_x86_64"
