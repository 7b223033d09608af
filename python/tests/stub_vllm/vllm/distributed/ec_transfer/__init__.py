"""A stand-in for vLLM laid out like its EC CPU connector, for ecxfer's plugin tests."""
