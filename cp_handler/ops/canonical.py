"""Canonical tiles: the deterministic mode's attention, bitwise the same at every CP degree and in every pattern.

One process (cp 1), the KV all-gather (``"all_gather"``), the ring (``"p2p"``), each rank's heads after the Ulysses
all-to-all (``"a2a"``, where :func:`~.tiling.canonical_applies`) and a2a+p2p's ring over those heads all run on them and
give the same bits.

The pieces are fixed by the global sequence before any rank assignment: tiles of :func:`~.tiling.tile_size` tokens (a
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
* Backward: the key tiles come to the queries again; one call per pair gives both partials (a call holds one query
  tile and one key tile). dq goes into the query tile's tree; dk / dv into the key tile's tree when this rank owns
  the key tile, else into a tree of this rank's query tiles for it, whose complete nodes (the combinations of its
  leaves the key tile's tree would make, which need no other rank's leaf) are sent to the owner, who adds them to
  its tree as nodes (:func:`_exchange_nodes`; a ring step's to that step's owner, the all-gather's to every owner).
  A rank's query tiles are two runs of tiles (its zigzag chunks): where a run is a node of the tree (a power-of-two
  number of tiles, aligned) it sends one node per run and key tile, about twice the default ring's dk / dv bytes.

Windows, chunks and soft-caps: a pair that is not full or the diagonal runs its own blocks
(:func:`~cp_handler.core.masks.mask_blocks` on the pair alone, merged and summed in their order), the same at every
degree; pairs with nothing visible are skipped (a tile's visible tiles are a run around the diagonal). The merges run
on whole tiles (multiples of 64 rows), so a CPU vector loop never leaves a scalar tail whose position would depend on
the degree (:mod:`.merge`). Sinks are folded into each tile's merged result (:func:`_fold_sinks`), their gradient
summed in tile order over the group (:func:`_sinks_grad`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask
from .blocks import blocks_backward_, blocks_forward_, new_accumulators
from .collectives import all_gather_single
from .kernels.base import seq_major
from .merge import acc_dtype, merge_attn_out_
from .p2p import RingComm, exchange
from .seq_gather import all_gather_seq_raw
from .spec import AttentionFunction, AttnSpec
from .tile_tree import TileTree
from .tiling import meets, partners, rank_ranges, tile_owner, tiles_in, tilings


def _tree(tile, tiling, mask: AttentionMask, queries: bool, combine) -> TileTree:
    """The tree of ``tile``'s partials over the tiles of its document it meets (:func:`partners`)."""
    doc, index = tile
    size, count = tiling[doc]
    met = partners(index, count, size, mask, queries)
    return TileTree(count, range(met[0][0], met[-1][0] + 1), combine)


BATCHED_TILE = 64
"""Tiles of a multiple of this many tokens run a run of full pairs in one call (what was measured: a row's partial
from such a call is the same whatever other rows of whole tiles it holds); smaller tiles (a 48th of a short
document) one call per pair: with runs of 3-token tiles in one call, the last tile of each run gave other bits than
one process's (measured 2026-12-06 at cp 2; the CPU kernel's tail block of query rows is the likely cause, not
isolated)."""


def _calls(ranges, tile, tiling, mask: AttentionMask, queries: bool):
    """``(local rows, their tiles, pair kind)`` of the calls between ``tile`` of one side and the rows of
    ``ranges`` on the other that meet it (its document's): ``queries``, the query rows that see key tile ``tile``;
    else the key rows query tile ``tile`` sees. A run of full pairs in one call where tiles are multiples of
    :data:`BATCHED_TILE` (a row's partial from a call is the same whatever other rows of its side the call holds:
    module doc); a diagonal, a pair of blocks or a smaller tile alone."""
    doc, index = tile
    size, count = tiling[doc]
    kinds = dict(partners(index, count, size, mask, not queries))
    for range_doc, local, first, rows in ranges:
        if range_doc != doc:
            continue
        t0 = first // size
        run = None
        for t in range(t0, t0 + rows // size + 1):
            kind = kinds.get(t) if t < t0 + rows // size else None
            if run is not None and (kind is not False or size % BATCHED_TILE):
                yield slice(local + (run - t0) * size, local + (t - t0) * size), [(doc, i) for i in range(run, t)], \
                    False
                run = None
            if kind is False and size % BATCHED_TILE == 0:
                run = t if run is None else run
            elif kind is not None:
                yield slice(local + (t - t0) * size, local + (t + 1 - t0) * size), [(doc, t)], kind


def _forward_call(q, k, v, kind, spec: AttnSpec):
    """``(out, lse)`` of one call of :func:`_calls` (a pair's blocks merged in their order into fresh
    accumulators)."""
    if isinstance(kind, bool):
        return spec.kernel.forward(q, k, v, causal=kind, scale=spec.scale)
    out, lse = new_accumulators(q, v.shape[-1])
    blocks_forward_(out, lse, q, k, v, list(kind), spec, fresh=True)
    return out, lse


def _backward_call(dout, q, k, v, out, lse, kind, spec: AttnSpec):
    """``(dq, dk, dv)`` of one call of :func:`_calls` (a pair's blocks summed in their order)."""
    if isinstance(kind, bool):
        return spec.kernel.backward(dout, q, k, v, out, lse, causal=kind, scale=spec.scale)
    grads = tuple(torch.zeros_like(t, dtype=acc_dtype(t.dtype)) for t in (q, k, v))
    blocks_backward_(*grads, dout, q, k, v, out, lse, list(kind), spec)
    return grads


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a partial in the accumulation dtype (the tree combines into its left partials)."""
    return t.to(dtype=acc_dtype(t.dtype), memory_format=torch.contiguous_format, copy=True)


def _own_lse(t: torch.Tensor) -> torch.Tensor:
    """:func:`_own` for a partial's log-sum-exp ``(B, H, rows)``, each head's rows a run of their own (a row stride
    rounded up to 64): the merge's ``logaddexp`` then loops per head, so an element's vector or scalar path follows
    its row alone, not the number of heads a rank holds (with tiles of a few rows, ``a2a+p2p``'s halved heads gave
    other bits otherwise, measured 2026-12-06; :mod:`.merge`)."""
    rows = t.shape[-1]
    padded = t.new_empty((*t.shape[:-1], -(-rows // 64) * 64), dtype=acc_dtype(t.dtype))[..., :rows]
    return padded.copy_(t)


def _merged(left, right):
    merge_attn_out_(left[0], left[1], right[0], right[1])
    return left


def _summed(left, right):
    return tuple(a.add_(b) for a, b in zip(left, right, strict=True))


def _gather(t: torch.Tensor, group, layout: ZigzagDocs, dim: int = 2) -> torch.Tensor:
    """Every rank's ``t`` along ``dim`` (the sequence), in global order."""
    return all_gather_seq_raw(t, dim, group).index_select(dim, layout.gathered_index(real_only=False).to(t.device))


def _blocks(tensors: tuple[torch.Tensor, ...], spec: AttnSpec, ring: bool):
    """``(tensors of a block, its ranges, the rank it came from)`` for every block of the other side a rank meets:
    one process's own (rank 0); the whole sequence all-gathered (``all_gather``; from ``None``: every rank); or, over
    a ring (``ring``), every rank's in turn, the next posted before the current one is yielded (the transfer
    overlaps the computation)."""
    group, layout = spec.group, spec.layout
    if group is None:
        yield tensors, rank_ranges(layout, 0), 0
        return
    if not ring:
        starts = layout.cu_seqlens_padded.tolist()
        whole = tuple((doc, starts[doc], 0, padded) for doc, padded in enumerate(layout.padded_lengths) if padded)
        yield tuple(_gather(t, group, layout) for t in tensors), whole, None
        return
    comm = RingComm(group)
    for step in range(comm.size):
        pending = None
        if step + 1 < comm.size:
            pending = exchange(group, [(t, comm.next_rank, tag) for tag, t in enumerate(tensors)],
                               [(torch.empty(t.shape, dtype=t.dtype, device=t.device), comm.prev_rank, tag)
                                for tag, t in enumerate(tensors)])
        owner = (comm.rank - step) % comm.size
        yield tensors, rank_ranges(layout, owner), owner
        if pending is not None:
            tensors = tuple(pending.wait())


def _geometry(spec: AttnSpec):
    """``(this rank's ranges, the documents' tilings)``."""
    rank = dist.get_rank(spec.group) if spec.group is not None else 0
    return rank_ranges(spec.layout, rank), tilings(spec.layout)


def _assemble(trees: dict, ranges, tiling, outs: tuple[torch.Tensor, ...]) -> None:
    """Each tile's combined partials into its rows of ``outs`` (accumulators shaped as the rank's tensors)."""
    for rows, tile in tiles_in(ranges, tiling):
        for out, part in zip(outs, trees[tile].result(), strict=True):
            out[:, :, rows].copy_(part)


def canonical_forward(q, k, v, spec: AttnSpec, ring: bool = False, sinks=None):
    """``q (B, H, S_local, D)``, ``k, v (B, Hkv, S_local, D)`` -> ``(out in q's dtype, lse)``: module doc."""
    mask = spec.mask
    ranges, tiling = _geometry(spec)
    trees = {tile: _tree(tile, tiling, mask, True, _merged) for _, tile in tiles_in(ranges, tiling)}
    for (k_block, v_block), key_ranges, _ in _blocks((k, v), spec, ring):
        for keys, key_tile in tiles_in(key_ranges, tiling):
            size = tiling[key_tile[0]][0]
            for rows, tiles, kind in _calls(ranges, key_tile, tiling, mask, queries=True):
                out, lse = _forward_call(q[:, :, rows], k_block[:, :, keys], v_block[:, :, keys], kind, spec)
                for n, tile in enumerate(tiles):
                    part = slice(n * size, (n + 1) * size)
                    trees[tile].add(key_tile[1], (_own(out[:, :, part]), _own_lse(lse[:, :, part])))
    if sinks is not None:
        for tree in trees.values():
            tree.done[tree.root] = _fold_sinks(*tree.result(), sinks)
    out, lse = new_accumulators(q, v.shape[-1])
    _assemble(trees, ranges, tiling, (out, lse))
    return out.to(q.dtype), lse


def _fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """:func:`~.sinks.fold_sinks` on one tile's ``(out, lse)``, each elementwise pass written per head (the
    log-sum-exp rows padded as :func:`_own_lse`): the same bits whatever number of heads a rank holds."""
    sink = sinks.detach().to(lse.dtype)[None, :, None]
    total = torch.logaddexp(lse, sink, out=_own_lse(lse))
    factor = torch.sub(lse, total, out=_own_lse(lse)).exp_()
    return out.mul_(factor.unsqueeze(-1)), total


def _sinks_grad(dout, out, lse, sinks: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """The sinks' gradient ``(H,)``: each tile's share (:func:`~.sinks.sinks_grad` on its rows, per head), every
    rank's gathered and added in ascending tile order, on the group's first rank (the others return zeros, so a sum
    over the group, as a gradient all-reduce makes, is that total whatever its order)."""
    ranges, tiling = _geometry(spec)
    shares, order = [], []
    for rows, tile in tiles_in(ranges, tiling):
        delta = (dout[:, :, rows].to(lse.dtype) * out[:, :, rows].to(lse.dtype)).sum(-1)
        weight = torch.sub(sinks.detach().to(lse.dtype)[None, :, None], lse[:, :, rows], out=_own_lse(delta)).exp_()
        shares.append(-(weight.mul_(delta)).sum(dim=(0, 2)))
        order.append(tile)
    local, group = torch.stack(shares), spec.group
    if group is None:
        return _ordered_sum(local, order).to(sinks.dtype)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    every = local.new_empty((size * local.shape[0], local.shape[1]))
    all_gather_single(every, local, group)
    tiles = [tile for peer in range(size) for _, tile in tiles_in(rank_ranges(spec.layout, peer), tiling)]
    total = _ordered_sum(every, tiles)
    return (total if rank == 0 else torch.zeros_like(total)).to(sinks.dtype)


def _ordered_sum(shares: torch.Tensor, tiles: list) -> torch.Tensor:
    """The rows of ``shares`` added in ascending order of their ``tiles``."""
    total = None
    for i in sorted(range(len(tiles)), key=tiles.__getitem__):
        total = shares[i].clone() if total is None else total.add_(shares[i])
    return total


def canonical_backward(dout, q, k, v, out, lse, spec: AttnSpec, ring: bool = False):
    """``(dq, dk, dv)`` of :func:`canonical_forward` in one pass (module doc): the key tiles come to the queries as
    in the forward; one call per (query tile, key tile) pair gives both partials; dq into the query tile's tree, dk /
    dv into the key tile's, or, for another rank's key tile, into a tree of this rank's query tiles whose complete
    nodes are sent to the key tile's owner (:func:`_exchange_nodes`), who adds them to its tree."""
    dout = seq_major(dout)
    mask, group = spec.mask, spec.group
    ranges, tiling = _geometry(spec)
    rank = dist.get_rank(group) if group is not None else 0
    rows = dict((tile, local) for local, tile in tiles_in(ranges, tiling))
    saved = {tile: (out[:, :, local], lse[:, :, local].contiguous()) for tile, local in rows.items()}
    dq_trees = {tile: _tree(tile, tiling, mask, True, _summed) for tile in rows}
    kv_trees = {tile: _tree(tile, tiling, mask, False, _summed) for tile in rows}
    pending = []
    for (k_block, v_block), key_ranges, owner in _blocks((k, v), spec, ring):
        outboxes: dict[int, dict[tuple[int, int], TileTree]] = {}
        for keys, key_tile in tiles_in(key_ranges, tiling):
            keeper = owner if owner is not None else tile_owner(key_tile, tiling, spec.layout)
            if keeper == rank:
                target = kv_trees[key_tile]
            else:
                target = outboxes.setdefault(keeper, {})[key_tile] = _tree(key_tile, tiling, mask, False, _summed)
            for query_tile, kind in meets(key_tile, tiling, mask, False):
                if query_tile not in rows:
                    continue
                local = rows[query_tile]
                grads = _backward_call(dout[:, :, local], q[:, :, local], k_block[:, :, keys], v_block[:, :, keys],
                                       *saved[query_tile], kind, spec)
                dq_trees[query_tile].add(key_tile[1], (_own(grads[0]),))
                target.add(query_tile[1], (_own(grads[1]), _own(grads[2])))
        for done in pending:  # the previous step's nodes, before this step's are posted (memory: one step's)
            done()
        pending = [_exchange_nodes(spec, rank, outboxes, kv_trees, k, v, owner, tiling)]
    for done in pending:
        done()
    grads = _gradients(q, k, v, ranges, tiling, dq_trees, kv_trees)
    return grads if spec.sinks is None else (*grads, _sinks_grad(dout, out, lse, spec.sinks, spec))


@functools.lru_cache(maxsize=4096)
def _nodes(query_tiles: frozenset, key_tile, tiling, mask: AttentionMask) -> tuple:
    """The complete nodes, ascending, of key tile ``key_tile``'s tree after the partials of ``query_tiles`` (one
    rank's) were added: what that rank sends the key tile's owner (the same on both sides: geometry alone)."""
    tree = _tree(key_tile, tiling, mask, False, lambda left, right: left)
    for query_tile, _ in meets(key_tile, tiling, mask, False):
        if query_tile in query_tiles:
            tree.add(query_tile[1], True)
    return tuple(sorted(tree.done))


def _exchange_nodes(spec: AttnSpec, rank: int, outboxes: dict, kv_trees: dict, k, v, owner, tiling):
    """Post this step's sends (each outbox's complete nodes, to the key tiles' owners, one flat tensor per peer) and
    the receives of the nodes other ranks send this rank for its key tiles (``owner`` None: the all-gather, every
    peer; a ring step: the rank whose block this step is this rank's). Returns a call that waits and adds the
    received nodes to ``kv_trees``."""
    group, layout, mask = spec.group, spec.layout, spec.mask
    if group is None:
        return lambda: None
    size_cp = layout.size
    if owner is None:
        senders = [peer for peer in range(size_cp) if peer != rank]
    else:
        sender = (rank + (rank - owner) % size_cp) % size_cp  # its block at this step is this rank's
        senders = [sender] if owner != rank else []
    def shapes(key_tile):
        size = tiling[key_tile[0]][0]
        return (k.shape[0], k.shape[1], size, k.shape[3]), (v.shape[0], v.shape[1], size, v.shape[3])

    sends = []
    for peer, trees in sorted(outboxes.items()):
        parts = [t.reshape(-1) for _, tree in sorted(trees.items()) for _, node in sorted(tree.done.items())
                 for t in node]
        if parts:
            sends.append((torch.cat(parts), peer, NODES_TAG))
    recvs, expected = [], []
    mine = frozenset(tile for _, tile in tiles_in(rank_ranges(layout, rank), tiling))
    for peer in senders:
        theirs = frozenset(tile for _, tile in tiles_in(rank_ranges(layout, peer), tiling))
        nodes = [(key_tile, node) for key_tile in sorted(mine) for node in _nodes(theirs, key_tile, tiling, mask)]
        if nodes:
            numel = sum(math.prod(shape) for key_tile, _ in nodes for shape in shapes(key_tile))
            recvs.append((torch.empty(numel, dtype=acc_dtype(k.dtype), device=k.device), peer, NODES_TAG))
            expected.append(nodes)
    work = exchange(group, sends, recvs) if sends or recvs else None

    def done():
        if work is None:
            return
        for flat, nodes in zip(work.wait(), expected, strict=True):
            offset = 0
            for key_tile, (lo, hi) in nodes:
                parts = []
                for shape in shapes(key_tile):
                    numel = math.prod(shape)
                    parts.append(flat[offset:offset + numel].view(shape))
                    offset += numel
                kv_trees[key_tile].add(lo, tuple(parts), hi)
    return done


NODES_TAG = 2
"""The tag of the dk / dv nodes' messages (the ring's key-value blocks use 0 and 1)."""


def _gradients(q, k, v, ranges, tiling, dq_trees: dict, kv_trees: dict):
    dtype = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    _assemble(dq_trees, ranges, tiling, (dq,))
    _assemble(kv_trees, ranges, tiling, (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def canonical_attention(q, k, v, spec: AttnSpec, ring: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable deterministic attention of a checked call on canonical tiles (module doc): ``spec.group``
    None, one process's computation (cp 1); a group, the KV all-gather's, or with ``ring`` the ring's (``p2p``, the
    ring level of ``a2a+p2p``)."""
    return AttentionFunction.apply(q, k, v, spec.sinks, canonical_forward, canonical_backward, spec, ring)
