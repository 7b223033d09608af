"""ecxfer's exceptions: one class per error code of the library, each also
an instance of the built-in exception a Python caller would expect (an
unknown agent is a KeyError, an index-count mismatch a ValueError, ...)."""

from . import _lib


class EcxferError(Exception):
    """Base of every ecxfer error. code is the library's error code."""

    code = _lib.OTHER

    def __str__(self) -> str:
        # KeyError would show the repr of its argument; keep messages plain.
        return str(self.args[0]) if self.args else self.__class__.__name__


class ConfigError(EcxferError, ValueError):
    code = _lib.CONFIG


class UnknownPeerError(EcxferError, KeyError):
    code = _lib.UNKNOWN_PEER


class IndexMismatchError(EcxferError, ValueError):
    code = _lib.INDEX_MISMATCH


class IndexRangeError(EcxferError, IndexError):
    code = _lib.INDEX_RANGE


class BadHandleError(EcxferError, ValueError):
    code = _lib.BAD_HANDLE


class BadMetadataError(EcxferError, ValueError):
    code = _lib.BAD_METADATA


class BadDescriptorError(EcxferError, ValueError):
    code = _lib.BAD_DESCRIPTOR


class BadNotifError(EcxferError, ValueError):
    code = _lib.BAD_NOTIF


class ClosedError(EcxferError, RuntimeError):
    code = _lib.CLOSED


class ForkedError(ClosedError):
    """This process was forked after it loaded the library: ecxfer cannot
    run here (Go's runtime does not survive a fork). Calls on transports
    inherited from the parent raise it (their closed stays False until
    deregister(), which only forgets them); new ones cannot be made."""


class BusyError(EcxferError, RuntimeError):
    code = _lib.BUSY


class RemoteDisconnectError(EcxferError, ConnectionError):
    code = _lib.REMOTE_DISCONNECT


class XferTimeoutError(EcxferError, TimeoutError):
    code = _lib.TIMEOUT


class CanceledError(EcxferError, RuntimeError):
    code = _lib.CANCELED


class EngineError(EcxferError, RuntimeError):
    code = _lib.ENGINE


class NoBackendError(EcxferError, RuntimeError):
    code = _lib.NO_BACKEND


class BadArgumentError(EcxferError, ValueError):
    code = _lib.BAD_ARG


class BadArgumentTypeError(BadArgumentError, TypeError):
    """An argument of the wrong type: block indices that are not ints, a
    notification that is neither bytes-like, str nor None, an agent name
    that is not hashable, a timeout that is not a number."""


_BY_CODE = {
    c.code: c
    for c in (
        ConfigError,
        UnknownPeerError,
        IndexMismatchError,
        IndexRangeError,
        BadHandleError,
        BadMetadataError,
        BadDescriptorError,
        BadNotifError,
        ClosedError,
        BusyError,
        RemoteDisconnectError,
        XferTimeoutError,
        CanceledError,
        EngineError,
        NoBackendError,
        BadArgumentError,
    )
}
# A transport id the library no longer knows is a closed transport.
_BY_CODE[_lib.UNKNOWN_TRANSPORT] = ClosedError


def from_code(code: int) -> EcxferError:
    """The exception for a failed call's code, with the calling thread's
    last error message from the library."""
    msg = _lib.last_error() or f"ecxfer: error code {code}"
    return _BY_CODE.get(code, EcxferError)(msg)
