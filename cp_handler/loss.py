"""Next-token training on a CP group: labels by a cross-rank roll, a token-weighted loss.

The loss of a global batch is ``sum(token losses) / number of loss tokens``; each rank computes
the sum over its own tokens, and the count is reduced over every rank that holds part of the
batch (dp x cp), so every token weighs the same however the batch is split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .handlers.base import ContextParallelHandler


def next_token_batch(
    handler: ContextParallelHandler, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shard global ``tokens (B, S)`` int64 and build next-token targets.

    Returns:
        ``input_ids (B, S_local)``, ``labels (B, S_local)`` (the global roll by -1) and
        ``loss_mask (B, S_local)`` float32, zero where the label wrapped around (last position).
    """
    input_ids = handler.dispatch(tokens, seq_dim=1)
    labels, _ = handler.roll_tensor(input_ids, shifts=-1, dims=1)
    loss_mask, _ = handler.roll_tensor(torch.ones_like(input_ids, dtype=torch.float32), shifts=-1, dims=1)
    return input_ids, labels, loss_mask


def masked_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy (float32) over the tokens where ``loss_mask`` is 1."""
    losses = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    return (losses * loss_mask.flatten()).sum()


def global_token_count(loss_mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Number of loss tokens summed over ``group`` (``None``: this process only)."""
    count = loss_mask.sum().to(torch.float64)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def all_reduce_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of ``params`` over ``group`` (default: all ranks) in one flat all-reduce;
    a missing gradient counts as zero."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = parameters_to_vector([p.grad for p in params])
    dist.all_reduce(flat, group=group)
    vector_to_parameters(flat, [p.grad for p in params])
