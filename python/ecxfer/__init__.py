"""ecxfer: vLLM's EC data-plane transport (DataTransport) backed by
ecxfer's Go library, loaded through ctypes. Standard library only.

    from ecxfer import EcxferDataTransport
    t = EcxferDataTransport(agent_name="encoder-0", base_ptr=addr, num_blocks=4096,
                            block_size_bytes=5120, total_size_bytes=4096 * 5120)
"""

from .errors import (
    BadArgumentError,
    BadArgumentTypeError,
    BadDescriptorError,
    BadHandleError,
    BadMetadataError,
    BadNotifError,
    BusyError,
    CanceledError,
    ClosedError,
    ConfigError,
    EcxferError,
    EngineError,
    ForkedError,
    IndexMismatchError,
    IndexRangeError,
    NoBackendError,
    RemoteDisconnectError,
    UnknownPeerError,
    XferTimeoutError,
)
from .transport import EcxferDataTransport

__all__ = [
    "EcxferDataTransport",
    "EcxferError",
    "BadArgumentError",
    "BadArgumentTypeError",
    "BadDescriptorError",
    "BadHandleError",
    "BadMetadataError",
    "BadNotifError",
    "BusyError",
    "CanceledError",
    "ClosedError",
    "ConfigError",
    "EngineError",
    "ForkedError",
    "IndexMismatchError",
    "IndexRangeError",
    "NoBackendError",
    "RemoteDisconnectError",
    "UnknownPeerError",
    "XferTimeoutError",
]
