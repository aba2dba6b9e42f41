"""Handler classes and the factory. Importing this module registers the built-in backends."""

from .base import ContextParallelHandler
from .local import HierarchicalContextParallelHandler, LocalContextParallelHandler
from .magi import MagiAttnContextParallelHandler
from .registry import get_cp_handler_cls, register_cp_handler, registered_backends
from .transformer_engine import TEContextParallelHandler
from .zigzag import ZigzagContextParallelHandler

register_cp_handler("local", LocalContextParallelHandler, LocalContextParallelHandler.supported_comm_types)
register_cp_handler("local", HierarchicalContextParallelHandler, ["a2a+p2p"])
register_cp_handler("transformer_engine", TEContextParallelHandler)
register_cp_handler("magi", MagiAttnContextParallelHandler)

__all__ = [
    "ContextParallelHandler",
    "HierarchicalContextParallelHandler",
    "LocalContextParallelHandler",
    "MagiAttnContextParallelHandler",
    "TEContextParallelHandler",
    "ZigzagContextParallelHandler",
    "get_cp_handler_cls",
    "register_cp_handler",
    "registered_backends",
]
