"""Stand-in for the part of vLLM's EC CPU scheduler that builds the
transport: it imports the class inside the function, each time, checks
that NIXL is present, and calls the class with keywords only."""


def setup_transport(agent_name, base_ptr, num_blocks, block_size_bytes, total_size_bytes):
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl import NixlDataTransport
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    if NixlWrapper is None or nixl_agent_config is None:
        raise RuntimeError("NIXL is not available")
    return NixlDataTransport(
        agent_name=agent_name,
        base_ptr=base_ptr,
        num_blocks=num_blocks,
        block_size_bytes=block_size_bytes,
        total_size_bytes=total_size_bytes,
    )


def load_general_plugins():
    """What vLLM does at engine start: call every vllm.general_plugins
    entry point."""
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group="vllm.general_plugins"):
        ep.load()()
        names.append(ep.name)
    return names
