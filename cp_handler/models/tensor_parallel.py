"""Tensor parallelism (TP) of the reference GPT, composed with context parallelism: PyTorch's own (DTensor's
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``), as Megatron-LM and torchtitan split a
transformer layer.

The plan (:func:`gpt_tp_plan`), per layer: the query, key and value projections column-wise (each TP rank computes
``H / tp`` query heads and ``Hkv / tp`` key-value heads: whole heads, the GQA groups kept together), the output
projection row-wise (its partial sums all-reduced over the TP group); the MLP's gate and up projections
column-wise, its down projection row-wise. One all-reduce per attention block and one per MLP in the forward, and
the same two in the backward (the column-wise inputs' gradients), as Megatron-LM's TP without sequence parallelism.
The embedding, the norms and the output head stay replicated (every TP rank holds them whole and computes the
same values; their gradients are the same on every TP rank): the choice of a small vocabulary, said here; a
vocabulary-parallel head would add a parallel cross-entropy.

Context parallelism sees the TP rank's heads: the handler is built with the local attention shape
(:func:`local_attention_shape`) and the model's attention reshapes by the local head count, so every CP pattern
(a2a's head split included) runs on ``H / tp`` heads. Refused by name (:func:`check_tensor_parallel`): head counts or
the MLP width that ``tp`` does not divide (Megatron-LM replicates key-value heads when ``Hkv < tp``: not built here),
MoE layers and linear-attention layers (their tensor-parallel plans are not built).
"""

from __future__ import annotations

from torch import nn

from ..runtime.config import AttentionShape
from .gpt import GPTConfig


def check_tensor_parallel(config: GPTConfig, tp: int) -> None:
    """Whether the reference GPT of ``config`` splits over ``tp`` tensor-parallel ranks.

    Raises:
        ValueError: ``tp`` below 1; ``num_attention_heads``, ``num_query_groups`` or ``ffn_hidden_size`` not divisible
            by ``tp``; MoE (``num_moe_experts``) or linear-attention layers with ``tp > 1`` (each names the field).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
    if tp == 1:
        return
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = getattr(config, field)
        if value % tp:
            extra = (" (Megatron-LM would replicate the key-value heads when num_query_groups < tp: not built here)"
                     if field == "num_query_groups" else "")
            raise ValueError(f"tensor_parallel_size={tp}: {field}={value} is not divisible by it; each TP rank "
                             f"holds an equal share{extra}")
    if config.num_moe_experts:
        raise ValueError(f"tensor_parallel_size={tp} with num_moe_experts={config.num_moe_experts}: the experts' "
                         "tensor-parallel plan is not built (use expert parallelism, or tp 1)")
    if config.layer_types is not None and "linear_attention" in config.layer_types:
        raise ValueError(f"tensor_parallel_size={tp} with linear_attention layers: their tensor-parallel plan is "
                         "not built (tp 1)")


def local_attention_shape(shape: AttentionShape, tp: int) -> AttentionShape:
    """The attention shape one TP rank's attention runs: ``H / tp`` query heads, ``Hkv / tp`` key-value heads."""
    return AttentionShape(shape.num_heads // tp, shape.num_kv_heads // tp, shape.head_dim, shape.v_head_dim)


def gpt_tp_plan(model: nn.Module) -> dict:
    """``{module path: ParallelStyle}`` for ``parallelize_module`` (module doc)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.layers)):
        plan.update({f"layers.{i}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan.update({f"layers.{i}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")})
        plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict | None = None) -> nn.Module:
    """Split ``model`` (a :class:`~.gpt.GPTModel`, built the same on every rank) over the 1-D ``tp_mesh`` with
    ``plan`` (default :func:`gpt_tp_plan`); returns ``model``, its split weights now DTensors (``Shard`` on the TP
    mesh), the rest unchanged.

    Raises:
        ValueError: :func:`check_tensor_parallel`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    check_tensor_parallel(model.config, tp_mesh.size())
    return parallelize_module(model, tp_mesh, plan if plan is not None else gpt_tp_plan(model))
