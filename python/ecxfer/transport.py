"""EcxferDataTransport: ecxfer's transport with vLLM's DataTransport API."""

import array
import contextlib
import ctypes
import json
import logging
import math
import operator
import os
import reprlib
import struct
import threading
import time
import weakref
from typing import Any

from . import _lib
from .errors import (
    BadArgumentError,
    BadArgumentTypeError,
    BadHandleError,
    ClosedError,
    ConfigError,
    EcxferError,
    IndexMismatchError,
    IndexRangeError,
    UnknownPeerError,
    from_code,
)

logger = logging.getLogger("ecxfer")

# The library's functions, bound by _bind() when the first transport is
# made (loading the library then, not at import; see _lib). In a process
# forked after that they are the stand-in's, which raise ForkedError.
# The builtins of _lib.calls() where the library could make them (None
# where not: every call goes through ctypes then): _post_py reads lists and
# tuples in C, _check_py, _release_py and _wait_py skip ctypes' costs.
_lib_: Any = None
_post: Any = None
_post_py: Any = None
_check: Any = None
_check_py: Any = None
_release_py: Any = None
_wait_py: Any = None


def _bind() -> None:
    global _lib_, _post, _post_py, _check, _check_py, _release_py, _wait_py
    lib = _lib.get()
    if lib is not _lib_:
        _lib_, _post, _check = lib, lib.ecx_post_read, lib.ecx_check
        c = lib.calls  # None where the library could not make them, and in a forked child
        if c is None:
            _post_py = _check_py = _release_py = _wait_py = None
        else:
            _post_py, _check_py, _release_py, _wait_py = c.post_read, c.check, c.release, c.wait


_lib._after_fork.append(_bind)

_fault_warned = 0


def _check_fault_handlers() -> None:
    """Warn (once) when a SIGBUS or SIGSEGV handler was installed after the
    library loaded: a direct READ of a producer that truncates its region
    file then kills the process instead of failing the READ."""
    global _fault_warned
    moved = _lib_.ecx_fault_handlers()
    if moved & ~_fault_warned:
        _fault_warned |= moved
        which = " and ".join(n for bit, n in ((1, "SIGBUS"), (2, "SIGSEGV")) if moved & bit)
        logger.warning(
            "ecxfer: a %s handler was installed after libecxfer loaded (faulthandler.enable()?): "
            "a producer that truncates its region file will now crash this process instead of "
            "failing the READ; enable faulthandler before the first EcxferDataTransport "
            "(python -X faulthandler, PYTHONFAULTHANDLER=1)",
            which,
        )


def _finalize(t: int, pid: int) -> None:
    """Deregister a dropped transport, but never from a forked child: the
    transport belongs to the process that made it."""
    if os.getpid() == pid:
        _lib_.ecx_deregister(t)

try:  # subclass vLLM's DataTransport when vLLM is there
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.base import DataTransport as _Base
except Exception:  # vLLM absent, or a release without the EC CPU connector
    _Base = object

_STATES = {0: "PROC", 1: "DONE"}

# array typecodes of 8-byte signed integers, and the struct formats a
# buffer of int64 can carry.
_I64_CODES = {c for c in "qlL" if c != "L" and array.array(c).itemsize == 8}
_I64_FORMATS = {"q", "<q", "=q", "@q", "l", "<l", "=l", "@l"}


_PACKERS: dict[int, struct.Struct] = {}

_SEQS = (list, tuple)
_UNPACKED = _lib.UNPACKED


def _one_dim(x: Any) -> None:
    """Refuse index collections whose order is not theirs to give (sets,
    dicts: the i-th local block goes with the i-th remote one) and arrays
    of more than one dimension (whose len() is not their count)."""
    if isinstance(x, (set, frozenset, dict)):
        raise BadArgumentTypeError(
            f"ecxfer: block indices are an ordered sequence of ints, not a {type(x).__name__}"
        )
    nd = getattr(x, "ndim", 1)
    ai = getattr(x, "__array_interface__", None)
    if type(ai) is dict and type(ai.get("shape")) is tuple:
        nd = len(ai["shape"])
    if nd != 1:
        raise BadArgumentTypeError(f"ecxfer: block indices are one-dimensional, not of {nd} dimensions")


# The most copy workers a transport takes (Config.CopyWorkers).
_MAX_COPY_WORKERS = 256

# The lowest address that can name memory: the kernel never maps the first
# page (vm.mmap_min_addr is at least 4096), and Go's runtime takes any
# pointer below this for a corrupt one.
_FIRST_ADDR = 4096


def _indices(x: Any):
    """Return (keepalive, pointer, count) for an index list without
    building a Python int per element when x is already a buffer of
    int64: array('q'), a C-contiguous int64 numpy array, or any writable
    buffer of int64. Lists and tuples of ints are packed into one bytes
    object by struct.pack, which reads their ints in C; ranges, and lists
    struct cannot pack, go through one array('q'), which says what is
    wrong with them."""
    if type(x) is array.array and x.typecode in _I64_CODES:
        # The memoryview exports the array's buffer until the call is
        # done: another thread's extend() cannot move it meanwhile (it
        # raises BufferError instead).
        pin = memoryview(x)
        addr, n = x.buffer_info()
        return (x, pin), addr, n
    ai = getattr(x, "__array_interface__", None)
    if type(ai) is dict and ai.get("typestr") == "<i8" and ai.get("strides") is None and not ai.get("offset"):
        # Only the (address, read-only) form of "data" names memory; the
        # interface also allows None or a buffer object, which go the
        # general way below.
        data = ai.get("data")
        # An address in the first page (never mapped) is no array's: it
        # goes the general way too, which says what is wrong with x, and
        # never reaches the library, whose Go runtime aborts the process
        # on finding such a pointer.
        if type(data) is tuple and len(data) == 2 and type(data[0]) is int and data[0] >= _FIRST_ADDR:
            shape = ai.get("shape") or (0,)
            n = 1
            for d in shape:
                n *= d
            return x, data[0], n
    if type(ai) is dict and type(ai.get("typestr")) is str and ai["typestr"][1:2] in ("i", "u"):
        # Another integer type (int32, uint64, big-endian), or int64 not
        # contiguous: the array converts itself, in C (numpy's astype),
        # instead of array('q') making an object of every element. A value
        # of uint64 above 2**63-1 comes out negative: out of range either
        # way. The copy is C-contiguous int64 with its own data.
        astype = getattr(x, "astype", None)
        if callable(astype):
            try:
                y = astype("<i8", order="C")
            except Exception:  # noqa: BLE001 - not numpy's: the general way says what is wrong
                y = None
            yi = getattr(y, "__array_interface__", None)
            if type(yi) is dict and yi.get("typestr") == "<i8" and yi.get("strides") is None and not yi.get("offset"):
                data = yi.get("data")
                if type(data) is tuple and len(data) == 2 and type(data[0]) is int and data[0] >= _FIRST_ADDR:
                    n = 1
                    for d in yi.get("shape") or (0,):
                        n *= d
                    return y, data[0], n
    t = type(x)
    if t is list or t is tuple:
        # One struct.pack reads the ints in C, about 2.5x faster than
        # array('q', x); the bytes object is passed as the pointer itself.
        n = len(x)
        s = _PACKERS.get(n)
        if s is None:
            s = struct.Struct(f"={n}q")
            if len(_PACKERS) < 1024:
                _PACKERS[n] = s
        try:
            b = s.pack(*x)
        except struct.error:
            pass  # not ints, or out of range: array('q') says which below
        else:
            return b, b, n
    if isinstance(x, (list, tuple, range)):
        return _q_array(x)
    try:
        mv = memoryview(x)
    except TypeError:
        mv = None
    if mv is not None and mv.format in _I64_FORMATS and mv.itemsize == 8 and mv.c_contiguous:
        n = mv.nbytes // 8
        if n == 0:
            return mv, None, 0
        if not mv.readonly:
            c = (ctypes.c_char * mv.nbytes).from_buffer(mv)
            return (mv, c), ctypes.addressof(c), n
        a = array.array("q")
        a.frombytes(mv.cast("B"))
        addr, n = a.buffer_info()
        return a, addr, n
    return _q_array(x)  # any other sized iterable of ints (numpy of another dtype, deque)


def _q_array(x):
    """x as an array('q'), with its address and length."""
    if isinstance(x, (bytes, bytearray)):
        # array('q', b) would take b's bytes eight at a time as raw int64s.
        raise BadArgumentTypeError(f"ecxfer: block indices are ints, not {type(x).__name__}")
    try:
        a = array.array("q", x)
    except OverflowError as e:
        raise IndexRangeError(f"ecxfer: block index out of range: {e}") from None
    except TypeError as e:
        raise BadArgumentTypeError(f"ecxfer: block indices must be ints: {e}") from None
    addr, n = a.buffer_info()
    return a, addr, n


# The largest caller region the library takes (its bound on every length,
# maxLen in cmd/libecxfer/abi.go).
_MAX_REGION = 1 << 40


def _int_arg(name: str, v: Any, end: int) -> int:
    """v as an int in [0, end), or ConfigError: ctypes would wrap a value
    out of its C type's range silently (2**64 + 256 bytes would pass as
    256)."""
    try:
        i = operator.index(v)
    except TypeError:
        raise ConfigError(f"ecxfer: bad config: {name} {v!r} is not an int") from None
    if not 0 <= i < end:
        raise ConfigError(f"ecxfer: bad config: {name} {i} out of range 0..{end - 1}")
    return i


def _blob_arg(name: str, v: Any) -> bytes:
    """A bytes-like argument as bytes (an int would make that many zero
    bytes, None a TypeError)."""
    if type(v) is bytes:
        return v
    try:
        return bytes(memoryview(v))
    except TypeError:
        raise BadArgumentTypeError(f"ecxfer: {name} is bytes, not {type(v).__name__}") from None


def _notif_bytes(msg: Any) -> bytes:
    """A notification as bytes: str is UTF-8 encoded, None is none, any
    other bytes-like object is copied; anything else (an int would make
    that many zero bytes) is refused."""
    if msg is None:
        return b""
    if isinstance(msg, str):
        try:
            return msg.encode()
        except UnicodeEncodeError as e:  # a lone surrogate
            raise BadArgumentError(f"ecxfer: a notification str is not valid UTF-8: {e}") from None
    try:
        return bytes(memoryview(msg))
    except TypeError:
        raise BadArgumentTypeError(f"ecxfer: a notification is bytes or str, not {type(msg).__name__}") from None


# The longest one library call of wait() or wait_notifs() blocks: the
# library does not look at Python's signals, so an unbounded wait is a
# loop of these, and Ctrl-C (KeyboardInterrupt) lands between two.
_WAIT_SLICE_NS = 100_000_000


def _slice_ns(end: int | None) -> int:
    """How long the next library wait may block: a slice, or what is left
    until end (monotonic ns; None: no end)."""
    if end is None:
        return _WAIT_SLICE_NS
    return max(0, min(_WAIT_SLICE_NS, end - time.monotonic_ns()))


def _short_repr(v: Any) -> str:
    """repr(v) cut to a log line's worth (a caller's garbage argument may
    be megabytes long)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 300
    return r.repr(v)


def _timeout_ns(timeout: Any, least: int) -> int:
    """Seconds (None or infinite: no limit) as nanoseconds for the
    library, at least least; -1 is no limit."""
    if timeout is None:
        return -1
    kind = type(timeout)
    if (kind is float or kind is int) and 0 < timeout < 1e9:  # NaN fails both
        return max(least, int(timeout * 1e9))
    if isinstance(timeout, (str, bytes, bytearray)):  # float() would parse one
        raise BadArgumentTypeError(f"ecxfer: timeout {timeout!r} is not a number of seconds")
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise BadArgumentTypeError(f"ecxfer: timeout {timeout!r} is not a number of seconds") from None
    except OverflowError:  # an int beyond a float's range
        t = math.inf if timeout > 0 else -math.inf
    if math.isnan(t):
        raise BadArgumentError("ecxfer: timeout is NaN")
    if t <= 0:
        return least
    if t * 1e9 >= 2**63:
        return -1  # beyond 292 years (inf included): no limit
    return max(least, int(t * 1e9))


def _json_ok(v) -> bool:
    """Whether json.dumps(v, allow_nan=False) would take v."""
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _free_handed(p: ctypes.c_void_p) -> None:
    """Frees a buffer the library handed over at p by a call whose return
    value was lost (a signal handler raised as it returned)."""
    if p.value:
        _lib_.ecx_free(p)


class _RepeatedKey(Exception):
    pass


def _no_repeats(pairs: list) -> dict:
    """json's object hook that refuses a key given twice (json.loads keeps
    the last one, and the library's own check of repeated options would
    never see the first)."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise _RepeatedKey(k)
        d[k] = v
    return d


def _options_from_env() -> dict:
    raw = os.environ.get("ECXFER_OPTIONS", "").strip()
    if not raw:
        return {}
    try:
        opts = json.loads(raw, object_pairs_hook=_no_repeats)
    except _RepeatedKey as e:
        raise ConfigError(f"ecxfer: bad config: ECXFER_OPTIONS gives {e.args[0]!r} twice") from None
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ConfigError(f"ecxfer: bad config: ECXFER_OPTIONS is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise ConfigError("ecxfer: bad config: ECXFER_OPTIONS must be a JSON object")
    return opts


class EcxferDataTransport(_Base):
    """ecxfer's transport with vLLM's DataTransport interface.

    The constructor takes what vLLM's NixlDataTransport takes. base_ptr is
    the address of the block region (for vLLM, a MAP_SHARED mapping of a
    /dev/shm file), which must stay mapped until deregister(); 0 lets the
    transport allocate its own. num_threads is what NIXL gets for its
    transfer threads; here the threads that move bytes are the copy
    workers of the direct path, so a num_threads above 1 sets copy_workers
    (unless that option is given; at most 256, their limit). 1, vLLM's
    default, keeps ecxfer's default. The engine itself always has one reactor thread.

    options reach the Go Config: backend ("ucx", the default, "nixl", or
    "loopback", in-process and for tests only),
    xfer_timeout_s, pin_cpu, numa_node, idle ("hybrid", "spin", "yield",
    "park"), spin_for_us, yield_for_us, park_timeout_us, wait_spin_us,
    batch_size, submit_ring, handles, wait_when_busy, max_notif,
    reactor_only (callers never step in for the reactor thread), direct
    ("auto", "on", "off": same-host READs bypass the engine and copy from
    the peer's mapped region), inline_bytes, copy_workers, no_gather
    (READs of peers on other hosts go as UCX gets, not gathered),
    large_tcp_segments (UCX tcp segments of 256 KiB: every peer must set
    it too, README "Tuning"). The JSON
    object in $ECXFER_OPTIONS supplies defaults for them (that is how
    options reach a transport vLLM builds); keyword arguments win, and
    one given as None counts as not given. agent_name, block_size and
    num_blocks are not options (ConfigError): they come from the
    arguments above.

    Every method is safe to call from any thread. Calls into the library
    release the GIL (post_read given lists once it has read them). The
    library is loaded when the first transport is made. A transport
    belongs to the process that made it: in a process forked after the
    library was loaded, every call raises ForkedError (the methods that
    never raise log it; deregister() only forgets the transport); fork
    before, or use the spawn start method.
    """

    def __init__(
        self,
        agent_name: str,
        base_ptr: int,
        num_blocks: int,
        block_size_bytes: int,
        total_size_bytes: int,
        num_threads: int = 1,
        **options: Any,
    ) -> None:
        opts = _options_from_env()
        # A keyword given as None is not given (ECXFER_OPTIONS' value, or
        # the default, stands); one the environment does not set either
        # still goes to the library as null, which refuses a name it does
        # not know.
        opts.update({k: v for k, v in options.items() if v is not None or k not in opts})
        # The library's own names for the constructor's arguments: an
        # option or an ECXFER_OPTIONS key of that name would be
        # overwritten below without a word.
        for k in ("agent_name", "block_size", "num_blocks"):
            if k in opts:
                raise ConfigError(
                    f"ecxfer: bad config: {k} is not an option (it comes from the constructor's arguments)"
                )
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ConfigError(f"ecxfer: bad config: num_threads {num_threads!r} (want an int >= 1)")
        if num_threads > 1 and opts.get("copy_workers") is None:
            # (None: not given, as above.) NIXL takes any count; the copy
            # workers stop at _MAX_COPY_WORKERS, which is plenty.
            opts["copy_workers"] = min(num_threads, _MAX_COPY_WORKERS)
        if not isinstance(agent_name, str):
            raise ConfigError(f"ecxfer: bad config: agent_name {agent_name!r} is not a str")
        # Counts are ints: int() would bend 4096.5 into 4096 and "4096" into
        # 4096; the library checks their range.
        num_blocks = _int_arg("num_blocks", num_blocks, 1 << 63)
        block_size_bytes = _int_arg("block_size_bytes", block_size_bytes, 1 << 63)
        opts.update(agent_name=agent_name, block_size=block_size_bytes, num_blocks=num_blocks)
        try:
            # allow_nan=False: JSON has no inf or NaN (Python would write
            # Infinity, which the library could only call a bad character).
            raw = json.dumps(opts, allow_nan=False).encode()
        except (TypeError, ValueError, RecursionError) as e:  # an option value JSON cannot carry
            bad = ", ".join(f"{k}={v!r}" for k, v in opts.items() if not _json_ok(v))
            raise ConfigError(f"ecxfer: bad config: option {bad}: {e}") from None
        if type(base_ptr) is bool:
            raise ConfigError(f"ecxfer: bad config: base_ptr {base_ptr!r} is not an address")
        region = _int_arg("base_ptr", 0 if base_ptr is None else base_ptr, 1 << 64)
        if 0 < region < _FIRST_ADDR:
            # The first page is never mapped, and the library's Go runtime
            # aborts the process on a pointer into it.
            raise ConfigError(f"ecxfer: bad config: base_ptr {region:#x} is not an address (below {_FIRST_ADDR:#x})")
        size = _int_arg("total_size_bytes", 0 if total_size_bytes is None else total_size_bytes, 1 << 63)
        if region == 0:
            size = 0
        elif not 0 < size <= _MAX_REGION:
            raise ConfigError(
                f"ecxfer: bad config: total_size_bytes {size} with a base_ptr: the region must be 1 byte to 1 TiB"
            )
        _bind()
        tid = ctypes.c_uint64()
        fin = None
        try:
            rc = _lib_.ecx_new(raw, len(raw), region or None, size, ctypes.byref(tid))
            if rc == 0:
                # From here the finalizer owns the transport.
                fin = weakref.finalize(self, _finalize, tid.value, os.getpid())
        except BaseException:
            # A signal handler raised before the finalizer was made: the
            # transport would have no owner; take it down (tid is 0 if
            # none was made; a second deregister of an id is harmless).
            if tid.value and fin is None:
                _lib_.ecx_deregister(tid.value)
            raise
        if rc != 0:
            raise from_code(rc)
        self._t = tid.value
        self._finalizer = fin
        self.agent_name = agent_name
        self.num_blocks = num_blocks
        self.block_size_bytes = block_size_bytes
        self._peers: dict[str, int] = {}
        # Held across the library's add or remove of a peer and the update
        # of _peers that goes with it: without it, an add, a remove and an
        # add of one name on three threads could leave _peers with the
        # first add's id, which the library no longer knows.
        self._peers_lock = threading.Lock()
        self._pid = os.getpid()
        # deregister() holds it while it tears down: a second call waits
        # for the first, so neither returns while the region is in use.
        # Re-entrant: a signal handler that calls deregister() runs in the
        # thread a first call may be in (CPython runs handlers in the main
        # thread, between bytecodes); that call finds the transport
        # already taken apart and returns.
        self._closing = threading.RLock()
        # Notifications a signal handler's exception kept _notifs from
        # returning: handed out by the next call (guarded by _held_mu).
        self._held: dict[str, list[bytes]] | None = None
        self._held_mu = threading.Lock()
        # self._finalizer (set above) tears the transport down if the
        # object is dropped without deregister(), at the latest when the
        # interpreter exits.
        _check_fault_handlers()

    # -- vLLM's DataTransport -------------------------------------------

    def get_agent_metadata(self) -> bytes:
        return self._blob(_lib.BLOB_AGENT_METADATA)

    def get_mem_descriptor(self) -> bytes:
        return self._blob(_lib.BLOB_MEM_DESCRIPTOR)

    def add_remote_peer(self, metadata: bytes, mem_descriptor: bytes) -> str:
        """Load a peer's metadata and msgpack block list; return its name.
        Bad input raises BadMetadataError or BadDescriptorError (both
        ValueError). The same metadata again returns the same name; a
        peer found dead stays dead until remove_remote_peer and then
        add_remote_peer load it afresh."""
        md = _blob_arg("metadata", metadata)
        desc = _blob_arg("mem_descriptor", mem_descriptor)
        self._live()
        name = ctypes.create_string_buffer(260)
        pid = ctypes.c_uint64()
        with self._peers_guard():
            rc = _lib_.ecx_add_peer(self._t, md, len(md), desc, len(desc), name, len(name), ctypes.byref(pid))
            if rc != 0:
                raise from_code(rc)
            agent = name.value.decode("ascii")
            self._peers[agent] = pid.value
        _check_fault_handlers()
        return agent

    def remove_remote_peer(self, agent_name: str) -> None:
        """Forget a peer, canceling its READs in flight. Never raises: a
        failure (an unknown name, a closed transport) is logged."""
        try:
            if isinstance(agent_name, str):
                key = agent_name
                name = agent_name.encode("ascii")
            else:
                # bytes(n) of an int n would make n zero bytes.
                name = _blob_arg("agent_name", agent_name)
                key = name.decode("ascii", "replace")
            with self._peers_guard():
                self._peers.pop(key, None)
                rc = _lib_.ecx_remove_peer(self._t, name, len(name))
            if rc != 0:
                if self._t == 0:
                    raise ClosedError("ecxfer: transport deregistered")
                raise from_code(rc)
        except Exception:
            logger.warning("ecxfer: remove_remote_peer(%s) failed", _short_repr(agent_name), exc_info=True)

    def post_read(self, local_indices, agent_name: str, remote_indices, notif_msg: bytes) -> int:
        """Post a READ of the peer's remote_indices blocks into the local
        local_indices blocks; notif_msg goes to the peer once the data has
        landed (none when empty). Returns the handle; never waits for data.

        The index lists may be lists or tuples of ints (read in C, without a
        Python object per index), or array('q') or int64 numpy arrays,
        which are read in place (not reliably faster than lists; README,
        make bench-python); they are ordered and
        one-dimensional (a set, a dict or a 2-D array raises
        BadArgumentTypeError). Raises ValueError
        (IndexMismatchError, "mismatch") when the counts differ, KeyError
        (UnknownPeerError) for an unknown agent, IndexError
        (IndexRangeError) for an index out of range, ClosedError after
        deregister()."""
        if _post_py is not None:
            # Lists as vLLM passes them, a known agent, bytes: all read in
            # C, the lists' ints each once, with the GIL held (see
            # cmd/libecxfer/pycalls.c). Anything else comes back UNPACKED,
            # before anything is posted, and goes the general way below,
            # which says what is wrong with it.
            h = _post_py(self._t, local_indices, self._peers, agent_name, remote_indices, notif_msg)
            if h > 0:
                return h
            if h != _UNPACKED:
                raise from_code(h)
        if self._t == 0:
            raise ClosedError("ecxfer: transport deregistered")
        _one_dim(local_indices)
        _one_dim(remote_indices)
        try:
            n, m = len(local_indices), len(remote_indices)
        except TypeError as e:
            raise BadArgumentTypeError(f"ecxfer: block indices are a sized sequence of ints: {e}") from None
        except OverflowError as e:  # a range of more than 2**63 items
            raise IndexRangeError(f"ecxfer: more block indices than any region has blocks: {e}") from None
        if n != m:
            raise IndexMismatchError(f"EC: local/remote block count mismatch ({n} vs {m})")
        try:
            pid = self._peers.get(agent_name)
        except TypeError:  # unhashable: not a name
            raise BadArgumentTypeError(f"ecxfer: an agent name is a str, not {type(agent_name).__name__}") from None
        if pid is None:
            if self._t == 0:  # deregistered meanwhile
                raise ClosedError("ecxfer: transport deregistered")
            raise UnknownPeerError(f"ecxfer: unknown agent {agent_name!r} (add_remote_peer() it first)")
        if type(notif_msg) is not bytes:
            notif_msg = _notif_bytes(notif_msg)
            if _post_py is not None and type(local_indices) in _SEQS and type(remote_indices) in _SEQS:
                # Again with the notification made bytes: the lists may
                # be fine (if not, UNPACKED again, and the general way).
                h = _post_py(self._t, local_indices, self._peers, agent_name, remote_indices, notif_msg)
                if h > 0:
                    return h
                if h != _UNPACKED:
                    raise from_code(h)
        keep_l, la, ln = _indices(local_indices)
        keep_r, ra, rn = _indices(remote_indices)
        if ln != rn:  # a 2-D array has a len() other than its count
            raise IndexMismatchError(f"EC: local/remote block count mismatch ({ln} vs {rn})")
        h = _post(self._t, la, ln, pid, ra, rn, notif_msg, len(notif_msg))
        if h <= 0:
            raise from_code(h)
        del keep_l, keep_r
        return h

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """The notifications received since the last call, by sender; each
        is handed out once. Empty after deregister()."""
        return self._notifs(0)

    def check_xfer_state(self, handle: Any) -> str:
        """"PROC", "DONE" or "ERR" (failed, released, unknown or not a
        handle at all); xfer_error(handle) says why. Does not wait for the
        READ: for a large same-host READ still on the copy workers it
        copies one chunk that no worker has taken (at most 256 KiB or an
        eighth of the READ, whichever is larger, with two workers), or with
        every chunk taken yields the CPU once to the threads copying them
        (sched_yield), and returns. For an engine READ (another host, or
        direct="off") it may take a step of the engine's work, and while
        more engine READs are in flight than twice the Go scheduler's
        processors it may sleep up to 200 us for a READ checked in a loop
        (see CheckXferState in the Go package). The GIL is released
        meanwhile."""
        if _check_py is not None:
            return _check_py(self._t, handle)
        if type(handle) is not int or handle <= 0 or handle >= 1 << 64:
            return "ERR"
        st = _check(self._t, handle)
        if st >= 0:
            return _STATES[st]
        _lib.last_error()  # not asked for here; do not leave it behind
        return "ERR"

    def release_xfer_handle(self, handle: Any) -> None:
        """Free a handle, canceling its READ if still in flight. A READ the
        copy workers are running (a large same-host one) is released once
        its copy has stopped, and an engine READ in flight once the reactor
        has released it (the ucx engine then fences the local blocks), so
        its blocks may take other data as soon as this returns. Never raises: a failure (a second release, a bad
        handle) is logged."""
        try:
            rc = _UNPACKED if _release_py is None else _release_py(self._t, handle)
            if rc == 0:
                return
            if rc == _UNPACKED:  # not taken: not a handle, or no builtin
                if type(handle) is not int or handle <= 0 or handle >= 1 << 64:
                    raise BadHandleError(f"ecxfer: not a handle: {handle!r}")
                rc = _lib_.ecx_release(self._t, handle)
            if rc != 0:
                if self._t == 0:
                    raise ClosedError("ecxfer: transport deregistered")
                raise from_code(rc)
        except Exception:
            logger.warning("ecxfer: release_xfer_handle(%s) failed", _short_repr(handle), exc_info=True)

    def deregister(self) -> None:
        """Tear everything down: handles, peers, memory registration, the
        engine and the reactor thread. Never raises. A second call waits
        for a first one still tearing down, then does nothing (one from a
        signal handler that interrupted the first in its thread returns at
        once); in a
        process forked from the one that made the transport it only
        forgets it. Afterwards post_read and add_remote_peer raise
        ClosedError, check_xfer_state returns "ERR" and get_new_notifs {}."""
        try:
            if self._pid != os.getpid():
                # Inherited by a forked child: the parent's to tear down.
                # Not under _closing, which a thread of the parent may
                # have held at the fork, and no thread here would release.
                self._t = 0
                self._peers.clear()
                self._finalizer.detach()
                return
            with self._closing:
                t, self._t = self._t, 0
                self._peers.clear()
                if t == 0:
                    return
                # The finalizer goes only once the library has torn the
                # transport down: should a signal handler raise before
                # that, the finalizer still does it when the object goes
                # (deregistering an id twice is harmless; ids are never
                # reused).
                rc = _lib_.ecx_deregister(t)
                self._finalizer.detach()
                if rc != 0:
                    raise from_code(rc)
        except Exception:
            logger.warning("ecxfer: deregister failed", exc_info=True)

    # -- beyond vLLM's interface ----------------------------------------

    def xfer_error(self, handle: Any) -> EcxferError | None:
        """The error behind a READ's "ERR" state (RemoteDisconnectError,
        XferTimeoutError, CanceledError, BadHandleError, ...), or None
        while it is PROC or DONE."""
        if type(handle) is not int or handle <= 0 or handle >= 1 << 64:
            return BadHandleError(f"ecxfer: not a handle: {handle!r}")
        st = _check(self._t, handle)
        if st < 0 and self._t == 0:
            return ClosedError("ecxfer: transport deregistered")
        return None if st >= 0 else from_code(st)

    def wait(self, handle: int, timeout: float | None = None) -> str:
        """Block (without the GIL) until the READ leaves PROC or timeout
        seconds pass; return its state as check_xfer_state does. For a
        large same-host READ still on the copy workers it copies chunks
        meanwhile, as check_xfer_state does, so it may return up to two
        chunks' copying after timeout."""
        if _check_py is not None and (timeout is None or (type(timeout) in (int, float) and timeout == timeout)):
            # A READ that ended already (a small same-host READ is DONE
            # when posted) costs one check, with a timeout that cannot be
            # refused (NaN and other types are, below, even then). The
            # builtin takes any handle ("ERR" for one that is none).
            st = _check_py(self._t, handle)
            if st != "PROC":
                return st
        if type(handle) is not int or handle <= 0 or handle >= 1 << 64:
            return "ERR"
        total = _timeout_ns(timeout, 0)
        end = None if total < 0 else time.monotonic_ns() + total
        while True:
            # Looked up each time: a child forked meanwhile (from a signal
            # handler) must get the stand-in's ForkedError, not Go.
            if _wait_py is not None:
                st = _wait_py(self._t, handle, _slice_ns(end))
            else:
                st = _lib_.ecx_wait(self._t, handle, _slice_ns(end))
            if st < 0:
                _lib.last_error()
                return "ERR"
            if st != 0 or (end is not None and time.monotonic_ns() >= end):
                return _STATES[st]

    def wait_notifs(self, timeout: float | None = None) -> dict[str, list[bytes]]:
        """Like get_new_notifs, but block (without the GIL) up to timeout
        seconds (None: no limit) for the first notification. A signal
        handler's exception ends the wait; notifications taken meanwhile
        come with the next call."""
        total = _timeout_ns(timeout, 1)
        end = None if total < 0 else time.monotonic_ns() + total
        while True:
            got = self._notifs(max(1, _slice_ns(end)))
            if got or self._t == 0 or (end is not None and time.monotonic_ns() >= end):
                return got

    def stats(self) -> dict[str, int]:
        """The transport's counters (reads posted/done/failed, live
        handles, peers, ...)."""
        self._live()
        p = ctypes.c_void_p()
        try:
            n = _lib_.ecx_stats(self._t, ctypes.byref(p))
        except BaseException:
            _free_handed(p)  # a signal handler raised as it returned
            raise
        if n < 0:
            raise from_code(n)
        return json.loads(_lib.take_bytes(p, n))

    @property
    def closed(self) -> bool:
        return self._t == 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.deregister()

    # -- internals ------------------------------------------------------

    def _peers_guard(self):
        """_peers_lock, except in a process forked from the one that made
        the transport, where another thread of the parent may have held
        it at the fork (the library's stand-in there raises ForkedError)."""
        if self._pid != os.getpid():
            return contextlib.nullcontext()
        return self._peers_lock

    def _live(self) -> None:
        if self._t == 0:
            raise ClosedError("ecxfer: transport deregistered")

    def _blob(self, which: int) -> bytes:
        self._live()
        p = ctypes.c_void_p()
        try:
            n = _lib_.ecx_blob(self._t, which, ctypes.byref(p))
        except BaseException:
            _free_handed(p)  # a signal handler raised as it returned
            raise
        if n < 0:
            raise from_code(n)
        return _lib.take_bytes(p, n)

    def _notifs(self, timeout_ns: int) -> dict[str, list[bytes]]:
        if self._t == 0:
            return {}
        if self._held is not None:
            with self._held_mu:
                held, self._held = self._held, None
            if held:
                return held
        p = ctypes.c_void_p()
        got = None
        try:
            n = _lib_.ecx_notifs(self._t, timeout_ns, ctypes.byref(p))
            if n > 0:
                got = decode_notifs(ctypes.string_at(p.value, n))
                return got
        except BaseException:
            # A signal handler raised as the call returned (wait_notifs
            # waits in slices so that handlers run), or while what it
            # handed over was copied or decoded: the notifications are at
            # p (the encoding delimits itself; the length may be lost with
            # the return value). Keep them for the next call.
            if p.value:
                if got is None:
                    got = _notifs_at(p.value)
                with self._held_mu:
                    self._held = _merge_notifs(self._held, got)
            raise
        finally:
            if p.value:
                _lib_.ecx_free(p)
        if n < 0:
            err = from_code(n)
            if isinstance(err, ClosedError):
                return {}
            raise err
        return {}


_U32 = struct.Struct("<I")


def _notifs_at(addr: int) -> dict[str, list[bytes]]:
    """Decode ecx_notifs' encoding at addr without its length (which the
    library returned, and an exception lost): the encoding delimits
    itself, and it is the library's own."""
    off = 0

    def take(n: int) -> bytes:
        nonlocal off
        b = ctypes.string_at(addr + off, n)
        off += n
        return b

    def u32() -> int:
        return _U32.unpack(take(4))[0]

    out: dict[str, list[bytes]] = {}
    for _ in range(u32()):
        msgs = out.setdefault(take(u32()).decode("ascii", "replace"), [])
        for _ in range(u32()):
            msgs.append(take(u32()))
    return out


def _merge_notifs(a: dict[str, list[bytes]] | None, b: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
    """a's notifications, then b's, per sender (b: the later ones)."""
    if not a:
        return b
    for name, msgs in b.items():
        a.setdefault(name, []).extend(msgs)
    return a


def decode_notifs(buf: bytes) -> dict[str, list[bytes]]:
    """Decode ecx_notifs' encoding (see cmd/libecxfer): little-endian
    uint32 counts and lengths. Raises ValueError on a malformed buffer."""
    out: dict[str, list[bytes]] = {}
    mv = memoryview(buf)
    off = 0

    def u32() -> int:
        nonlocal off
        if off + 4 > len(mv):
            raise ValueError("ecxfer: notification buffer truncated")
        (v,) = _U32.unpack_from(mv, off)
        off += 4
        return v

    def take(n: int) -> bytes:
        nonlocal off
        if off + n > len(mv):
            raise ValueError("ecxfer: notification buffer truncated")
        b = bytes(mv[off : off + n])
        off += n
        return b

    for _ in range(u32()):
        name = take(u32()).decode("ascii", "replace")
        msgs = out.setdefault(name, [])
        for _ in range(u32()):
            msgs.append(take(u32()))
    if off != len(mv):
        raise ValueError("ecxfer: trailing bytes after the notifications")
    return out
