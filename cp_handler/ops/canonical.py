"""Canonical tiles: the deterministic mode's attention, bitwise the same at every CP degree and across patterns.

The KV all-gather (``"all_gather"``) runs on them, and so do one process (cp 1) and each rank's heads after the
Ulysses all-to-all (``"a2a"``) where :func:`canonical_applies`; all three give the same bits.

Every rank computes what one process computes, in the same pieces and the same order, so nothing depends on the
group (docs/deterministic.md). The pieces are fixed by the global sequence before any rank assignment: key tiles of
:func:`tile_size` tokens (a function of the sequence length alone) and query tiles of the same size. What was
measured on the CPU flash kernel (2026-12-05): a query row's output, log-sum-exp and dq against one key tile are
bitwise the same whatever other query rows, heads or strides the call holds; a key row's dk / dv against one query
tile are the same whatever other keys the call holds, but are a sum over the call's query rows in the kernel's own
order, so they depend on which query rows the call holds.

* Forward: for each key tile ``j`` in ascending order, every local query row that sees it (the causal diagonal tile
  as a causal call, the rows after it in full), its result merged into the row's accumulators (the first tile
  copied): each row's merge order is its key tiles' order, at every degree.
* Backward, dq: the same calls in the same order, each row's dq summed in ascending key tile order.
* Backward, dk / dv: the query side (q, dout, out, lse) is all-gathered, and each rank computes its own keys'
  gradients, one call per query tile over the own keys it sees, summed in ascending query tile
  order (a key row's dk / dv from a call over one query tile is the same whatever other keys the call holds,
  measured). So a pair's backward runs twice (once for dq, once for dk / dv): the mode's cost, against a reduction
  over ranks whose order would follow the group.

The merges run over row counts that are multiples of the tile (the layout's chunks are), so a CPU vector loop never
leaves a scalar tail whose position would depend on the degree (:mod:`.merge`). bshd / sbhd, causal or full, without
windows, chunks, soft-caps or sinks (refused by the handler).
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

TILES = (512, 256, 128, 64)
"""Tokens per canonical tile, by sequence length: the largest ``T`` of these with ``S`` a multiple of ``16 T`` (the
zigzag chunks ``S / (2 cp)`` are then multiples of ``T`` at cp 1, 2, 4 and 8), else 64. A function of the sequence
alone, so every degree cuts the same tiles; larger tiles mean fewer kernel calls and merges (each key tile merges into
every row that sees it)."""


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


def _calls(ranges, tile: int, size: int, causal: bool):
    """For key tile ``tile`` (of ``size`` tokens): ``(local rows, causal)`` of the calls of the local query rows that
    see it."""
    start, stop = tile * size, (tile + 1) * size
    for local, first, rows in ranges:
        last = first + rows
        if not causal:
            yield slice(local, local + rows), False
            continue
        if last <= start:
            continue
        if first <= start:  # the diagonal tile is in this range
            yield slice(local + start - first, local + stop - first), True
            if last > stop:
                yield slice(local + stop - first, local + rows), False
        else:
            yield slice(local, local + rows), False


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
    ranges, size = _ranges(layout, rank), tile_size(k.shape[2])
    for tile in range(k.shape[2] // size):
        keys = slice(tile * size, (tile + 1) * size)
        for rows, causal in _calls(ranges, tile, size, spec.mask.causal):
            block_out, block_lse = kernel.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=causal,
                                                  scale=spec.scale)
            if tile == 0:  # every row's first key tile
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
    for tile in range(k_all.shape[2] // size):  # dq: each row over its key tiles in ascending order
        keys = slice(tile * size, (tile + 1) * size)
        for rows, causal in _calls(ranges, tile, size, spec.mask.causal):
            grads = kernel.backward(dout[:, :, rows], q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys],
                                    out[:, :, rows], lse[:, :, rows].contiguous(), causal=causal, scale=scale)
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
    """One process holds every query and key: one call per (query tile, key tile) pair gives both canonical partials
    (a row's dq from a tile pair is its dq from any call over that key tile; a key row's dk / dv from a tile pair is
    theirs from any call over that query tile: module doc), dq summed over key tiles in ascending order, dk / dv over
    query tiles in ascending order; the same bits as the two passes of a group."""
    dtype = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    size = tile_size(k.shape[2])
    tiles = k.shape[2] // size
    for query_tile in range(tiles):  # outer: each key tile's sum runs over query tiles in ascending order
        rows = slice(query_tile * size, (query_tile + 1) * size)
        saved = (out[:, :, rows], lse[:, :, rows].contiguous())
        for key_tile in range(query_tile + 1 if spec.mask.causal else tiles):  # each row's in ascending key tiles
            keys = slice(key_tile * size, (key_tile + 1) * size)
            grads = spec.kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], *saved,
                                         causal=spec.mask.causal and key_tile == query_tile, scale=spec.scale)
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
