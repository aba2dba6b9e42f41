"""The pieces of a local tensor a sequence mixer runs on: each zigzag chunk's real rows, per document.

Under the zigzag layout (:class:`~cp_handler.core.layout.ZigzagDocs`) a rank holds, per document, two chunks
(one at cp = 1); the real tokens of a chunk are a prefix of it (padding only follows a document's last real
token). A recurrence or a convolution runs on every chunk's real rows with the state (or the left context)
of everything before the chunk in its document; the padding rows get zero.

:func:`segment_groups` groups the chunks of equal real length, so a kernel runs once per group with the
chunks stacked along the batch dim (bshd: one group of two chunks; thd: one per distinct length).
:func:`to_segments` / :func:`from_segments` move a tensor between the local layout and that stacking.
Pure index arithmetic, cached per layout and rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...core.layout import ZigzagDocs


@dataclass(frozen=True)
class Segment:
    """One zigzag chunk of one document on this rank.

    Attributes:
        doc: the document. chunk: the zigzag chunk id (its first token is at position ``chunk * chunk_len``).
        row: its first local row. real: its real tokens (a prefix). slot: its index among the rank's chunks
        (document-major: ``2 * doc + half`` at cp > 1, ``doc`` at cp = 1), the same count on every rank.
    """

    doc: int
    chunk: int
    row: int
    real: int
    slot: int


@dataclass(frozen=True)
class SegmentGroup:
    """Chunks of one real length ``length``: their segments and local rows ``rows (n * length,)`` (int64)."""

    length: int
    segments: tuple[Segment, ...]
    rows: torch.Tensor


@dataclass(frozen=True)
class SegmentPlan:
    """A rank's segments (every slot, in slot order), its groups of equal real length, and ``inverse``: for
    each local row its row in the groups' outputs concatenated (group by group, then a zero row)."""

    segments: tuple[Segment, ...]
    groups: tuple[SegmentGroup, ...]
    inverse: torch.Tensor


@functools.lru_cache(maxsize=256)
def segment_plan(layout: ZigzagDocs, rank: int) -> SegmentPlan:
    """The :class:`SegmentPlan` of ``rank`` under ``layout``."""
    segments = []
    for i in range(layout.num_docs):
        for chunk, row, real in layout.rank_chunks(i, rank):
            segments.append(Segment(i, chunk, row, real, len(segments)))
    by_length: dict[int, list[Segment]] = {}
    for seg in segments:
        if seg.real:
            by_length.setdefault(seg.real, []).append(seg)
    groups, inverse, done = [], torch.full((layout.local_len,), -1, dtype=torch.long), 0
    for length, segs in by_length.items():
        rows = torch.cat([torch.arange(s.row, s.row + s.real) for s in segs])
        inverse[rows] = torch.arange(done, done + rows.numel())
        done += rows.numel()
        groups.append(SegmentGroup(length, tuple(segs), rows))
    inverse[inverse < 0] = done  # padding rows: the zero row after the outputs
    return SegmentPlan(tuple(segments), tuple(groups), inverse)


def to_segments(x: torch.Tensor, seq_dim: int, group: SegmentGroup) -> torch.Tensor:
    """``x`` (batch at dim 0, the local sequence at ``seq_dim``) -> the group's chunks stacked along the batch:
    ``(n * B, ..., length at seq_dim, ...)``, chunk-major."""
    n = len(group.segments)
    picked = x.index_select(seq_dim, group.rows.to(x.device)).unflatten(seq_dim, (n, group.length))
    return picked.movedim(seq_dim, 0).flatten(0, 1)


def from_segments(y: torch.Tensor, seq_dim: int, n: int) -> torch.Tensor:
    """Inverse of :func:`to_segments` up to the row order: ``(n * B, ..., L, ...)`` -> ``(B, ..., n * L, ...)``."""
    return y.unflatten(0, (n, -1)).movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)


def assemble(outputs: list[torch.Tensor], seq_dim: int, plan: SegmentPlan) -> torch.Tensor:
    """``[blank, *outputs]``: an empty output and the groups' outputs (each from :func:`from_segments`, in group
    order) back in the local layout, zero at the padding rows, in the outputs' dtype (the blank's without any)."""
    dtype = outputs[-1].dtype
    joined = torch.cat([t.to(dtype) for t in outputs], dim=seq_dim)
    zero = joined.new_zeros((*joined.shape[:seq_dim], 1, *joined.shape[seq_dim + 1:]))
    return torch.cat([joined, zero], dim=seq_dim).index_select(seq_dim, plan.inverse.to(joined.device))
