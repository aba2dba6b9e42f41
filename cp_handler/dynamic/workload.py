"""Workload model of one sequence on a CP group: time ~ a * L^2 / cp + b * L / cp.

``a`` prices causal attention (quadratic in the sequence length ``L``), ``b`` everything linear
(projections, MLP, norms, communication per token); both are split over the ``cp`` ranks of the
group. Fit them on the running machine from measured step times with :meth:`Workload.fit`
(least squares). It prices splitting as free; :class:`~.cost_model.CostModel` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    """``cost(L, cp) = quadratic * L**2 / cp + linear * L / cp`` (units of the fitted times)."""

    quadratic: float = 1.0 / 4096
    linear: float = 1.0

    def cost(self, seq_len: int, cp: int) -> float:
        return (self.quadratic * seq_len * seq_len + self.linear * seq_len) / cp

    def costs(self, lengths: list[int], sizes: list[int]) -> torch.Tensor:
        """:meth:`cost` of every length (rows) at every size (columns), float64."""
        n = torch.tensor(lengths, dtype=torch.float64)[:, None]
        return (self.quadratic * n * n + self.linear * n) / torch.tensor(sizes, dtype=torch.float64)[None, :]

    @classmethod
    def fit(cls, seq_lens: list[int], cp_sizes: list[int], times: list[float]) -> Workload:
        """Least-squares fit of the two coefficients to measured ``times`` (>= 2 distinct lengths).

        Raises:
            ValueError: fewer than two measurements or mismatched lengths.
        """
        if len(seq_lens) < 2 or not len(seq_lens) == len(cp_sizes) == len(times):
            raise ValueError("Workload.fit needs >= 2 measurements of (seq_len, cp, time), equally many of each")
        length = torch.tensor(seq_lens, dtype=torch.float64)
        cp = torch.tensor(cp_sizes, dtype=torch.float64)
        design = torch.stack([length * length / cp, length / cp], dim=1)
        coeffs = torch.linalg.lstsq(design, torch.tensor(times, dtype=torch.float64)[:, None]).solution[:, 0]
        return cls(quadratic=max(coeffs[0].item(), 0.0), linear=max(coeffs[1].item(), 0.0))
