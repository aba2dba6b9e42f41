"""Halo exchange for sliding-window and chunked attention (``"p2p"`` and the ring of ``"a2a+p2p"``).

With a left window ``W`` or chunks of ``C``, the queries of a zigzag chunk starting at position ``s``
see no key before ``s - lookback(s)`` (``W - 1``, or ``s mod C``:
:meth:`~cp_handler.core.masks.AttentionMask.lookback`).
So a rank needs, from every other rank, only the rows of K/V its queries can see: for a window
shorter than a zigzag chunk, the last ``W - 1`` rows of the chunk before each of its two chunks (held
by its neighbours ``r - 1`` and ``r + 1``); for longer ones, correspondingly more. :func:`halo_exchange`
computes these rows from the layout alone (the same on every rank), moves them in one all-to-all with
uneven splits (only the needed rows: a rank sends at most ``2 (W - 1)`` tokens of K/V per layer for a
window within a chunk, nothing at all for chunks aligned with the zigzag chunks) and appends them to
the local K/V; the attention then runs one block plan (:func:`~cp_handler.core.masks.mask_blocks`) on this
rank, and autograd returns the received rows' dK/dV by the reverse all-to-all.

Chosen by :func:`~.ring.ring_attention` when no rank would receive more than half of what the ring passes
it (``(cp - 1) * S_local`` rows); otherwise the ring runs (its blocks still planned by the mask). Megatron-LM's open
PR #5597 proposes a halo exchange for Transformer Engine's ring; this one is ours, on the block planner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask, mask_blocks
from .blocks import Block, plan_attn
from .collectives import all_to_all
from .kernels import check_plan
from .kv import kv_seq_dim, pack_kv, unpack_kv
from .spec import AttnSpec

Piece = tuple[int, int, int]  # (local row on the sending rank, rows, position of the first row in its document)


def halo_pieces(layout: ZigzagDocs, mask: AttentionMask, src: int, dst: int) -> tuple[tuple[int, Piece], ...]:
    """``(document, piece)`` of ``src``'s K/V rows that ``dst``'s queries can see, in a fixed order: per
    document and key chunk of ``src``, the span from the earliest key any of ``dst``'s chunks sees."""
    pieces = []
    for i in range(layout.num_docs):
        c = layout.chunk(i)
        queries = [(q_id * c, q_id * c + q_real) for q_id, _, q_real in layout.rank_chunks(i, dst) if q_real]
        for k_id, k_row, k_real in layout.rank_chunks(i, src):
            spans = [(max(k_id * c, first - mask.lookback(first)), min(k_id * c + k_real, mask.reach_after(end)))
                     for first, end in queries]
            spans = [(lo, hi) for lo, hi in spans if lo < hi]
            if spans:
                lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
                pieces.append((i, (k_row + lo - k_id * c, hi - lo, lo)))
    return tuple(pieces)


@dataclass(frozen=True)
class HaloPlan:
    """One rank's halo exchange: the rows it sends (grouped by destination), the rows per rank of the
    all-to-all, and its block plan over ``[local K/V | received rows]``."""

    send_rows: tuple[int, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    blocks: tuple[Block, ...]


@functools.lru_cache(maxsize=256)
def halo_plan(layout: ZigzagDocs, mask: AttentionMask, rank: int) -> HaloPlan:
    """The :class:`HaloPlan` of ``rank`` (any mask; :func:`halo_applies` says when it pays)."""
    size = layout.size
    send_rows, send_splits, recv_splits = [], [], []
    for dst in range(size):
        pieces = halo_pieces(layout, mask, rank, dst) if dst != rank else ()
        send_rows += [row for _, (start, n, _) in pieces for row in range(start, start + n)]
        send_splits.append(sum(n for _, (_, n, _) in pieces))
    mine = layout.rank_chunks
    blocks: list[Block] = []
    for i in range(layout.num_docs):  # local queries against local keys
        c = layout.chunk(i)
        for q_id, q_row, q_real in mine(i, rank):
            for k_id, k_row, k_real in mine(i, rank):
                blocks += mask_blocks(slice(q_row, q_row + q_real), q_id * c, slice(k_row, k_row + k_real),
                                      k_id * c, mask)
    row = layout.local_len
    for src in range(size):
        pieces = halo_pieces(layout, mask, src, rank) if src != rank else ()
        recv_splits.append(sum(n for _, (_, n, _) in pieces))
        for i, (_, n, pos) in pieces:  # local queries against the received rows
            c = layout.chunk(i)
            for q_id, q_row, q_real in mine(i, rank):
                blocks += mask_blocks(slice(q_row, q_row + q_real), q_id * c, slice(row, row + n), pos, mask)
            row += n
    return HaloPlan(tuple(send_rows), tuple(send_splits), tuple(recv_splits), tuple(check_plan(blocks)))


@functools.lru_cache(maxsize=256)
def halo_applies(layout: ZigzagDocs, mask: AttentionMask) -> bool:
    """Whether :func:`~.ring.ring_attention` uses the halo exchange: a window (one- or two-sided) or chunks, more
    than one rank, and no rank receiving more than half of the ``(size - 1) * local_len`` rows the ring passes it."""
    if not mask.restricted or layout.size == 1:
        return False
    received = max(sum(halo_plan(layout, mask, r).recv_splits) for r in range(layout.size))
    return 2 * received <= (layout.size - 1) * layout.local_len


@functools.lru_cache(maxsize=256)
def halo_moves_rows(layout: ZigzagDocs, mask: AttentionMask) -> bool:
    """Whether any rank sends a row (else the exchange is skipped on every rank: e.g. chunks aligned
    with the zigzag chunks)."""
    return any(any(halo_plan(layout, mask, r).send_splits) for r in range(layout.size))


def halo_exchange(k: torch.Tensor, v: torch.Tensor, group, layout: ZigzagDocs, mask: AttentionMask,
                  plan: HaloPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v (B, Hkv, S_local, D)`` extended along the sequence by the rows ``plan`` receives
    (differentiable: the received rows' gradients go back to their owners by the reverse all-to-all)."""
    if not halo_moves_rows(layout, mask):
        return k, v
    packed = pack_kv(k, v)  # K and V in one message, each with its own width (MLA)
    rows = packed.movedim(kv_seq_dim(packed), 0)  # (S_local, ...)
    index = torch.tensor(plan.send_rows, dtype=torch.long, device=k.device)
    received = all_to_all(rows.index_select(0, index), group, list(plan.send_splits), list(plan.recv_splits))
    return unpack_kv(torch.cat([rows, received]).movedim(0, kv_seq_dim(packed)), k.shape[-1])


def halo_attention(q, k, v, spec: AttnSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window / chunked attention with the halo exchange over ``spec.group`` (see the module doc): the
    results of :func:`~.ring.ring_attention`."""
    plan = halo_plan(spec.layout, spec.mask, dist.get_rank(spec.group))
    k_ext, v_ext = halo_exchange(k, v, spec.group, spec.layout, spec.mask, plan)
    return plan_attn(q, k_ext, v_ext, plan.blocks, spec)
