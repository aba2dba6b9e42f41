"""Dynamic CP with ``"auto"``: the CP size *and* the pattern of each sequence from one cost model.

:class:`PatternWorkload` is a workload for :func:`~cp_handler.dynamic.schedule_sequences`: ``cost(seq_len, cp)``
is the predicted time of the fastest pattern (:func:`~.choice.choose_comm_type`) for one sequence alone on a group
of ``cp`` (``cp = 1``: the sequence on one rank, nothing communicated), times the layers, plus the rest of the
layers' work per token split over the group. The scheduler then gives a sequence the size that finishes it first
for the whole batch, so a short one stays unsharded when communication would cost more than it saves; the packs'
handlers, built with ``cp_comm_type="auto"``, pick the pattern for each pack from the same profile.

The predictions are tabulated per group size on a grid of lengths (every length to 16 tokens, then
:data:`POINTS_PER_OCTAVE` per doubling) and interpolated linearly between neighbours, per pattern: a schedule of
1,024 documents then prices every document at every size in one vectorised call instead of a prediction each (a
prediction takes 0.1-5 ms). The table is built as lengths first need it (``cp-bench`` and tests/test_dynamic_
scheduler.py measure its error against the predictions it interpolates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..core.masks import CAUSAL, AttentionMask
from .choice import choose_comm_type
from .pattern_work import AttnCase
from .profile import CostProfile

POINTS_PER_OCTAVE = 8
"""Grid points of the cost table per doubling of the length (neighbours 9% apart), above 16 tokens (module doc)."""


def length_grid(top: int) -> list[int]:
    """The cost table's lengths from 1 up to the first point >= ``top``."""
    points = list(range(1, 17))
    k = 1
    while points[-1] < top:
        point = round(16 * 2 ** (k / POINTS_PER_OCTAVE))
        if point > points[-1]:
            points.append(point)
        k += 1
    return points


@dataclass(frozen=True)
class PatternWorkload:
    """``cost(seq_len, cp)`` in milliseconds (module doc).

    Attributes:
        profile: the cost profile; dtype: the attention's dtype name; heads, kv_heads, head_dim, v_head_dim:
        the attention shape; element_bytes: bytes per element; layers: attention layers per forward;
        linear_ms_per_token: everything else of one forward + backward per token (projections, MLP), split over
        the group; mask: the layers' mask.
    """

    profile: CostProfile
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    element_bytes: int
    layers: int = 1
    linear_ms_per_token: float = 0.0
    mask: AttentionMask = CAUSAL

    tables: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Per group size: the grid's lengths, each pattern's predicted milliseconds there, the patterns' names."""

    def comm_type(self, seq_len: int, cp: int) -> str:
        """The pattern of least tabulated cost for one sequence of ``seq_len`` on a group of ``cp``."""
        per_pattern, names = self._interpolated(torch.tensor([seq_len], dtype=torch.float64), cp)
        return names[int(per_pattern[0].argmin())]

    def comm_types(self, lengths: list[int], sizes: list[int]) -> list[str]:
        """:meth:`comm_type` of each ``(lengths[i], sizes[i])``: one interpolation per distinct size."""
        out = [""] * len(lengths)
        for cp in set(sizes):
            rows = [i for i, c in enumerate(sizes) if c == cp]
            per_pattern, names = self._interpolated(torch.tensor([lengths[i] for i in rows], dtype=torch.float64), cp)
            for i, best in zip(rows, per_pattern.argmin(dim=1).tolist(), strict=True):
                out[i] = names[best]
        return out

    def cost(self, seq_len: int, cp: int) -> float:
        return self.costs([seq_len], [cp])[0, 0].item()

    def costs(self, lengths: list[int], sizes: list[int]) -> torch.Tensor:
        """Milliseconds of every length (rows) at every group size (columns), float64: the layers times the
        cheapest pattern's interpolated prediction, plus the rest of the layers per token over the group."""
        n = torch.tensor(lengths, dtype=torch.float64)
        out = torch.empty(len(lengths), len(sizes), dtype=torch.float64)
        for j, cp in enumerate(sizes):
            per_pattern, _ = self._interpolated(n, cp)
            out[:, j] = self.layers * per_pattern.min(dim=1).values + self.linear_ms_per_token * n / cp
        return out

    def _interpolated(self, n: torch.Tensor, cp: int) -> tuple[torch.Tensor, list[str]]:
        """``(len(n), patterns)`` predicted milliseconds per layer at lengths ``n`` (float64), linear between the
        grid's neighbours."""
        grid, table, names = self._table(cp, int(n.max()) if len(n) else 1)
        upper = torch.searchsorted(grid, n).clamp(1, len(grid) - 1)
        lower = upper - 1
        frac = ((n - grid[lower]) / (grid[upper] - grid[lower]))[:, None]
        return table[lower] + frac * (table[upper] - table[lower]), names

    def _table(self, cp: int, top: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        table = self.tables.get(cp)
        if table is None or table[0][-1] < top:  # a grid to twice the old top at least; the known points are cached
            choices = [(n, self._choice(n, cp)) for n in
                       length_grid(top if table is None else max(top, 2 * int(table[0][-1])))]
            self.tables[cp] = (torch.tensor([n for n, _ in choices], dtype=torch.float64),
                               torch.tensor([[p.total_ms for p in c.predictions] for _, c in choices],
                                            dtype=torch.float64),
                               [p.comm_type for p in choices[0][1].predictions])
        return self.tables[cp]

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - frozen, hashable; the table asks each grid point once
    def _choice(self, seq_len: int, cp: int):
        case = AttnCase((seq_len,), 1, self.heads, self.kv_heads, self.head_dim, self.v_head_dim, self.element_bytes,
                        self.mask, cp)
        return choose_comm_type(case, self.profile, self.dtype)
