"""Stand-in for vLLM's NIXL transport module: it imports the NIXL names at
import time, as vLLM's does."""

from vllm.distributed.ec_transfer.ec_connector.cpu.data.base import DataTransport
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config


class NixlDataTransport(DataTransport):
    STOCK = True

    def __init__(self, agent_name, base_ptr, num_blocks, block_size_bytes, total_size_bytes, num_threads=1):
        if NixlWrapper is None or nixl_agent_config is None:
            raise RuntimeError("stock transport needs NIXL")
        raise RuntimeError("the stand-in cannot build a NIXL agent")
