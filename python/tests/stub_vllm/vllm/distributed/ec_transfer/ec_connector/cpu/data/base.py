"""Stand-in for vLLM's abstract EC data-plane transport."""

from abc import ABC, abstractmethod


class DataTransport(ABC):
    @abstractmethod
    def get_agent_metadata(self): ...

    @abstractmethod
    def get_mem_descriptor(self): ...

    @abstractmethod
    def add_remote_peer(self, metadata, mem_descriptor): ...

    @abstractmethod
    def remove_remote_peer(self, agent_name): ...

    @abstractmethod
    def post_read(self, local_indices, agent_name, remote_indices, notif_msg): ...

    @abstractmethod
    def get_new_notifs(self): ...

    @abstractmethod
    def check_xfer_state(self, handle): ...

    @abstractmethod
    def release_xfer_handle(self, handle): ...

    @abstractmethod
    def deregister(self): ...
