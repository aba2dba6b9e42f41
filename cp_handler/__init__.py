"""cp_handler: context parallelism as a swappable strategy object.

Build a handler per batch, shard the batch with it, and pass it to a model that calls only its
methods (see DESIGN.md):

    h = get_cp_handler_cls("local", "p2p")(cp_group=group, qkv_format="bshd")
    logits = model(h.dispatch(tokens, seq_dim=1), cp_handler=h)
    full = h.combine(logits, seq_dim=1)
"""

from .config import CP_COMM_TYPES, QKV_FORMATS, AttentionShape, ContextParallelConfig, check_seq_len
from .groups import DataContextParallelGroups, build_dp_cp_groups, destroy_process_groups
from .handlers import (
    ContextParallelHandler,
    HierarchicalContextParallelHandler,
    LocalContextParallelHandler,
    MagiAttnContextParallelHandler,
    TEContextParallelHandler,
    ZigzagContextParallelHandler,
    build_cp_handler,
    get_cp_handler_cls,
    register_cp_handler,
    registered_backends,
)
from .moe import ExpertParallelHandler
from .parallel_layout import ParallelGroups, ParallelLayout

__all__ = [
    "CP_COMM_TYPES",
    "QKV_FORMATS",
    "AttentionShape",
    "ContextParallelConfig",
    "DataContextParallelGroups",
    "ExpertParallelHandler",
    "ParallelGroups",
    "ParallelLayout",
    "build_dp_cp_groups",
    "destroy_process_groups",
    "ContextParallelHandler",
    "HierarchicalContextParallelHandler",
    "LocalContextParallelHandler",
    "MagiAttnContextParallelHandler",
    "TEContextParallelHandler",
    "ZigzagContextParallelHandler",
    "build_cp_handler",
    "check_seq_len",
    "get_cp_handler_cls",
    "register_cp_handler",
    "registered_backends",
]
