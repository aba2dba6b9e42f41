"""Where tokens live: the zigzag (DualChunkSwap) split of a sequence over a CP group.

A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks; rank ``r`` keeps chunks ``r`` and
``2cp-1-r``, in that order. Under a causal mask every rank then does the same attention work
(Megatron-LM ``get_batch_on_this_cp_rank``; Transformer Engine calls it DualChunkSwap).
Pure index arithmetic: nothing here communicates.
"""

from __future__ import annotations

import torch


def zigzag_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp_size``) held by ``cp_rank``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_chunk_owner(chunk: int, cp_size: int) -> tuple[int, int]:
    """``(rank, local half)`` that holds global chunk ``chunk``."""
    if chunk < cp_size:
        return chunk, 0
    return 2 * cp_size - 1 - chunk, 1


def zigzag_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / cp_size]``) of the tokens held by ``cp_rank``."""
    chunk = seq_len // (2 * cp_size)
    first, second = zigzag_chunk_ids(cp_rank, cp_size)
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk, device=device),
         torch.arange(second * chunk, (second + 1) * chunk, device=device)]
    )


def zigzag_shard(x: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``seq_dim`` (differentiable: backward scatters into zeros)."""
    chunks = x.unflatten(seq_dim, (2 * cp_size, -1))
    index = torch.tensor(zigzag_chunk_ids(cp_rank, cp_size), device=x.device)
    return chunks.index_select(seq_dim, index).flatten(seq_dim, seq_dim + 1)


def zigzag_unshard(gathered: torch.Tensor, seq_dim: int, cp_size: int) -> torch.Tensor:
    """Reorder shards concatenated rank by rank along ``seq_dim`` into global token order."""
    chunks = gathered.unflatten(seq_dim, (2 * cp_size, -1))
    order = [2 * rank + half for rank, half in (zigzag_chunk_owner(j, cp_size) for j in range(2 * cp_size))]
    index = torch.tensor(order, device=gathered.device)
    return chunks.index_select(seq_dim, index).flatten(seq_dim, seq_dim + 1)
