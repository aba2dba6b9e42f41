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


def permute_chunks(x: torch.Tensor, dim: int, order: list[int], n_chunks: int | None = None) -> torch.Tensor:
    """Cut ``x`` along ``dim`` into ``n_chunks`` (default ``len(order)``) equal chunks and keep
    ``order`` of them, concatenated. Differentiable (an index_select)."""
    chunks = x.unflatten(dim, (n_chunks or len(order), -1))
    index = torch.tensor(order, device=x.device)
    return chunks.index_select(dim, index).flatten(dim, dim + 1)


def zigzag_shard(x: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``seq_dim`` (differentiable: backward scatters into zeros)."""
    return permute_chunks(x, seq_dim, list(zigzag_chunk_ids(cp_rank, cp_size)), 2 * cp_size)


def zigzag_unshard(gathered: torch.Tensor, seq_dim: int, cp_size: int) -> torch.Tensor:
    """Reorder shards concatenated rank by rank along ``seq_dim`` into global token order."""
    order = [2 * rank + half for rank, half in (zigzag_chunk_owner(j, cp_size) for j in range(2 * cp_size))]
    return permute_chunks(gathered, seq_dim, order)


def zigzag_reshard(x: torch.Tensor, seq_dim: int, cp_size: int) -> torch.Tensor:
    """Global token order -> every rank's shard concatenated rank by rank (inverse of unshard)."""
    order = [chunk for rank in range(cp_size) for chunk in zigzag_chunk_ids(rank, cp_size)]
    return permute_chunks(x, seq_dim, order)


def a2a_chunk_order(a2a_size: int) -> list[int]:
    """Chunk order that turns the ``2 * a2a_size`` zigzag chunks received by an all-to-all (rank by
    rank, two per rank) into two ascending runs: chunks ``pA..pA+A-1`` then ``2cp-pA-A..2cp-1-pA``.

    Those runs are super-chunks ``p`` and ``2P-1-p`` of a zigzag over the ``P`` outer ranks, so a
    ring over the outer group sees the ordinary zigzag layout (and with ``P == 1``, global order).
    """
    return [2 * a for a in range(a2a_size)] + [2 * a + 1 for a in reversed(range(a2a_size))]


def inverse_order(order: list[int]) -> list[int]:
    """The permutation that undoes ``order``."""
    inverse = [0] * len(order)
    for position, chunk in enumerate(order):
        inverse[chunk] = position
    return inverse
