"""Handler classes and the factory. Importing this module registers the built-in backends."""

from .base import ContextParallelHandler
from .local import HierarchicalContextParallelHandler, LocalContextParallelHandler
from .registry import get_cp_handler_cls, register_cp_handler, registered_backends
from .zigzag import ZigzagContextParallelHandler

register_cp_handler("local", LocalContextParallelHandler, LocalContextParallelHandler.supported_comm_types)
register_cp_handler("local", HierarchicalContextParallelHandler, ["a2a+p2p"])

__all__ = [
    "ContextParallelHandler",
    "HierarchicalContextParallelHandler",
    "LocalContextParallelHandler",
    "ZigzagContextParallelHandler",
    "get_cp_handler_cls",
    "register_cp_handler",
    "registered_backends",
]
