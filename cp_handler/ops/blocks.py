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

CPU_CAUSAL_TILE = 256
"""Row tile of causal blocks on CPU. The CPU flash kernel skips masked work in key blocks of 512,
so a causal diagonal computes ~256 masked scores per query row whatever its length; tiled into
256-row pieces (a full block left of each diagonal tile, a causal 256 x 256 tile on it) the waste
halves. Measured (1 thread, H=8, D=64, fwd+bwd): causal 2048 -10%, causal 4096 -3%. CUDA kernels
skip masked work finely and get the blocks untiled."""


def tile_causal(blocks: list[Block], tile: int = CPU_CAUSAL_TILE) -> list[Block]:
    """Split every causal (square) block longer than ``tile`` into row tiles: per tile, the full
    block against the keys before it, then the causal tile on the diagonal. Same scores, same result."""
    tiled: list[Block] = []
    for q_rows, kv_rows, causal in blocks:
        n = q_rows.stop - q_rows.start
        if not causal or n <= tile:
            tiled.append((q_rows, kv_rows, causal))
            continue
        for s in range(0, n, tile):
            rows_t = slice(q_rows.start + s, q_rows.start + min(s + tile, n))
            if s:
                tiled.append((rows_t, slice(kv_rows.start, kv_rows.start + s), False))
            tiled.append((rows_t, slice(kv_rows.start + s, kv_rows.start + min(s + tile, n)), True))
    return tiled


def _plan(blocks: list[Block], q: torch.Tensor) -> list[Block]:
    return tile_causal(blocks) if q.device.type == "cpu" else blocks


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

    ``fresh``: the accumulators are still empty (zeros / -inf), so a block starting at or past the
    furthest row written so far is copied in instead of merged (saves the merge's passes; exact, as
    merging into an empty accumulator is a copy). Plans list query rows in non-decreasing order; a
    block out of order is merged, which is always correct.
    """
    frontier = 0 if fresh else None
    for q_rows, kv_rows, causal in _plan(blocks, q):
        block_out, block_lse = block_attn_forward(
            rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows), causal=causal, scale=scale
        )
        if frontier is not None and q_rows.start >= frontier:
            rows(out, q_rows).copy_(block_out)
            rows(lse, q_rows).copy_(block_lse)
        else:
            merge_attn_out_(rows(out, q_rows), rows(lse, q_rows), block_out, block_lse)
        if frontier is not None:
            frontier = max(frontier, q_rows.stop)


def blocks_backward_(dq, dk, dv, dout, q, k, v, out, lse, blocks: list[Block], scale: float) -> None:
    """Add every block's gradients to ``dq``/``dk``/``dv`` (in place), given the merged out/lse."""
    for q_rows, kv_rows, causal in _plan(blocks, q):
        dq_b, dk_b, dv_b = block_attn_backward(
            rows(dout, q_rows), rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows),
            rows(out, q_rows), rows(lse, q_rows), causal=causal, scale=scale,
        )
        rows(dq, q_rows).add_(dq_b)
        rows(dk, kv_rows).add_(dk_b)
        rows(dv, kv_rows).add_(dv_b)
