"""The communication patterns (``cp_comm_type``) as a registry, like the kernels' ``KERNELS``.

One :class:`CommPattern` per pattern: how its attention runs on a rank (the algorithm of its ops
file), the block plan one rank computes (what ``cp-bench --modes plan`` times and the launch counter
counts), and what it needs (hierarchical groups; the all-to-all size its heads are split over, padded
where that size does not divide them: :func:`~.ulysses.a2a_head_plan`). The local handler, the
config's rules (by name, :mod:`cp_handler.core.comm_types`), ``cp-train``'s checks and ``cp-bench`` all read
this table, so a new pattern is its ops file, one entry in :data:`PATTERNS` and its name in ``core/comm_types.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.comm_types import CP_COMM_TYPES, HIERARCHICAL_COMM_TYPES
from ..core.layout import ZigzagDocs
from ..core.masks import CAUSAL
from .all_gather import all_gather_attention, all_gather_blocks
from .blocks import Block
from .halves import halves_step_plans, uses_halves
from .ring import ring_attention, ring_blocks
from .ulysses import a2a_attention


@dataclass(frozen=True)
class RankSteps:
    """One rank's compute under a pattern: local query and K/V lengths (rows), the factor its heads
    are divided by (all-to-all over heads), the block plan of each step (the first one fresh), and the K/V
    blocks it gathers into another row order per pass (forward; the backward the same: the ring's last rank
    over reordered rows, :mod:`.halves`)."""

    q_len: int
    kv_len: int
    head_divisor: int
    steps: list[list[Block]]
    kv_gathers: int = 0


@dataclass(frozen=True)
class CommPattern:
    """One ``cp_comm_type``.

    Attributes:
        name: the ``cp_comm_type`` value.
        attention: ``(q, k, v, spec) -> (out, lse or None)`` on ``(B, H, S_local, D)`` tensors, a checked call
            (:class:`~.spec.AttnSpec`, its groups from :meth:`spec_groups`).
        rank_steps: ``(layout, rank, a2a_size, packed) -> RankSteps``: the causal plan of ``rank`` (no
            communication), ``layout`` over the whole CP group; ``packed``: as a packed kernel runs it (the ring
            over reordered rows for packed documents, :mod:`.halves`).
        hierarchical: runs on two levels of groups (``hierarchical_context_parallel_sizes``).
        splits_heads: divides heads over an all-to-all group (the whole CP group, or the inner level).
    """

    name: str
    attention: Callable
    rank_steps: Callable[[ZigzagDocs, int, int, bool], RankSteps]
    hierarchical: bool = False
    splits_heads: bool = False

    def spec_groups(self, cp_group, levels) -> dict:
        """The :class:`~.spec.AttnSpec` groups of this pattern: the CP group, or for a hierarchical pattern its
        a2a level (``levels[0]``) with the ring over the p2p level (``levels[1]``)."""
        if self.hierarchical:
            return {"group": levels[0], "p2p_group": levels[1]}
        return {"group": cp_group}

    def a2a_size(self, cp_size: int, hierarchical_sizes: list[int] | None) -> int | None:
        """The all-to-all size its heads are divided over (``None``: heads are not divided; any head count runs,
        :func:`~.ulysses.a2a_head_plan` pads heads this size does not divide)."""
        if not self.splits_heads:
            return None
        return (hierarchical_sizes or [1])[0] if self.hierarchical else cp_size


def _ring_plans(layout: ZigzagDocs, rank: int, packed: bool) -> list[list[Block]]:
    """The ring's plans of every step as the ring runs them (over reordered rows for a packed kernel on packed
    documents: several plans per step, the first of step 0 fresh)."""
    if uses_halves(layout, packed, CAUSAL):
        return [plan for s in range(layout.size) for plan in halves_step_plans(layout, s, rank)]
    return [ring_blocks(layout, s, rank, CAUSAL) for s in range(layout.size)]


def _wrap_gathers(layout: ZigzagDocs, rank: int, packed: bool) -> int:
    """K/V blocks ``rank`` of a ring over ``layout`` gathers per pass: the last rank puts every block it sends
    over the ring's wrap in docs order (:mod:`.halves`)."""
    return layout.size - 1 if uses_halves(layout, packed, CAUSAL) and rank == layout.size - 1 else 0


def _ring_steps(layout: ZigzagDocs, rank: int, a2a_size: int, packed: bool = False) -> RankSteps:
    return RankSteps(layout.local_len, layout.local_len, 1, _ring_plans(layout, rank, packed),
                     _wrap_gathers(layout, rank, packed))


def _all_gather_steps(layout: ZigzagDocs, rank: int, a2a_size: int, packed: bool = False) -> RankSteps:
    return RankSteps(layout.local_len, int(layout.cu_seqlens_padded[-1]), 1, [all_gather_blocks(layout, rank, CAUSAL)])


def _a2a_steps(layout: ZigzagDocs, rank: int, a2a_size: int, packed: bool = False) -> RankSteps:
    inner = layout.inner(a2a_size)  # after the all-to-all: a ring over the outer ranks (rank 0's position)
    ring_rank = rank // a2a_size
    return RankSteps(inner.local_len, inner.local_len, a2a_size, _ring_plans(inner, ring_rank, packed),
                     _wrap_gathers(inner, ring_rank, packed))


PATTERNS: dict[str, CommPattern] = {p.name: p for p in (
    CommPattern("p2p", ring_attention, _ring_steps),
    CommPattern("all_gather", all_gather_attention, _all_gather_steps),
    CommPattern("a2a", a2a_attention, lambda layout, rank, a2a_size, packed=False: _a2a_steps(layout, rank,
                                                                                                layout.size, packed),
                splits_heads=True),
    CommPattern("a2a+p2p", a2a_attention, _a2a_steps, hierarchical=True, splits_heads=True),
)}
"""Every communication pattern by ``cp_comm_type`` (Transformer Engine's and Megatron-LM's names)."""

_HIERARCHICAL = tuple(name for name, pattern in PATTERNS.items() if pattern.hierarchical)
if tuple(PATTERNS) != CP_COMM_TYPES or _HIERARCHICAL != HIERARCHICAL_COMM_TYPES:
    raise ImportError(f"ops.patterns.PATTERNS {list(PATTERNS)} (hierarchical: {list(_HIERARCHICAL)}) must match "
                      f"cp_handler.core.comm_types {list(CP_COMM_TYPES)} (hierarchical: "
                      f"{list(HIERARCHICAL_COMM_TYPES)}): name a new pattern there")
