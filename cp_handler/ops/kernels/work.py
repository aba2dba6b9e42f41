"""Attention work accounting: the (query, key) score pairs the forward blocks compute on this rank,
recorded once per plan (never per kernel call), and only inside :func:`count_attn_work`.

The benchmark's load-balance figure, as :func:`~cp_handler.ops.collectives.count_comms` counts bytes::

    with count_attn_work() as work:
        out, _ = ring_attn(...)
    work.pairs, work.blocks, work.explicit_blocks
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class WorkCounter:
    """Attention score pairs computed by forward blocks on this rank (causal blocks count the
    lower triangle with its diagonal), summed over batch and query heads."""

    pairs: int = 0
    blocks: int = 0
    explicit_blocks: int = 0
    """Forward blocks computed as explicit scores (:mod:`.masked`): no kernel could take them."""


counters: list[WorkCounter] = []
"""The open :func:`count_attn_work` blocks (callers on the hot path test the list itself: no call)."""


@contextlib.contextmanager
def count_attn_work():
    """Count the attention work of the forward blocks run inside the block (this rank only)."""
    counter = WorkCounter()
    counters.append(counter)
    try:
        yield counter
    finally:
        counters.remove(counter)


def block_pairs(sq: int, sk: int, causal: bool) -> int:
    """Score pairs of one block (per batch row and head): the lower triangle with its diagonal if causal."""
    return sq * (sq + 1) // 2 if causal else sq * sk


def block_tiles(sq: int, sk: int, causal: bool, tile: int) -> int:
    """``tile x tile`` score tiles a tiled kernel visits for one block (per batch row and head): every
    tile that holds a computed pair, partly masked ones included (causal blocks are square)."""
    rows, cols = -(-sq // tile), -(-sk // tile)
    return rows * (rows + 1) // 2 if causal else rows * cols


def record_attn_pairs(pairs: int, blocks: int) -> None:
    """Record ``pairs`` score pairs computed by ``blocks`` forward blocks."""
    for counter in counters:
        counter.pairs += pairs
        counter.blocks += blocks


def record_explicit_blocks(blocks: int) -> None:
    """Record ``blocks`` forward blocks run as explicit scores."""
    for counter in counters:
        counter.explicit_blocks += blocks


def record_attn_work(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """Record one forward block of ``q (B, H, Sq, D)`` against ``k (B, Hkv, Sk, D)``."""
    if counters:
        record_attn_pairs(q.shape[0] * q.shape[1] * block_pairs(q.shape[-2], k.shape[-2], causal), 1)
