"""The ctypes binding of libecxfer.so (cmd/libecxfer in the Go sources).

ctypes releases the GIL for the duration of every call into a CDLL, so a
thread blocked in ecx_wait or ecx_notifs does not hold up the others. The
calls made on every READ (post_read, check, release, wait) go another way
where they can: as builtins the library makes with the interpreter's own
functions (see calls() and cmd/libecxfer/pycalls.c), which skip ctypes'
per-call costs, read Python lists in C with the GIL held and release it
around every call into the library proper.

The library is loaded on first use (get(), or the attribute lib), not on
import: loading it starts Go's runtime and its threads, and a process that
forks afterwards leaves those threads behind, so Go cannot run in the
child. vLLM imports its plugins in processes that fork later. A process
forked after the library was loaded gets a stand-in whose every call
raises ForkedError instead of hanging in Go.
"""

import ctypes
import os
import sys
import threading
from pathlib import Path

ABI_VERSION = 5

# Error codes, as cmd/libecxfer/codes.go numbers them.
CONFIG = -1
UNKNOWN_PEER = -2
INDEX_MISMATCH = -3
INDEX_RANGE = -4
BAD_HANDLE = -5
BAD_METADATA = -6
BAD_DESCRIPTOR = -7
BAD_NOTIF = -8
CLOSED = -9
BUSY = -10
REMOTE_DISCONNECT = -11
TIMEOUT = -12
CANCELED = -13
ENGINE = -14
NO_BACKEND = -15
BAD_ARG = -16
UNKNOWN_TRANSPORT = -17
UNPACKED = -18  # the builtins of calls() only: arguments they leave to the general path
OTHER = -99

BLOB_AGENT_METADATA = 1
BLOB_MEM_DESCRIPTOR = 2

_u64 = ctypes.c_uint64
_i64 = ctypes.c_int64
_int = ctypes.c_int
_vp = ctypes.c_void_p
_pvp = ctypes.POINTER(ctypes.c_void_p)

_SIGNATURES = {
    "ecx_abi_version": (_int, []),
    "ecx_new": (_int, [_vp, _i64, _vp, _i64, ctypes.POINTER(_u64)]),
    "ecx_deregister": (_int, [_u64]),
    "ecx_blob": (_i64, [_u64, _int, _pvp]),
    "ecx_add_peer": (_int, [_u64, _vp, _i64, _vp, _i64, ctypes.c_char_p, _i64, ctypes.POINTER(_u64)]),
    "ecx_remove_peer": (_int, [_u64, _vp, _i64]),
    "ecx_post_read": (_i64, [_u64, _vp, _i64, _u64, _vp, _i64, _vp, _i64]),
    "ecx_check": (_int, [_u64, _u64]),
    "ecx_wait": (_int, [_u64, _u64, _i64]),
    "ecx_release": (_int, [_u64, _u64]),
    "ecx_notifs": (_i64, [_u64, _i64, _pvp]),
    "ecx_stats": (_i64, [_u64, _pvp]),
    "ecx_runtime": (_i64, [_pvp]),
    "ecx_last_error": (_i64, [ctypes.c_char_p, _i64]),
    "ecx_free": (None, [_vp]),
    "ecx_fault_handlers": (_int, []),
    "ecx_py_api": (_int, [_pvp, _i64]),
}

# The builtins ecx_py_call makes, by number.
CALLS = ("post_read", "check", "release", "wait")

# The interpreter's functions ecx_py_api installs, in its order (all of
# the stable ABI), then the addresses of the objects _PY_OBJS lists.
_PY_API = (
    "PyList_Size",
    "PyList_GetItem",
    "PyTuple_Size",
    "PyTuple_GetItem",
    "PyLong_AsLongLong",
    "PyErr_Occurred",
    "PyErr_Clear",
    "PyEval_SaveThread",
    "PyEval_RestoreThread",
    "PyCFunction_NewEx",
    "PyLong_AsUnsignedLongLong",
    "PyLong_FromLongLong",
    "Py_IncRef",
    "PyBytes_AsString",
    "PyBytes_Size",
    "PyDict_GetItemWithError",
)
# The states the check builtin returns: these objects, which live as long
# as this module.
STATES = ("PROC", "DONE", "ERR")
_PY_OBJS = (list, tuple, int, bytes, dict, str, None) + STATES


def library_path() -> str:
    """Where the library is: $ECXFER_LIB, else next to this module."""
    return os.environ.get("ECXFER_LIB") or str(Path(__file__).with_name("libecxfer.so"))


def load() -> ctypes.CDLL:
    global _mapped
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(
            f"ecxfer: cannot load {path}: {e} (build it with `make python`, or install the wheel: "
            "pip install ./python; a library it names as missing, such as libucp.so.0, comes with "
            "UCX: apt-get install libucx0)"
        ) from e
    # Mapped, its Go runtime started, whatever the checks below say: a
    # child forked from here on must not load it again (_forked_child).
    _mapped = True
    # The version first: a library of another version may lack entries.
    try:
        ver = lib.ecx_abi_version
    except AttributeError as e:
        raise ImportError(f"ecxfer: {path} is not an ecxfer library: {e}") from None
    ver.restype, ver.argtypes = _SIGNATURES["ecx_abi_version"]
    v = ver()
    if v != ABI_VERSION:
        raise ImportError(f"ecxfer: {path} has ABI version {v}, this package needs {ABI_VERSION}")
    for name, (res, args) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise ImportError(f"ecxfer: {path} (ABI version {v}) lacks {name}: {e}") from None
        fn.restype = res
        fn.argtypes = args
    lib.calls = calls(lib, path)
    return lib


class Calls:
    """The builtins the library makes (see cmd/libecxfer/pycalls.c):
    post_read(t, local, peers, name, remote, notif) -> handle or code,
    check(t, h) -> "PROC"/"DONE"/"ERR", release(t, h) -> code,
    wait(t, h, timeout_ns) -> state or code. Each returns UNPACKED for
    arguments it leaves to the general path (check: "ERR")."""

    __slots__ = CALLS

    def __init__(self, fns):
        for name, fn in zip(CALLS, fns):
            setattr(self, name, fn)


def _main_interpreter() -> bool:
    """Whether this runs in the process's main interpreter (True where
    the interpreter cannot tell: no sub-interpreters then)."""
    for name in ("_interpreters", "_xxsubinterpreters"):
        try:
            mod = __import__(name)
        except ImportError:
            continue
        try:
            cur, main = mod.get_current(), mod.get_main()
        except Exception:  # noqa: BLE001 - an API other than the one known
            return False
        # 3.13's _interpreters returns (id, whence) pairs.
        if isinstance(cur, tuple):
            cur, main = cur[0], main[0]
        return int(cur) == int(main)
    return True


def calls(lib: ctypes.CDLL, path: str):
    """The library's builtins, once the interpreter's functions are
    installed; None where they cannot be: not CPython, or a CPython whose
    objects are laid out otherwise (a free-threaded build, where also
    another thread could change a list while C reads it; one with
    Py_TRACE_REFS), or ECXFER_PY_CALLS=0 (or its older name
    ECXFER_PY_LISTS=0: then every call goes through ctypes, and lists
    through struct.pack). Called while the library is being loaded: it
    must not call get()."""
    if "0" in (os.environ.get("ECXFER_PY_CALLS"), os.environ.get("ECXFER_PY_LISTS")):
        return None
    word = ctypes.sizeof(ctypes.c_void_p)
    # A plain object is two words, its reference count and its type,
    # except in free-threaded builds and builds with Py_TRACE_REFS.
    if sys.implementation.name != "cpython" or object.__basicsize__ != 2 * word:
        return None
    if not _main_interpreter():
        # What the builtins are made of is the whole process's (see
        # cmd/libecxfer/pycalls.c): the main interpreter's alone.
        return None
    try:
        api = ctypes.pythonapi
        fns = [ctypes.cast(getattr(api, name), ctypes.c_void_p).value for name in _PY_API]
        # The functions must be this interpreter's: ctypes.pythonapi could
        # have found another libpython's first.
        if ctypes.addressof(ctypes.c_char.in_dll(api, "PyList_Type")) != id(list):
            return None
    except (AttributeError, ValueError):
        return None
    fns += [id(o) for o in _PY_OBJS]  # in CPython, an object's address
    # The C side finds an object's type in its second word: check it.
    for obj, typ in (([], list), ((1,), tuple), (1 << 40, int), (True, bool), (b"", bytes), ({}, dict), ("", str)):
        if ctypes.c_void_p.from_address(id(obj) + word).value != id(typ):
            return None
    arr = (ctypes.c_void_p * len(fns))(*fns)
    # Both with the GIL held (a PyDLL of the same library): ecx_py_api takes
    # references to the states, ecx_py_call makes the builtins.
    held = ctypes.PyDLL(path, handle=lib._handle)
    install, make = held.ecx_py_api, held.ecx_py_call
    install.restype, install.argtypes = _int, [_pvp, _i64]
    make.restype, make.argtypes = ctypes.py_object, [_i64]
    if install(arr, len(fns)) != 0:  # plain C: no error message to take
        return None
    fns = [make(i) for i in range(len(CALLS))]
    if None in fns:  # the interpreter could not make one
        return None
    return Calls(fns)


_load_lock = threading.Lock()
_loading = False  # a thread is loading the library (under _load_lock)
_mapped = False  # the library was mapped here, even if load() then refused it
_after_fork = []  # callables run in a child forked after the library was loaded


def get():
    """The library, loaded on the first call (the stand-in in a process
    forked after that)."""
    lib = globals().get("lib")
    if lib is not None:
        return lib
    global _loading
    with _load_lock:
        lib = globals().get("lib")
        if lib is None:
            # A fork from another thread from here on leaves a child
            # with the library (half) loaded: _forked_child sees the flag.
            _loading = True
            try:
                lib = load()
                globals()["lib"] = lib
            finally:
                _loading = False
    return lib


def loaded() -> bool:
    """Whether this process has loaded the library (or inherited it)."""
    return "lib" in globals()


def __getattr__(name):
    # PEP 562: the first read of _lib.lib loads the library; later reads
    # find the module attribute get() set.
    if name == "lib":
        return get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Forked:
    """The library in a process forked after it was loaded: every function
    raises ForkedError. Go's runtime lost its threads in the fork; a call
    could wait forever on a lock one of them held."""

    calls = None  # no builtins: every call takes the general path, and raises

    def __getattr__(self, name):
        def refuse(*args):
            from .errors import ForkedError

            raise ForkedError(
                f"ecxfer: this process was forked after it loaded {library_path()}; Go's runtime does "
                "not survive a fork, so ecxfer cannot be used here (create transports only in the "
                "process that uses them, or start it with the spawn method)"
            )

        return refuse


def _forked_child() -> None:
    global _load_lock
    # The parent's lock may have been held by a thread the child does not
    # have (one loading the library): the child's first load would wait
    # on it forever.
    _load_lock = threading.Lock()
    if not loaded() and not _loading and not _mapped:
        return  # nothing inherited: the child loads its own copy on first use
    # Loaded, being loaded when the parent forked, or mapped and then
    # refused (another ABI version, a missing entry): Go's runtime may be
    # up (or starting) in the parent and is not in the child, and loading
    # the library again would hand back the parent's copy.
    globals()["lib"] = _Forked()
    for f in _after_fork:
        f()


os.register_at_fork(after_in_child=_forked_child)


def last_error() -> str:
    """The calling thread's last error message (and forget it); a message
    longer than 4 KiB comes back cut."""
    buf = ctypes.create_string_buffer(4096)
    get().ecx_last_error(buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def take_bytes(ptr: ctypes.c_void_p, n: int) -> bytes:
    """Copy n bytes the library malloc'd at ptr and free them."""
    if n <= 0 or not ptr.value:
        return b""
    try:
        return ctypes.string_at(ptr.value, n)
    finally:
        get().ecx_free(ptr)
