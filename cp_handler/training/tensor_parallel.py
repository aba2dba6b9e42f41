"""The training step's share of tensor parallelism (``cp-train --tp-size``): the model split by
:func:`~cp_handler.models.tensor_parallel.apply_tensor_parallel`, its gradients reduced over the dp x cp ranks of
each TP position, the global gradient norm and clipping over split and replicated weights.

A split weight (a DTensor sharded over the TP group) holds this TP rank's rows or columns: its gradient is this
rank's part of the whole gradient; a replicated weight (embedding, norms, output head) gets the same whole gradient
on every TP rank (the row-wise all-reduce makes the activations, and so their gradients, equal). Every rank of one
TP position sums its gradients over the dp x cp ranks of that position (one flat all-reduce of the local tensors,
as DDP does), the loss being normalised by the global token count over the same ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sum_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` over ``group`` in place, in one flat all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce_local_grads(model: torch.nn.Module, group: dist.ProcessGroup, tp_group=None,
                           tp_summed: list[str] = ()) -> None:
    """Sum every parameter's (local) gradient over ``group`` in one flat all-reduce; a missing gradient counts as
    zero. The parameters named in ``tp_summed`` (a replicated weight applied to each TP rank's own heads:
    transformers' ``replicated_with_grad_allreduce``) are summed over ``tp_group`` first."""
    named = dict(model.named_parameters())
    for p in named.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if tp_summed:
        _sum_flat([named[name].grad for name in tp_summed], tp_group)
    _sum_flat([_local(p.grad) for p in named.values()], group)


def grad_norm(model: torch.nn.Module, tp_group: dist.ProcessGroup) -> float:
    """The global gradient norm: the split weights' squared local norms summed over ``tp_group``, the replicated
    weights' counted once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    split = sum((_local(g).double().pow(2).sum() for g in grads if hasattr(g, "to_local")),
                torch.zeros((), dtype=torch.float64))
    dist.all_reduce(split, group=tp_group)
    whole = sum((g.double().pow(2).sum() for g in grads if not hasattr(g, "to_local")),
                torch.zeros((), dtype=torch.float64))
    return float((split.to(whole.device) + whole).sqrt())


def clip_grads(model: torch.nn.Module, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by ``max_norm / total_norm`` when that is below 1 (``torch.nn.utils.clip_grad_norm_``'s
    rule, with its ``1e-6``)."""
    scale = max_norm / (total_norm + 1e-6)
    if scale < 1:
        for p in model.parameters():
            if p.grad is not None:
                _local(p.grad).mul_(scale)
