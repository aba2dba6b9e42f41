"""Run a plan of attention blocks on local tensors: the compute shared by every CP algorithm.

A block is ``(q_rows, kv_rows, causal)``: slices of the sequence dim of q and of k/v, and whether
the (square) block is causal. An algorithm (ring step, all-gather, a2a) decides the plan; these
functions run it, merging forward results by log-sum-exp and accumulating gradients.
All tensors ``(B, H, S, D)``; accumulators in :func:`~.merge.acc_dtype`.
"""

from __future__ import annotations

import torch

from .kernels import block_attn_backward, block_attn_forward
from .merge import acc_dtype, merge_attn_out_

Block = tuple[slice, slice, bool]


def rows(t: torch.Tensor, index: slice) -> torch.Tensor:
    """Sequence rows of a ``(B, H, S, ...)`` tensor (a view)."""
    return t[:, :, index]


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(out, lse)``: zeros and -inf, which the first merge replaces exactly."""
    dtype = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    return out, lse


def blocks_forward_(out, lse, q, k, v, blocks: list[Block], scale: float, fresh: bool = False) -> None:
    """Merge the attention of every block into ``out``/``lse`` (in place).

    ``fresh``: the accumulators are still empty, so the first block of each query range is copied
    in instead of merged (saves the merge's passes; exact, as merging into an empty accumulator is
    a copy). Blocks' query ranges must then be equal or disjoint, as every plan's are.
    """
    written: set[tuple[int, int]] = set()
    for q_rows, kv_rows, causal in blocks:
        block_out, block_lse = block_attn_forward(
            rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows), causal=causal, scale=scale
        )
        key = (q_rows.start, q_rows.stop)
        if fresh and key not in written:
            rows(out, q_rows).copy_(block_out)
            rows(lse, q_rows).copy_(block_lse)
        else:
            merge_attn_out_(rows(out, q_rows), rows(lse, q_rows), block_out, block_lse)
        written.add(key)


def blocks_backward_(dq, dk, dv, dout, q, k, v, out, lse, blocks: list[Block], scale: float) -> None:
    """Add every block's gradients to ``dq``/``dk``/``dv`` (in place), given the merged out/lse."""
    for q_rows, kv_rows, causal in blocks:
        dq_b, dk_b, dv_b = block_attn_backward(
            rows(dout, q_rows), rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows),
            rows(out, q_rows), rows(lse, q_rows), causal=causal, scale=scale,
        )
        rows(dq, q_rows).add_(dq_b)
        rows(dk, kv_rows).add_(dk_b)
        rows(dv, kv_rows).add_(dv_b)
