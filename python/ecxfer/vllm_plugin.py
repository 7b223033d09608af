"""vLLM plugin: makes vLLM's EC CPU connector build ecxfer's transport.

Declared as the entry point ``ecxfer`` in the group ``vllm.general_plugins``,
which vLLM loads in each of its processes at engine start. It does nothing
unless ECXFER_VLLM=1. Then it replaces ``NixlDataTransport`` in
``vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl`` (the name
``ECCPUScheduler._setup_nixl`` imports each time it builds a transport)
with ``ecxfer.EcxferDataTransport``, and, when NIXL is not installed, puts
stand-ins at ``vllm.distributed.nixl_utils.NixlWrapper`` and
``nixl_agent_config`` so that ``_setup_nixl``'s check for NIXL passes.
The stand-ins raise if anything actually tries to use NIXL through them.
"""

import importlib
import logging
import os

logger = logging.getLogger("ecxfer")

DATA_MODULE = "vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl"
NIXL_UTILS = "vllm.distributed.nixl_utils"


class NixlAbsent:
    """Stands in for NixlWrapper when NIXL is not installed: vLLM's EC
    connector only checks that the name is not None; ecxfer replaces the
    transport that would use it."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("NIXL is not installed; with ECXFER_VLLM=1, ecxfer provides the EC transport instead")


def nixl_absent_config(*args, **kwargs):
    """Stands in for nixl_agent_config when NIXL is not installed."""
    raise RuntimeError("NIXL is not installed; with ECXFER_VLLM=1, ecxfer provides the EC transport instead")


def enabled() -> bool:
    return os.environ.get("ECXFER_VLLM", "") == "1"


def register() -> None:
    """The entry point. Off unless ECXFER_VLLM=1 (another value, such as
    "true", is off too, and says so in a warning)."""
    if not enabled():
        v = os.environ.get("ECXFER_VLLM")
        if v not in (None, "", "0"):
            logger.warning("ecxfer: ECXFER_VLLM=%r leaves ecxfer off: only ECXFER_VLLM=1 turns it on", v)
        return
    from .transport import EcxferDataTransport

    try:
        data = importlib.import_module(DATA_MODULE)
    except ImportError:
        logger.warning("ecxfer: ECXFER_VLLM=1 but this vLLM has no %s; not patching", DATA_MODULE, exc_info=True)
        return
    data.NixlDataTransport = EcxferDataTransport
    try:
        utils = importlib.import_module(NIXL_UTILS)
    except ImportError:
        utils = None
    if utils is not None:
        if getattr(utils, "NixlWrapper", None) is None:
            utils.NixlWrapper = NixlAbsent
        if getattr(utils, "nixl_agent_config", None) is None:
            utils.nixl_agent_config = nixl_absent_config
    logger.info("ecxfer: vLLM's EC connector will use ecxfer's transport (%s.NixlDataTransport)", DATA_MODULE)
