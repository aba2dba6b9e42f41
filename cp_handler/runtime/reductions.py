"""The sums over process groups a training loop makes around the loss (:mod:`cp_handler.models.loss`): the global
count of loss tokens, and gradients summed over ranks in one flat all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_token_count(loss_mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Number of loss tokens summed over ``group`` (``None``: this process only)."""
    count = loss_mask.sum().to(torch.float64)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum ``tensors`` over ``group`` (default: all ranks) in place, in one flat all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class _SumGradOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` unchanged in the forward; its gradient summed over ``group`` in the backward (Megatron-LM's
    ``copy_to_tensor_model_parallel_region``): the output of a replicated weight each TP rank applies to its own
    heads, whose gradient each rank holds only its heads' part of."""
    return _SumGradOverGroup.apply(x, group)


def all_reduce_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of ``params`` over ``group`` (default: all ranks) in one flat all-reduce;
    a missing gradient counts as zero."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_flat([p.grad for p in params], group)
