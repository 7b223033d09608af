#!/usr/bin/python3
"""Golden vectors for the descriptors package.

Each vector is a Python expression for a descriptor list, packed the way
vLLM's msgspec packs list[tuple[int, int, int]] (Python's msgpack writes the
same bytes for non-negative ints and tuples). golden.json records every
expression with the length and sha256 of its encoding; encodings up to
MAX_FILE bytes are also stored as <name>.hex, 32 bytes per line.

    /usr/bin/python3 gen.py          # rewrite golden.json and the .hex files
    /usr/bin/python3 gen.py check    # verify them; exit status 1 on any difference

Requires Debian's python3-msgpack (hence /usr/bin/python3).
"""

import hashlib
import json
import os
import sys

import msgpack

MAX_FILE = 64 << 10
BASE = "0x7f0000000000"


def blocks(n, size, dev=0):
    return f"[({BASE} + i * {size}, {size}, {dev}) for i in range({n})]"


VECTORS = [
    ("empty", "[]"),
    ("blocks_1_5120", blocks(1, 5120)),
    ("blocks_15_5120", blocks(15, 5120)),
    ("blocks_16_5120", blocks(16, 5120)),
    ("blocks_16_32768_dev3", blocks(16, 32768, 3)),
    ("blocks_880_5120", blocks(880, 5120)),
    ("blocks_880_32768", blocks(880, 32768)),
    ("blocks_65535_32768", blocks(65535, 32768)),
    ("blocks_65536_32768", blocks(65536, 32768)),
    # Every width boundary in each field. addr 2**64 - 1 with any non-zero
    # length overflows, so the addr list ends at 2**64 - 2; len 0 is
    # illegal, so the len list starts at 1.
    ("widths_addr", "[(a, 1, 0) for a in (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 2)]"),
    ("widths_len", "[(0, n, 0) for n in (1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1)]"),
    ("widths_dev", "[(0, 1, d) for d in (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1)]"),
    ("widths_mixed", "[(2**64 - 2, 1, 2**64 - 1), (2**32, 2**32 - 1, 65536), (65535, 256, 255), (128, 127, 0), (0, 2**64 - 1, 2**32)]"),
]


def pack(expr):
    return msgpack.packb(eval(expr), use_bin_type=True)


def to_hex(b):
    h = b.hex()
    return "".join(h[i:i + 64] + "\n" for i in range(0, len(h), 64))


def build():
    index, files = [], {}
    for name, expr in VECTORS:
        b = pack(expr)
        entry = {"name": name, "expr": expr, "len": len(b),
                 "sha256": hashlib.sha256(b).hexdigest(), "file": ""}
        if len(b) <= MAX_FILE:
            entry["file"] = name + ".hex"
            files[entry["file"]] = to_hex(b)
        index.append(entry)
    return json.dumps(index, indent=1) + "\n", files


def main():
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    index, files = build()
    files["golden.json"] = index
    if sys.argv[1:] == ["check"]:
        bad = 0
        for path, want in sorted(files.items()):
            try:
                with open(path) as f:
                    got = f.read()
            except OSError as e:
                got = None
                print(f"{path}: {e}", file=sys.stderr)
            if got != want:
                print(f"{path}: differs from what gen.py produces", file=sys.stderr)
                bad = 1
        sys.exit(bad)
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
