"""Dynamic CP with ``"auto"``: the CP size *and* the pattern of each sequence from one cost model.

:class:`PatternWorkload` is a workload for :func:`~cp_handler.dynamic.schedule_sequences`: ``cost(seq_len, cp)``
is the predicted time of the fastest pattern (:func:`~.choice.choose_comm_type`) for one sequence alone on a group
of ``cp`` (``cp = 1``: the sequence on one rank, nothing communicated), times the layers, plus the rest of the
layers' work per token split over the group. The scheduler then gives a sequence the size that finishes it first
for the whole batch, so a short one stays unsharded when communication would cost more than it saves; the packs'
handlers, built with ``cp_comm_type="auto"``, pick the pattern for each pack from the same profile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core.masks import CAUSAL, AttentionMask
from .choice import choose_comm_type
from .pattern_work import AttnCase
from .profile import CostProfile


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

    def comm_type(self, seq_len: int, cp: int) -> str:
        """The pattern "auto" runs one sequence of ``seq_len`` on a group of ``cp`` with."""
        return self._choice(seq_len, cp).comm_type

    def cost(self, seq_len: int, cp: int) -> float:
        best = min(p.total_ms for p in self._choice(seq_len, cp).predictions)
        return self.layers * best + self.linear_ms_per_token * seq_len / cp

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - frozen, hashable; a schedule asks the same lengths often
    def _choice(self, seq_len: int, cp: int):
        case = AttnCase((seq_len,), 1, self.heads, self.kv_heads, self.head_dim, self.v_head_dim, self.element_bytes,
                        self.mask, cp)
        return choose_comm_type(case, self.profile, self.dtype)
