"""All-gather along the sequence dimension, differentiable.

Forward: every rank's shard, concatenated rank by rank along ``seq_dim``.
Backward: this rank's slice of the gradient. This is the adjoint when the gathered tensor feeds the
same computation on every rank of the group (Megatron-LM's ``gather_from_sequence_parallel_region``
with ``tensor_parallel_output_grad=False``); parameter gradients are then summed over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_single


def all_gather_seq_raw(x: torch.Tensor, seq_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Non-differentiable gather of ``x`` along ``seq_dim`` over ``group`` (rank-major order)."""
    size = dist.get_world_size(group)
    front = x.movedim(seq_dim, 0).contiguous()
    out = torch.empty((size * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, front, group=group)
    return out.movedim(0, seq_dim)


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seq_dim, group):
        ctx.seq_dim, ctx.rank, ctx.local_len = seq_dim, dist.get_rank(group), x.shape[seq_dim]
        return all_gather_seq_raw(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.seq_dim, ctx.rank * ctx.local_len, ctx.local_len), None, None


def all_gather_seq(x: torch.Tensor, seq_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Gather ``x`` along ``seq_dim`` over ``group``; backward keeps this rank's slice (see module doc)."""
    return _AllGatherSeq.apply(x, seq_dim, group)
