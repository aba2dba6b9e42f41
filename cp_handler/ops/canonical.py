"""Canonical tiles: the deterministic mode's attention, bitwise the same at every CP degree and across patterns.

The KV all-gather (``"all_gather"``) runs on them, and so do one process (cp 1) and each rank's heads after the
Ulysses all-to-all (``"a2a"``) where :func:`canonical_applies`; all three give the same bits.

Every rank computes what one process computes, in the same pieces and the same order, so nothing depends on the
group (docs/deterministic.md). The pieces are fixed by the global sequence before any rank assignment: query tiles of
:func:`tile_size` tokens (a function of the sequence length alone), and for each query tile the same kernel calls:
causal, its keys before the tile in one full call and its diagonal tile in one causal call (full mask: every key in
one call). What was measured on the CPU flash kernel (2026-12-05): a query row's output, log-sum-exp and dq from a
call are bitwise the same whatever other query rows, heads or strides the call holds, given the same keys; a key
row's dk / dv from a call are the same whatever other keys the call holds, given the same query rows, but are a sum
over the call's query rows in the kernel's own order, so they depend on which query rows the call holds.

* Forward: each local query tile's calls, the keys before it first (copied into the accumulators), its diagonal
  merged: one merge per row, the same at every degree.
* Backward, dq: the same calls, each row's dq the sum of its tile's two in that order.
* Backward, dk / dv: one process (and ``a2a``'s heads) take them from the same calls, each key row's summed over the
  query tiles in ascending order. A rank of ``all_gather`` holds some of the query tiles only: the query side (q,
  dout, out, lse) is all-gathered, and each rank computes its own keys' gradients, per query tile one call over the
  own keys it sees (a key row's dk / dv is the same whatever other keys the call holds, measured), summed in
  ascending query tile order. So a pair's backward runs twice there (once for dq, once for dk / dv): the mode's
  cost, against a reduction over ranks whose order would follow the group.

The merges run over row counts that are multiples of the tile, so a CPU vector loop never leaves a scalar tail whose
position would depend on the degree (:mod:`.merge`). bshd / sbhd, causal or full, without windows, chunks, soft-caps
or sinks (refused by the handler).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs, zigzag_chunk_ids
from .blocks import new_accumulators
from .kernels.base import seq_major
from .merge import acc_dtype, merge_attn_out_
from .seq_gather import all_gather_seq_raw
from .spec import AttentionFunction, AttnSpec

TILES = (2048, 1024, 512, 256, 128, 64)
"""Tokens per canonical tile, by sequence length: the largest ``T`` of these with ``S`` a multiple of ``16 T`` (the
zigzag chunks ``S / (2 cp)`` are then multiples of ``T`` at cp 1, 2, 4 and 8), else 64. A function of the sequence
alone, so every degree cuts the same tiles; larger tiles mean fewer kernel calls and merges (two calls and one merge
per query tile)."""


def tile_size(seq_len: int) -> int:
    """The canonical tile of a sequence of ``seq_len`` tokens (:data:`TILES`)."""
    return next((t for t in TILES if seq_len % (16 * t) == 0), TILES[-1])


def tiles_refusal(seq_len: int, cp: int) -> str | None:
    """Why a sequence of ``seq_len`` tokens over ``cp`` ranks cannot run on canonical tiles (``None``: it can)."""
    parts, tile = 2 * cp if cp > 1 else 1, tile_size(seq_len)
    if seq_len % (parts * tile):
        return (f"deterministic=True with cp_comm_type='all_gather': a sequence of {seq_len} tokens over {cp} ranks "
                f"has zigzag chunks of {seq_len / parts:g} tokens; the mode's tiles ({tile} tokens for this length) "
                f"need chunks that are multiples of them (pad the sequence to a multiple of {parts * TILES[-1]})")
    return None


def _ranges(layout: ZigzagDocs, rank: int) -> tuple[tuple[int, int, int], ...]:
    """``(local row, global position, rows)`` of each of ``rank``'s chunks (one range alone)."""
    if layout.size == 1:
        return ((0, 0, layout.local_len),)
    chunk = layout.chunk(0)
    return tuple((half * chunk, cid * chunk, chunk) for half, cid in enumerate(zigzag_chunk_ids(rank, layout.size)))


def _query_tiles(ranges, size: int):
    """``(local rows, global tile index)`` of each of the rank's query tiles of ``size`` tokens (its chunks are
    multiples of the tile)."""
    for local, first, rows in ranges:
        for i in range(rows // size):
            yield slice(local + i * size, local + (i + 1) * size), first // size + i


def _tile_calls(tile: int, size: int, causal: bool, seq_len: int):
    """``(key rows, causal)`` of query tile ``tile``'s calls (module doc): causal, the keys before it in full, then
    its diagonal tile; the full mask, every key."""
    if not causal:
        return ((slice(0, seq_len), False),)
    diagonal = (slice(tile * size, (tile + 1) * size), True)
    return ((slice(0, tile * size), False), diagonal) if tile else (diagonal,)


def _gather(t: torch.Tensor, group, layout: ZigzagDocs, dim: int = 2) -> torch.Tensor:
    """Every rank's ``t`` along ``dim`` (the sequence), in global order (``group`` None: ``t``)."""
    if group is None:
        return t
    return all_gather_seq_raw(t, dim, group).index_select(dim, layout.gathered_index(real_only=False).to(t.device))


def canonical_forward(q, k, v, spec: AttnSpec, sinks=None):
    """``q (B, H, S_local, D)``, ``k, v (B, Hkv, S_local, D)`` -> ``(out in q's dtype, lse)``: module doc."""
    group, layout, kernel = spec.group, spec.layout, spec.kernel
    rank = dist.get_rank(group) if group is not None else 0
    k, v = _gather(k, group, layout), _gather(v, group, layout)
    out, lse = new_accumulators(q, v.shape[-1])
    size = tile_size(k.shape[2])
    for rows, tile in _query_tiles(_ranges(layout, rank), size):
        for i, (keys, causal) in enumerate(_tile_calls(tile, size, spec.mask.causal, k.shape[2])):
            block_out, block_lse = kernel.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=causal,
                                                  scale=spec.scale)
            if i == 0:  # the tile's first call
                out[:, :, rows].copy_(block_out)
                lse[:, :, rows].copy_(block_lse)
            else:
                merge_attn_out_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    return out.to(q.dtype), lse


def canonical_backward(dout, q, k, v, out, lse, spec: AttnSpec):
    """``(dq, dk, dv)`` of :func:`canonical_forward` (module doc); one process (``spec.group`` None): one pass."""
    dout = seq_major(dout)
    if spec.group is None:
        return _one_pass_backward(dout, q, k, v, out, lse, spec)
    group, layout, kernel, scale = spec.group, spec.layout, spec.kernel, spec.scale
    rank = dist.get_rank(group)
    dtype = acc_dtype(q.dtype)
    k_all, v_all = _gather(k, group, layout), _gather(v, group, layout)
    ranges, size = _ranges(layout, rank), tile_size(k_all.shape[2])
    dq = torch.zeros_like(q, dtype=dtype)
    for rows, tile in _query_tiles(ranges, size):  # dq: each row's tile calls in order
        saved = (out[:, :, rows], lse[:, :, rows].contiguous())
        for keys, causal in _tile_calls(tile, size, spec.mask.causal, k_all.shape[2]):
            grads = kernel.backward(dout[:, :, rows], q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], *saved,
                                    causal=causal, scale=scale)
            dq[:, :, rows].add_(grads[0])
    q_all, dout_all, out_all, lse_all = (_gather(t, group, layout) for t in (q, dout, out, lse))
    dout_all, out_all = seq_major(dout_all), seq_major(out_all)
    dk = torch.zeros_like(k, dtype=dtype)
    dv = torch.zeros_like(v, dtype=dtype)
    for query_tile in range(q_all.shape[2] // size):  # dk / dv: own keys, summed over query tiles in ascending order
        queries = slice(query_tile * size, (query_tile + 1) * size)
        args = (dout_all[:, :, queries], q_all[:, :, queries])
        saved = (out_all[:, :, queries], lse_all[:, :, queries].contiguous())
        for mine, causal in _key_calls(ranges, query_tile, size, spec.mask.causal):
            grads = kernel.backward(*args, k[:, :, mine], v[:, :, mine], *saved, causal=causal, scale=scale)
            dk[:, :, mine].add_(grads[1])
            dv[:, :, mine].add_(grads[2])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _one_pass_backward(dout, q, k, v, out, lse, spec: AttnSpec):
    """One process holds every query and key: each query tile's calls (module doc) give both canonical partials (a
    row's dq is the group's dq pass's, the same calls; a key row's dk / dv from a call over one query tile is theirs
    from any call over that tile), dq summed over the tile's calls in order, dk / dv over query tiles in ascending
    order; the same bits as the two passes of a group, at the cost of one."""
    dtype = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    size = tile_size(k.shape[2])
    for rows, tile in _query_tiles(((0, 0, k.shape[2]),), size):  # each key row's sum in ascending query tiles
        saved = (out[:, :, rows], lse[:, :, rows].contiguous())
        for keys, causal in _tile_calls(tile, size, spec.mask.causal, k.shape[2]):
            grads = spec.kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], *saved,
                                         causal=causal, scale=spec.scale)
            dq[:, :, rows].add_(grads[0])
            dk[:, :, keys].add_(grads[1])
            dv[:, :, keys].add_(grads[2])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def canonical_applies(layout: ZigzagDocs, mask, sinks) -> bool:
    """Whether a call runs on canonical tiles in the deterministic mode (every pattern's cp 1 and ``a2a``): one
    unpadded sequence (bshd / sbhd), the plain causal or full mask, no sinks, a length the tiles divide. A function
    of the global call alone, so every degree and pattern decides alike."""
    seq_len = layout.local_len * layout.size
    return (mask.plain and sinks is None and layout.num_docs == 1 and layout.lengths == layout.padded_lengths
            and seq_len % tile_size(seq_len) == 0)


def _key_calls(ranges, tile: int, size: int, causal: bool):
    """For query tile ``tile`` (of ``size`` tokens): ``(local key rows, causal)`` of the calls over this rank's keys it
    sees (a key row's dk / dv from one call over the tile's rows is the same whatever other keys the call holds)."""
    start, stop = tile * size, (tile + 1) * size
    for local, first, rows in ranges:
        last = first + rows
        if not causal:
            yield slice(local, local + rows), False
            continue
        if start > first:  # the keys before the tile, in full
            end = min(last, start)
            yield slice(local, local + end - first), False
        if first <= start < last:  # the diagonal tile
            yield slice(local + start - first, local + stop - first), True


def canonical_attention(q, k, v, spec: AttnSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable deterministic KV all-gather attention of a checked call (module doc); ``spec.group`` None runs
    one process's canonical computation (cp 1)."""
    return AttentionFunction.apply(q, k, v, None, canonical_forward, canonical_backward, spec)
