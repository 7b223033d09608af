"""Stand-in: vLLM sets these to None when NIXL is not installed."""

NixlWrapper = None
nixl_agent_config = None
