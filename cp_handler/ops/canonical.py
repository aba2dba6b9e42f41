"""Canonical tiles: the deterministic mode's attention, bitwise the same at every CP degree and in every pattern.

One process (cp 1), the KV all-gather (``"all_gather"``), the ring (``"p2p"``), each rank's heads after the Ulysses
all-to-all (``"a2a"``, where :func:`canonical_applies`) and a2a+p2p's ring over those heads all run on them and
give the same bits.

The pieces are fixed by the global sequence before any rank assignment: tiles of :func:`tile_size` tokens (a
function of the sequence length alone), and one partial per (query tile, key tile) pair that meets (causal: the key
tile at or before the query tile, the diagonal pair a causal call). What was measured on the CPU flash kernel
(2026-12-05): a query row's output, log-sum-exp and dq from a call are bitwise the same whatever other query rows,
heads or strides the call holds, given the same keys; a key row's dk / dv from a call are the same whatever other
keys the call holds, given the same query rows. So a pair's partials are the same bits whichever rank computes them
in whichever call, as long as a call holds one key tile (for the output and dq) or one query tile (for dk / dv).
The partials are combined in a fixed tree over the tile indices (:mod:`.tile_tree`): a query tile's outputs merged
over its key tiles, its dq summed over them, a key tile's dk / dv summed over its query tiles. The tree's order
depends on the tile indices alone, whatever order a rank receives the tiles in.

* Forward: the key tiles come to the query tiles: one process's own, the all-gather's whole sequence, or the
  ring's blocks in the ring's order (the next posted before the current one is computed). Per key tile a call over
  the rank's query rows after it (per chunk) and one causal call on the diagonal.
* Backward at cp > 1, two passes: the key tiles come to the queries again for dq (the same calls), then the query
  side (q, dout, out, lse) comes to the keys for dk / dv, per query tile a call over the rank's own keys it sees
  (per chunk). So a pair's backward runs twice: the mode's cost, against sums whose order would follow the group.
  One process (and ``a2a``'s heads) holds every query and key: one call per pair gives both partials, one pass.

The merges run on whole tiles (multiples of 64 rows), so a CPU vector loop never leaves a scalar tail whose
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
from .p2p import RingComm, exchange
from .seq_gather import all_gather_seq_raw
from .spec import AttentionFunction, AttnSpec
from .tile_tree import TileTree

TILES = (2048, 1024, 512, 256, 128, 64)
"""Tokens per canonical tile, by sequence length: the largest ``T`` of these with ``S`` a multiple of ``16 T`` (the
zigzag chunks ``S / (2 cp)`` are then multiples of ``T`` at cp 1, 2, 4 and 8), else 64. A function of the sequence
alone, so every degree cuts the same tiles; larger tiles mean fewer kernel calls and merges."""


def tile_size(seq_len: int) -> int:
    """The canonical tile of a sequence of ``seq_len`` tokens (:data:`TILES`)."""
    return next((t for t in TILES if seq_len % (16 * t) == 0), TILES[-1])


def tiles_refusal(seq_len: int, cp: int, comm_type: str = "all_gather") -> str | None:
    """Why a sequence of ``seq_len`` tokens in zigzag chunks over ``cp`` ranks cannot run ``comm_type`` on canonical
    tiles (``None``: it can)."""
    parts, tile = 2 * cp if cp > 1 else 1, tile_size(seq_len)
    if seq_len % (parts * tile):
        return (f"deterministic=True with cp_comm_type={comm_type!r}: a sequence of {seq_len} tokens over {cp} ranks "
                f"has zigzag chunks of {seq_len / parts:g} tokens; the mode's tiles ({tile} tokens for this length) "
                f"need chunks that are multiples of them (pad the sequence to a multiple of {parts * TILES[-1]})")
    return None


def _ranges(layout: ZigzagDocs, rank: int) -> tuple[tuple[int, int, int], ...]:
    """``(local row, global position, rows)`` of each of ``rank``'s chunks (one range alone)."""
    if layout.size == 1:
        return ((0, 0, layout.local_len),)
    chunk = layout.chunk(0)
    return tuple((half * chunk, cid * chunk, chunk) for half, cid in enumerate(zigzag_chunk_ids(rank, layout.size)))


def _tiles(ranges, size: int):
    """``(local rows, global tile index)`` of each tile of ``size`` tokens in ``ranges`` (chunks that are multiples
    of the tile)."""
    for local, first, rows in ranges:
        for i in range(rows // size):
            yield slice(local + i * size, local + (i + 1) * size), first // size + i


def _calls(ranges, tile: int, size: int, causal: bool, queries: bool):
    """``(local rows, their tiles, causal)`` of the calls between tile ``tile`` of one side and the rows of
    ``ranges`` on the other that see it: ``queries``, the query rows that see key tile ``tile``; else the key rows
    query tile ``tile`` sees. Causal: the diagonal tile alone in a causal call, the rest of a range in one full call
    (a row's partial from a call is the same whatever other rows of its side the call holds: module doc)."""
    for local, first, rows in ranges:
        t0 = first // size
        t1 = t0 + rows // size
        if not causal:
            spans = ((t0, t1, False),)
        elif queries:
            spans = ((tile, tile + 1, True), (max(t0, tile + 1), t1, False))
        else:
            spans = ((t0, min(t1, tile), False), (tile, tile + 1, True))
        for a, b, flag in spans:
            a, b = max(a, t0), min(b, t1)
            if a < b:
                yield slice(local + (a - t0) * size, local + (b - t0) * size), range(a, b), flag


def _seen(tile: int, num_tiles: int, causal: bool, queries: bool) -> range:
    """The tiles of the other side that meet ``tile`` (``queries``: ``tile`` is a query tile, these its key tiles)."""
    if not causal:
        return range(num_tiles)
    return range(0, tile + 1) if queries else range(tile, num_tiles)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a partial in the accumulation dtype (the tree combines into its left partials)."""
    return t.to(dtype=acc_dtype(t.dtype), memory_format=torch.contiguous_format, copy=True)


def _merged(left, right):
    merge_attn_out_(left[0], left[1], right[0], right[1])
    return left


def _summed(left, right):
    return tuple(a.add_(b) for a, b in zip(left, right, strict=True))


def _gather(t: torch.Tensor, group, layout: ZigzagDocs, dim: int = 2) -> torch.Tensor:
    """Every rank's ``t`` along ``dim`` (the sequence), in global order."""
    return all_gather_seq_raw(t, dim, group).index_select(dim, layout.gathered_index(real_only=False).to(t.device))


def _blocks(tensors: tuple[torch.Tensor, ...], spec: AttnSpec, ring: bool):
    """``(tensors of a block, its ranges)`` for every block of the other side a rank meets: one process's own; the
    whole sequence all-gathered (``all_gather``); or, over a ring (``ring``), every rank's in turn, the next posted
    before the current one is yielded (the transfer overlaps the computation)."""
    group, layout = spec.group, spec.layout
    if group is None:
        yield tensors, _ranges(layout, 0)
        return
    if not ring:
        yield tuple(_gather(t, group, layout) for t in tensors), ((0, 0, layout.local_len * layout.size),)
        return
    comm = RingComm(group)
    for step in range(comm.size):
        pending = None
        if step + 1 < comm.size:
            pending = exchange(group, [(t, comm.next_rank, tag) for tag, t in enumerate(tensors)],
                               [(torch.empty(t.shape, dtype=t.dtype, device=t.device), comm.prev_rank, tag)
                                for tag, t in enumerate(tensors)])
        yield tensors, _ranges(layout, (comm.rank - step) % comm.size)
        if pending is not None:
            tensors = tuple(pending.wait())


def _geometry(q: torch.Tensor, spec: AttnSpec):
    """``(this rank's ranges, tile size, tiles in the sequence)``."""
    rank = dist.get_rank(spec.group) if spec.group is not None else 0
    seq_len = spec.layout.local_len * spec.layout.size
    size = tile_size(seq_len)
    return _ranges(spec.layout, rank), size, seq_len // size


def _assemble(trees: dict, ranges, size: int, outs: tuple[torch.Tensor, ...]) -> None:
    """Each tile's combined partials into its rows of ``outs`` (accumulators shaped as the rank's tensors)."""
    for rows, tile in _tiles(ranges, size):
        for out, part in zip(outs, trees[tile].result(), strict=True):
            out[:, :, rows].copy_(part)


def canonical_forward(q, k, v, spec: AttnSpec, ring: bool = False, sinks=None):
    """``q (B, H, S_local, D)``, ``k, v (B, Hkv, S_local, D)`` -> ``(out in q's dtype, lse)``: module doc."""
    kernel, scale, causal = spec.kernel, spec.scale, spec.mask.causal
    ranges, size, num_tiles = _geometry(q, spec)
    trees = {tile: TileTree(num_tiles, _seen(tile, num_tiles, causal, True), _merged) for _, tile in
             _tiles(ranges, size)}
    for (k_block, v_block), key_ranges in _blocks((k, v), spec, ring):
        for keys, key_tile in _tiles(key_ranges, size):
            for rows, tiles, flag in _calls(ranges, key_tile, size, causal, queries=True):
                out, lse = kernel.forward(q[:, :, rows], k_block[:, :, keys], v_block[:, :, keys], causal=flag,
                                          scale=scale)
                for n, tile in enumerate(tiles):
                    part = slice(n * size, (n + 1) * size)
                    trees[tile].add(key_tile, (_own(out[:, :, part]), _own(lse[:, :, part])))
    out, lse = new_accumulators(q, v.shape[-1])
    _assemble(trees, ranges, size, (out, lse))
    return out.to(q.dtype), lse


def canonical_backward(dout, q, k, v, out, lse, spec: AttnSpec, ring: bool = False):
    """``(dq, dk, dv)`` of :func:`canonical_forward` (module doc); one process (``spec.group`` None): one pass."""
    dout = seq_major(dout)
    if spec.group is None:
        return _one_pass_backward(dout, q, k, v, out, lse, spec)
    kernel, scale, causal = spec.kernel, spec.scale, spec.mask.causal
    ranges, size, num_tiles = _geometry(q, spec)
    dq_trees = {tile: TileTree(num_tiles, _seen(tile, num_tiles, causal, True), _summed) for _, tile in
                _tiles(ranges, size)}
    for (k_block, v_block), key_ranges in _blocks((k, v), spec, ring):  # dq: the key tiles come to the queries
        for keys, key_tile in _tiles(key_ranges, size):
            for rows, tiles, flag in _calls(ranges, key_tile, size, causal, queries=True):
                grads = kernel.backward(dout[:, :, rows], q[:, :, rows], k_block[:, :, keys], v_block[:, :, keys],
                                        out[:, :, rows], lse[:, :, rows].contiguous(), causal=flag, scale=scale)
                for n, tile in enumerate(tiles):
                    dq_trees[tile].add(key_tile, (_own(grads[0][:, :, n * size:(n + 1) * size]),))
    kv_trees = {tile: TileTree(num_tiles, _seen(tile, num_tiles, causal, False), _summed) for _, tile in
                _tiles(ranges, size)}
    for (q_block, dout_block, out_block, lse_block), query_ranges in _blocks((q, dout, out, lse), spec, ring):
        for queries, query_tile in _tiles(query_ranges, size):  # dk / dv: the query tiles come to the keys
            saved = (out_block[:, :, queries], lse_block[:, :, queries].contiguous())
            for rows, tiles, flag in _calls(ranges, query_tile, size, causal, queries=False):
                grads = kernel.backward(dout_block[:, :, queries], q_block[:, :, queries], k[:, :, rows],
                                        v[:, :, rows], *saved, causal=flag, scale=scale)
                for n, tile in enumerate(tiles):
                    part = slice(n * size, (n + 1) * size)
                    kv_trees[tile].add(query_tile, (_own(grads[1][:, :, part]), _own(grads[2][:, :, part])))
    return _gradients(q, k, v, ranges, size, dq_trees, kv_trees)


def _gradients(q, k, v, ranges, size: int, dq_trees: dict, kv_trees: dict):
    dtype = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    _assemble(dq_trees, ranges, size, (dq,))
    _assemble(kv_trees, ranges, size, (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _one_pass_backward(dout, q, k, v, out, lse, spec: AttnSpec):
    """One process holds every query and key: one call per (query tile, key tile) pair gives both partials (a row's
    dq from a call over one key tile is the group's dq pass's, a key row's dk / dv from a call over one query tile
    the group's dk / dv pass's), each into its tree: the same bits as the two passes of a group, at the cost of
    one."""
    kernel, scale, causal = spec.kernel, spec.scale, spec.mask.causal
    ranges, size, num_tiles = _geometry(q, spec)
    dq_trees = {tile: TileTree(num_tiles, _seen(tile, num_tiles, causal, True), _summed) for tile in range(num_tiles)}
    kv_trees = {tile: TileTree(num_tiles, _seen(tile, num_tiles, causal, False), _summed)
                for tile in range(num_tiles)}
    for queries, query_tile in _tiles(ranges, size):
        saved = (out[:, :, queries], lse[:, :, queries].contiguous())
        for key_tile in _seen(query_tile, num_tiles, causal, True):
            keys = slice(key_tile * size, (key_tile + 1) * size)
            grads = kernel.backward(dout[:, :, queries], q[:, :, queries], k[:, :, keys], v[:, :, keys], *saved,
                                    causal=causal and key_tile == query_tile, scale=scale)
            dq_trees[query_tile].add(key_tile, (_own(grads[0]),))
            kv_trees[key_tile].add(query_tile, (_own(grads[1]), _own(grads[2])))
    return _gradients(q, k, v, ranges, size, dq_trees, kv_trees)


def canonical_applies(layout: ZigzagDocs, mask, sinks) -> bool:
    """Whether a call runs on canonical tiles in the deterministic mode (every pattern's cp 1 and ``a2a``): one
    unpadded sequence (bshd / sbhd), the plain causal or full mask, no sinks, a length the tiles divide. A function
    of the global call alone, so every degree and pattern decides alike."""
    seq_len = layout.local_len * layout.size
    return (mask.plain and sinks is None and layout.num_docs == 1 and layout.lengths == layout.padded_lengths
            and seq_len % tile_size(seq_len) == 0)


def canonical_attention(q, k, v, spec: AttnSpec, ring: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable deterministic attention of a checked call on canonical tiles (module doc): ``spec.group``
    None, one process's computation (cp 1); a group, the KV all-gather's, or with ``ring`` the ring's (``p2p``, the
    ring level of ``a2a+p2p``)."""
    return AttentionFunction.apply(q, k, v, None, canonical_forward, canonical_backward, spec, ring)
