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


def __getattr__(name):
    # PEP 562: the transport module, and with it vLLM's DataTransport
    # (its base class when vLLM is there), is imported on first use, not
    # with the package: vLLM imports the package to load the plugin
    # (ecxfer.vllm_plugin) in every process, and with ECXFER_VLLM unset
    # the plugin must leave vLLM's modules alone.
    if name == "EcxferDataTransport":
        from .transport import EcxferDataTransport

        return EcxferDataTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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


def __dir__():
    return sorted(set(globals()) | set(__all__))
