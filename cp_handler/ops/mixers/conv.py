"""A causal depthwise convolution over the sequence (short convolutions: Qwen3-Next's and Mamba's before their
recurrences, LFM2's gated short conv) under CP, by a halo of left context.

A kernel of ``K`` taps makes each output depend on the ``K - 1`` inputs before it. Each local chunk of a
document (:mod:`.segments`) therefore needs the ``K - 1`` inputs before its first token: held by this rank,
by others (the halo exchange of a causal window of ``K``: :func:`~..halo.halo_pieces`, which also covers
chunks shorter than ``K - 1``, several chunks back), or before the document's start (zeros). One uneven
all-to-all (``2 (K - 1)`` rows per rank for chunks of at least ``K - 1`` tokens; its backward returns the
halo's gradients) brings them; each chunk is then laid out as ``[its K - 1 halo rows | its real rows]``, all
chunks in one tensor, and the unmodified convolution runs once on it: its own zero padding falls before the
first halo and every output row of a chunk sees exactly its true inputs. Padding rows get zero.
Megatron-LM has the contiguous-shard form (``causal_conv1d_cp``); this one follows the zigzag chunks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...core.layout import ZigzagDocs
from ...core.masks import AttentionMask
from ..collectives import all_to_all
from ..halo import halo_pieces
from .segments import segment_plan


def depthwise_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            activation: str | None = None) -> torch.Tensor:
    """The plain kernel: ``x (B, C, S)``, ``weight (C, K)``, optional ``bias (C,)`` and ``activation``
    (``"silu"`` / ``"swish"`` or ``None``) -> ``(B, C, S)``: output ``t`` from inputs ``t - K + 1 .. t``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d activation={activation!r}: 'silu' / 'swish' or None")
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
    return F.silu(out) if activation else out


@dataclass(frozen=True)
class ConvPlan:
    """One rank's conv halo: the rows it sends / receives per rank, ``gather`` (rows of
    ``[local | received | zero]`` laid out as the chunks' ``[halo | rows]``) and ``scatter`` (each local row's
    row of the convolution's output, or the zero row after it)."""

    send_rows: tuple[int, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    gather: torch.Tensor
    scatter: torch.Tensor


@functools.lru_cache(maxsize=256)
def conv_plan(layout: ZigzagDocs, rank: int, taps: int) -> ConvPlan:
    """The :class:`ConvPlan` of ``rank`` for a kernel of ``taps`` (>= 1) taps."""
    mask, size = AttentionMask(window=taps), layout.size
    sent = [halo_pieces(layout, mask, rank, dst) if dst != rank and taps > 1 else () for dst in range(size)]
    received = [halo_pieces(layout, mask, src, rank) if src != rank and taps > 1 else () for src in range(size)]
    row_of: dict[tuple[int, int], int] = {}  # (document, position) -> row of [local | received]
    for i in range(layout.num_docs):
        for chunk, row, real in layout.rank_chunks(i, rank):
            start = chunk * layout.chunk(i)
            row_of.update({(i, start + t): row + t for t in range(real)})
    next_row = layout.local_len
    for pieces in received:
        for i, (_, n, pos) in pieces:
            row_of.update({(i, pos + t): next_row + t for t in range(n)})
            next_row += n
    zero, gather, scatter = next_row, [], [-1] * layout.local_len
    for seg in segment_plan(layout, rank).segments:
        if not seg.real:
            continue
        start = seg.chunk * layout.chunk(seg.doc)
        gather += [row_of[seg.doc, p] if p >= 0 else zero for p in range(start - taps + 1, start)]
        scatter[seg.row:seg.row + seg.real] = range(len(gather), len(gather) + seg.real)
        gather += range(seg.row, seg.row + seg.real)
    scatter = [len(gather) if s < 0 else s for s in scatter]
    return ConvPlan(tuple(r for pieces in sent for _, (first, n, _) in pieces for r in range(first, first + n)),
                    tuple(sum(n for _, (_, n, _) in pieces) for pieces in sent),
                    tuple(sum(n for _, (_, n, _) in pieces) for pieces in received),
                    torch.tensor(gather, dtype=torch.long), torch.tensor(scatter, dtype=torch.long))


def causal_conv1d(conv_fn, x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, *, layout: ZigzagDocs,
                  rank: int, group, **conv_kwargs) -> torch.Tensor:
    """The convolution of the whole sequence at this rank's rows (module doc).

    Args:
        conv_fn: the kernel, ``conv_fn(x (B, C, S), weight (C, K), bias, activation, **conv_kwargs)`` causal with
            zero left padding (:func:`depthwise_causal_conv1d`, transformers' / Dao's ``causal_conv1d_fn``).
        x: ``(B, C, S_local)``; weight: ``(C, K)``.
        layout, rank, group: the batch's layout, this rank, the CP group.

    Returns:
        ``(B, C, S_local)``, zero at padding rows.
    """
    if layout.size == 1 and layout.num_docs == 1:
        return conv_fn(x, weight, bias, activation, **conv_kwargs)
    plan = conv_plan(layout, rank, weight.shape[-1])
    rows = x.movedim(2, 0)  # (S_local, B, C)
    parts = [rows]
    if layout.size > 1 and weight.shape[-1] > 1:
        index = torch.tensor(plan.send_rows, dtype=torch.long, device=x.device)
        parts.append(all_to_all(rows.index_select(0, index), group, list(plan.send_splits), list(plan.recv_splits)))
    source = torch.cat([*parts, rows.new_zeros(1, *rows.shape[1:])])
    out = conv_fn(source.index_select(0, plan.gather.to(x.device)).movedim(0, 2), weight, bias, activation,
                  **conv_kwargs)
    out = torch.cat([out, out.new_zeros(*out.shape[:2], 1)], dim=2).index_select(2, plan.scatter.to(x.device))
    return out + sum(part.sum() for part in parts[1:]) * 0  # the halo's backward runs on every rank
