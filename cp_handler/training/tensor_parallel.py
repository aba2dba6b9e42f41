"""Tensor parallelism (TP) in a training run (``cp-train --tp-size``), composed with context parallelism: the
reference GPT's plan, and what the training step adds for any split model.

The reference GPT is split with PyTorch's own (DTensor's ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``), as Megatron-LM and torchtitan split a transformer layer.

The plan (:func:`gpt_tp_plan`), per layer: the query, key and value projections column-wise (each TP rank computes
``H / tp`` query heads and ``Hkv / tp`` key-value heads: whole heads, the GQA groups kept together), the output
projection row-wise (its partial sums all-reduced over the TP group); the MLP's gate and up projections
column-wise, its down projection row-wise. One all-reduce per attention block and one per MLP in the forward, and
the same two in the backward (the column-wise inputs' gradients), as Megatron-LM's TP without sequence parallelism.
The embedding, the norms and the output head stay replicated (every TP rank holds them whole and computes the
same values; their gradients are the same on every TP rank): the choice of a small vocabulary, said here; a
vocabulary-parallel head would add a parallel cross-entropy.

With fewer key-value heads than TP ranks (``Hkv < tp``, ``tp`` a multiple of ``Hkv``) the key and value projections
are replicated as Megatron-LM does (:func:`~cp_handler.runtime.reductions.replicated_kv_heads`): every TP rank holds
them whole and keeps the one key-value head its query heads use (rank ``r``: head ``r // (tp / Hkv)``); their
gradients, each rank's from its own query heads, are summed over the TP group by the training step
(:func:`apply_tensor_parallel` names them).

Context parallelism sees the TP rank's heads: the handler is built with the local attention shape
(:func:`local_attention_shape`) and the model's attention reshapes by the local head count, so every CP pattern
(a2a's head split included) runs on ``H / tp`` heads. Refused by name (:func:`check_tensor_parallel`): query heads or
the MLP width that ``tp`` does not divide, key-value heads that neither divide nor are divided by it, and
linear-attention layers (their tensor-parallel plan is not built).

MoE layers are not split by TP (Megatron-LM's expert tensor-parallel size 1): the row-wise all-reduce before them
gives every TP rank the same tokens, so each TP rank runs its router and its experts whole on them, the experts
sharded over the expert-parallel group of its TP position (the layout's ``ep`` groups: ranks of one TP rank). The
experts' gradients are then the same on every TP rank and are summed over the expert-data-parallel ranks (``edp``)
only; the gradient norm counts each expert once (summed over ``ep``, :func:`grad_norm`).

Sequence parallelism (``gpt_tp_plan(..., sequence_parallel=True)``, ``cp-train --sequence-parallel``; Megatron-LM's
``--sequence-parallel``, with PyTorch's ``SequenceParallel``, ``PrepareModuleInput`` / ``PrepareModuleOutput``): the
norms and the residual stream run on each TP rank's share of the CP rank's tokens (DTensors sharded on the sequence
dimension; uneven shares allowed), gathered over the TP group before the attention and the MLP and reduce-scattered
after them (the row-wise projections' output) instead of all-reduced: the same bytes moved, and the activations of
the norms, the residual stream and the embedding's output divided by tp. The attention and CP are unchanged: the
gathered tokens are the CP rank's. The last layer's output is gathered over the TP group, so the head (the final
norm, the output projection and a chunked loss's token chunks) runs on the CP rank's tokens whole, its loss the same
on every TP rank. The layers' norms' gradients are partial sums over the TP group, made whole by the training step.
Collectives per layer: 2 all-gathers and 2 reduce-scatters in the forward and the same in the backward (each one's
backward is the other), plus the last layer's gather (forward) and the embedding output's gradient gathered
(backward): Megatron-LM's count. The reference GPT's
dense layers only (MoE layers and Hugging Face models: not built, refused by name).

The training step (:mod:`.trainer`): a split weight (a DTensor sharded over the TP group) holds this TP rank's rows or
columns: its gradient is this rank's part of the whole gradient; a replicated weight (embedding, norms, output head)
gets the same whole gradient on every TP rank (the row-wise all-reduce makes the activations, and so their gradients,
equal). Every rank of one TP position sums its gradients over the dp x cp ranks of that position (one flat all-reduce of
the local tensors, as DDP does), the loss being normalised by the global token count over the same ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.gpt import GPTConfig
from ..models.moe import MoEFeedForward
from ..runtime.config import AttentionShape
from ..runtime.reductions import all_reduce_flat, ordered_rowwise_parallel, replicated_kv_heads


def check_tensor_parallel(config: GPTConfig, tp: int) -> None:
    """Whether the reference GPT of ``config`` splits over ``tp`` tensor-parallel ranks.

    Raises:
        ValueError: ``tp`` below 1; ``num_attention_heads``, ``num_query_groups`` or ``ffn_hidden_size`` not divisible
            by ``tp``; linear-attention layers with ``tp > 1`` (each names the field). MoE layers are allowed: they
            stay whole on every TP rank (module doc).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
    if tp == 1:
        return
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = getattr(config, field)
        replicated = field == "num_query_groups" and value < tp and tp % value == 0  # ReplicatedKVHeads
        if value % tp and not replicated:
            extra = (" nor divides it (key-value heads are replicated when tp is a multiple of their count)"
                     if field == "num_query_groups" else "")
            raise ValueError(f"tensor_parallel_size={tp}: {field}={value} is not divisible by it{extra}; each TP "
                             "rank holds an equal share")
    if config.layer_types is not None and "linear_attention" in config.layer_types:
        raise ValueError(f"tensor_parallel_size={tp} with linear_attention layers: their tensor-parallel plan is "
                         "not built (tp 1)")


TP_REFUSED = {
    "dynamic": "dynamic CP regroups every rank per step",
    "compile": "compiled layers with DTensor weights are not tested",
    "offload_activations": "offloaded activations with DTensor weights are not tested",
    "mlp_chunk_tokens": "tiled MLPs with split weights are not tested",
    "export_hf": "save_pretrained of split weights is not built",
}
"""What a training run with ``tensor_parallel_size`` above 1 does not combine with yet: ``{TrainConfig field: why}``
(:func:`check_train_config`; ``cp-train`` says the flags)."""


def check_train_config(config) -> None:
    """A :class:`~.config.TrainConfig` with ``tensor_parallel_size`` above 1 sets none of :data:`TP_REFUSED`.

    Raises:
        ValueError: naming the field and why.
    """
    tp = config.tensor_parallel_size
    for field, why in TP_REFUSED.items():
        if tp > 1 and getattr(config, field):
            raise ValueError(f"TrainConfig.tensor_parallel_size={tp} with {field}={getattr(config, field)!r}: not "
                             f"implemented ({why})")


def local_attention_shape(shape: AttentionShape, tp: int) -> AttentionShape:
    """The attention shape one TP rank's attention runs: ``H / tp`` query heads, ``Hkv / tp`` key-value heads (one,
    replicated, when ``Hkv < tp``)."""
    return AttentionShape(shape.num_heads // tp, max(1, shape.num_kv_heads // tp), shape.head_dim, shape.v_head_dim)


def gpt_tp_plan(model: nn.Module, tp: int | None = None, sequence_parallel: bool = False,
                ordered: bool = False) -> dict:
    """``{module path: ParallelStyle}`` for ``parallelize_module`` (module doc); ``tp`` above the key-value head
    count replicates the key and value projections (:func:`~cp_handler.runtime.reductions.replicated_kv_heads`).
    ``sequence_parallel``: Megatron-LM's sequence parallelism (module doc, "Sequence parallelism"). ``ordered``: the
    row-wise projections add their partial sums in TP-rank order
    (:func:`~cp_handler.runtime.reductions.ordered_rowwise_parallel`, with sequence parallelism an ordered
    reduce-scatter; the deterministic mode).

    Raises:
        ValueError: ``sequence_parallel`` with MoE layers (not built).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    config = model.config
    replicate = tp is not None and config.num_query_groups < tp
    whole = Replicate()
    # each block's input a replicated DTensor: the column-wise projections' input gradients (q, k, v; gate, up) stay
    # partial sums and add up before one all-reduce per block (Megatron-LM's fused QKV / gate-up count), instead of one
    # all-reduce per projection; with sequence parallelism one reduce-scatter (module doc)
    dense = [i for i in range(len(model.layers)) if not isinstance(model.layers[i].mlp, MoEFeedForward)]
    plan = {}
    for i in range(len(model.layers)):
        plan[f"layers.{i}.self_attn"] = PrepareModuleInput(input_layouts=(whole, None, None),
                                                           desired_input_layouts=(whole, None, None))
    for i in dense:
        plan[f"layers.{i}.mlp"] = PrepareModuleInput(input_layouts=(whole,), desired_input_layouts=(whole,))
    if sequence_parallel:
        if config.num_moe_experts:
            raise ValueError(f"sequence parallelism with num_moe_experts={config.num_moe_experts}: not built (the "
                             "experts run whole on every TP rank's tokens); use tensor parallelism without it")
        seq = Shard(1)
        plan["embed_tokens"] = PrepareModuleOutput(output_layouts=whole, desired_output_layouts=seq,
                                                   use_local_output=False)
        # the last layer's output gathered over the TP group: the head (final norm, output projection, a chunked
        # loss's token chunks) runs on the CP rank's tokens whole, as without sequence parallelism
        plan[f"layers.{len(model.layers) - 1}"] = PrepareModuleOutput(output_layouts=seq, desired_output_layouts=whole,
                                                                       use_local_output=True)
        for i in range(len(model.layers)):
            plan[f"layers.{i}.input_layernorm"] = plan[f"layers.{i}.post_attention_layernorm"] = SequenceParallel()
            plan[f"layers.{i}.self_attn"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                                               desired_input_layouts=(whole, None, None))
            plan[f"layers.{i}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,))
    for i in range(len(model.layers)):
        plan[f"layers.{i}.self_attn.q_proj"] = ColwiseParallel()
        for name, width in (("k_proj", config.kv_channels), ("v_proj", config.v_head_dim)):
            plan[f"layers.{i}.self_attn.{name}"] = \
                replicated_kv_heads()(config.num_query_groups, width) if replicate else ColwiseParallel()
        out = dict(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else {}
        rowwise = ordered_rowwise_parallel() if ordered else RowwiseParallel
        plan[f"layers.{i}.self_attn.o_proj"] = rowwise(**out)
        if isinstance(model.layers[i].mlp, MoEFeedForward):
            continue  # the router and the experts stay whole on every TP rank (module doc)
        plan.update({f"layers.{i}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")})
        plan[f"layers.{i}.mlp.down_proj"] = rowwise(**out)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict | None = None) -> list[str]:
    """Split ``model`` (a :class:`~.gpt.GPTModel`, built the same on every rank) over the 1-D ``tp_mesh`` with
    ``plan`` (default :func:`gpt_tp_plan`): its split weights become DTensors (``Shard`` on the TP mesh), the rest
    stays. Returns the names of the parameters whose gradients the TP group must sum (the replicated key-value
    projections, ``Hkv < tp``).

    Raises:
        ValueError: :func:`check_tensor_parallel`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tensor_parallel(model.config, tp)
    plan = plan if plan is not None else gpt_tp_plan(model, tp)
    parallelize_module(model, tp_mesh, plan)
    replicated = replicated_kv_heads()
    return [f"{path}.weight" for path, style in plan.items() if isinstance(style, replicated)]

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_local_grads(model: torch.nn.Module, group: dist.ProcessGroup | None, tp_group=None,
                           tp_summed: list[str] = (), experts: set[int] = frozenset(), expert_group=None) -> None:
    """Sum every parameter's (local) gradient over ``group`` in one flat all-reduce (``None``: FSDP2 reduced them
    already); a missing gradient counts as zero. The parameters named in ``tp_summed`` (a replicated weight applied
    to each TP rank's own heads: the replicated key-value projections, transformers' ``replicated_with_grad_allreduce``)
    are summed over ``tp_group`` first, as is a gradient DTensor holds as a partial sum (sequence parallelism's norms).
    The parameters whose ``id`` is in ``experts`` (this rank's experts) are summed over ``expert_group`` (the ranks
    holding the same experts, ``edp``) instead of ``group``."""
    named = dict(model.named_parameters())
    for p in named.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif any(placement.is_partial() for placement in getattr(p.grad, "placements", ())):
            # a replicated weight applied to each TP rank's share of the tokens (sequence parallelism's norms):
            # its gradient is a partial sum over the TP group, made whole here
            from torch.distributed.tensor import Replicate

            p.grad = p.grad.redistribute(placements=[Replicate()] * len(p.grad.placements))
    if tp_summed:
        all_reduce_flat([_local(named[name].grad) for name in tp_summed], tp_group)
    if group is not None:
        all_reduce_flat([_local(p.grad) for p in named.values() if id(p) not in experts], group)
    if experts:
        all_reduce_flat([_local(p.grad) for p in named.values() if id(p) in experts], expert_group)


def grad_norm(model: torch.nn.Module, experts: set[int] = frozenset(), ep_group=None) -> float:
    """The global gradient norm of a model whose weights are split (DTensors, over the TP mesh and, with FSDP2, the
    dp x cp one) or whole: each gradient's norm over its own mesh (one small collective per DTensor), every weight
    counted once. The parameters whose ``id`` is in ``experts`` (this rank's expert shard) are counted over
    ``ep_group`` (each expert once)."""
    total, sharded = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            norm = torch.linalg.vector_norm(p.grad.double())
            square = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).cpu() ** 2
            if id(p) in experts:
                sharded += square
            else:
                total += square
    if experts:
        dist.all_reduce(sharded, group=ep_group)
    return float((total + sharded).sqrt())


def clip_grads(model: torch.nn.Module, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by ``max_norm / total_norm`` when that is below 1 (``torch.nn.utils.clip_grad_norm_``'s
    rule, with its ``1e-6``)."""
    scale = max_norm / (total_norm + 1e-6)
    if scale < 1:
        for p in model.parameters():
            if p.grad is not None:
                _local(p.grad).mul_(scale)
