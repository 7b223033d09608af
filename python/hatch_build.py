"""Builds libecxfer.so with Go into the wheel.

The wheel carries the shared library, so it is tagged for Linux on the
library's architecture and any Python 3 (the package reaches the library
through ctypes only). The Go sources are the repository around this
directory; Go builds the library, with cgo, which needs a C compiler and
UCX's headers (Debian: gcc libc6-dev libucx-dev pkg-config). When the
sources are not there (a copy of python/ alone), a library already built
by `make python` is used. The sdist carries no library and no Go sources:
build wheels from the source tree.
"""

import os
import platform
import shutil
import subprocess
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# Go's architecture names as wheel platform tags use them.
_ARCH = {"amd64": "x86_64", "arm64": "aarch64", "386": "i686", "ppc64le": "ppc64le", "s390x": "s390x"}


class GoLibraryHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        pkg = Path(self.root) / "ecxfer"
        lib = pkg / "libecxfer.so"
        repo = Path(self.root).parent
        go = os.environ.get("GO") or shutil.which("go")
        arch = platform.machine()
        if (repo / "go.mod").is_file() and (repo / "cmd" / "libecxfer").is_dir():
            if not go:
                raise RuntimeError("building ecxfer's wheel needs Go (https://go.dev/dl/) on PATH, or GO=/path/to/go")
            env = subprocess.run([go, "env", "GOARCH"], cwd=repo, capture_output=True, text=True)
            if env.returncode != 0:
                # Go's own words: most often the toolchain go.mod asks for
                # is newer than this Go and cannot be downloaded.
                raise RuntimeError(f"building ecxfer's wheel: `{go} env GOARCH` failed: {env.stderr.strip()}")
            goarch = env.stdout.strip()
            arch = _ARCH.get(goarch, goarch)
            subprocess.run(
                [go, "build", "-buildmode=c-shared", "-trimpath", "-o", str(lib), "./cmd/libecxfer"],
                cwd=repo,
                check=True,
            )
            # The header is for C users; the wheel does not need it.
            (pkg / "libecxfer.h").unlink(missing_ok=True)
        elif not lib.is_file():
            raise RuntimeError(
                f"{lib} is missing and the Go sources are not at {repo}: build the wheel from ecxfer's source tree "
                "(pip install ./python), or run `make python` there first"
            )
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-linux_{arch}"
