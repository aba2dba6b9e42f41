"""cp_handler: context parallelism as a swappable strategy object.

Build a handler per batch, shard the batch with it, and pass it to a model that calls only its
methods (see DESIGN.md):

    h = get_cp_handler_cls("local", "p2p")(cp_group=group, cp_comm_type="p2p", qkv_format="bshd")
    logits = model(h.dispatch(tokens, seq_dim=1), cp_handler=h)
    full = h.combine(logits, seq_dim=1)

``__all__`` is what a user needs: the handler factory and registry, the handler base classes a backend
subclasses and the shipped handlers, the config, the process groups, the loss helpers a training loop calls,
and ``register`` / ``cp_model_inputs`` for Hugging Face models (:mod:`cp_handler.integrations.transformers`;
importing it does not import transformers, ``register`` checks it). Everything else is imported from its own
module (``cp_handler.training``, ``cp_handler.inference``, ``cp_handler.testing``, ...).
"""

from .handlers import (
    ContextParallelHandler,
    HierarchicalContextParallelHandler,
    LocalContextParallelHandler,
    MagiAttnContextParallelHandler,
    TEContextParallelHandler,
    build_cp_handler,
    get_cp_handler_cls,
    register_cp_handler,
    registered_backends,
)
from .integrations.transformers import cp_model_inputs, register
from .models.loss import LogitsAt, TokenLoss, masked_token_loss_sum, next_token_batch, token_loss_sum
from .runtime.config import CP_COMM_TYPES, QKV_FORMATS, AttentionShape, ContextParallelConfig, check_seq_len
from .runtime.groups import DataContextParallelGroups, build_dp_cp_groups, destroy_process_groups
from .runtime.moe import ExpertParallelHandler
from .runtime.parallel_layout import ParallelGroups, ParallelLayout
from .runtime.reductions import all_reduce_grads, global_token_count

__all__ = [
    # the handler factory and registry
    "build_cp_handler",
    "get_cp_handler_cls",
    "register_cp_handler",
    "registered_backends",
    # the handlers: the base classes a backend subclasses, and the shipped ones
    "ContextParallelHandler",
    "LocalContextParallelHandler",
    "HierarchicalContextParallelHandler",
    "TEContextParallelHandler",
    "MagiAttnContextParallelHandler",
    "ExpertParallelHandler",
    # the config
    "CP_COMM_TYPES",
    "QKV_FORMATS",
    "AttentionShape",
    "ContextParallelConfig",
    "check_seq_len",
    # the process groups
    "DataContextParallelGroups",
    "ParallelGroups",
    "ParallelLayout",
    "build_dp_cp_groups",
    "destroy_process_groups",
    # the loss helpers a training loop calls
    "next_token_batch",
    "masked_token_loss_sum",
    "token_loss_sum",
    "TokenLoss",
    "LogitsAt",
    "global_token_count",
    "all_reduce_grads",
    # Hugging Face models
    "register",
    "cp_model_inputs",
]
