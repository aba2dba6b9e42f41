"""Handler classes and the factory. Importing this module registers the built-in backends.

Layer 5 (handlers, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from .base import ContextParallelHandler
from .local import HierarchicalContextParallelHandler, LocalContextParallelHandler
from .magi import MagiAttnContextParallelHandler
from .registry import build_cp_handler, get_cp_handler_cls, register_cp_handler, registered_backends
from .token_layout import TokenLayout
from .transformer_engine import TEContextParallelHandler
from .zigzag import ZigzagLayout

register_cp_handler("local", LocalContextParallelHandler)
register_cp_handler("transformer_engine", TEContextParallelHandler)
register_cp_handler("magi", MagiAttnContextParallelHandler)  # MagiAttention plans its own communication: one entry

__all__ = [
    "ContextParallelHandler",
    "HierarchicalContextParallelHandler",
    "LocalContextParallelHandler",
    "MagiAttnContextParallelHandler",
    "TEContextParallelHandler",
    "TokenLayout",
    "ZigzagLayout",
    "build_cp_handler",
    "get_cp_handler_cls",
    "register_cp_handler",
    "registered_backends",
]
