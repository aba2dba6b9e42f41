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


def all_reduce_local_grads(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum every parameter's (local) gradient over ``group`` in one flat all-reduce; a missing gradient counts as
    zero."""
    params = list(model.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [_local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


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
