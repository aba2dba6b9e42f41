"""Per-rank time of a sequence on a CP group, with what splitting costs: a model fitted to measurements.

``L ^ 2 / cp`` says that splitting is free. It is not: a ring rank runs ``cp`` steps, each with
kernel launches, merges and copies, so a short sequence over many ranks is launch-bound (one H100:
512 tokens per rank at cp=16 ran at 2% of the whole-sequence kernel's efficiency), and its K/V
travel ``cp - 1`` times. :class:`CostModel` prices one transformer layer's forward + backward of one
sequence on one rank of a CP group, in milliseconds:

* attention: ``whole(L) = w0 + w1 L^2`` at cp=1 (one whole-sequence kernel) and
  ``plan(L, cp) = k0 cp + k1 L^2 / cp + k2 L / cp`` at cp > 1 (a ring plan: ``k0`` per step), fitted
  by least squares on relative error to a measured table (:meth:`CostModel.fit`; the H100 table of
  ``../shared/data/h100_ring_rank_times.csv`` via :meth:`from_rank_times_csv`, or ``cp-bench
  --modes plan`` JSON of the user's own GPU via :meth:`from_plan_json`);
* communication of the ring: ``(cp - 1) * 4 * (L / cp) * kv_bytes_per_token`` bytes per rank (K/V
  forward, K/V again and fp32 dK/dV backward) over the group's link (``intra_node_gbps`` while the
  group fits in ``gpus_per_node``, else ``inter_node_gbps``), overlapped with the attention (the
  slower of the two counts);
* everything else in the layer (projections, MLP): ``linear_ms_per_token * L / cp``.

In a pack (thd) the per-step overhead ``k0 cp`` is paid once per pack, so a sequence is charged the
share of it that its tokens take of a pack of ``budget`` tokens per rank. ``cost(L, cp)`` is what
the scheduler balances (:func:`~.scheduler.schedule_sequences`).
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass, replace

import torch

LLAMA3_8B_LINEAR_MS_PER_TOKEN = 6 * 218e6 / 400e12 * 1e3
"""Projections and MLP of one Llama-3-8B layer (218 M parameters): 6 FLOP per parameter and token
forward + backward at an assumed 400 TFLOP/s (about 40% of an H100's dense bf16 peak); an
assumption, not a measurement."""


@dataclass(frozen=True)
class CostModel:
    """Milliseconds of one layer's forward + backward of one sequence on one rank (module doc)."""

    whole_overhead_ms: float = 0.0
    whole_quadratic_ms: float = 5.4e-8
    step_overhead_ms: float = 0.0
    quadratic_ms: float = 5.4e-8
    linear_attention_ms: float = 0.0
    linear_ms_per_token: float = LLAMA3_8B_LINEAR_MS_PER_TOKEN
    kv_bytes_per_token: float = 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0
    gpus_per_node: int = 8
    budget: int = 16384
    fit_error: dict | None = None

    def attention_ms(self, seq_len: int, cp: int, overhead_share: float | None = None) -> float:
        """Compute time of the attention (no communication). ``overhead_share``: the part of the
        pack's fixed overhead this sequence pays (default: its tokens' share of a full pack; 1 for a
        sequence alone)."""
        share = (seq_len / cp) / self.budget if overhead_share is None else overhead_share
        if cp == 1:
            return self.whole_overhead_ms * share + self.whole_quadratic_ms * seq_len**2
        return (self.step_overhead_ms * cp * share + self.quadratic_ms * seq_len**2 / cp
                + self.linear_attention_ms * seq_len / cp)

    def comm_ms(self, seq_len: int, cp: int) -> float:
        """Ring traffic of one rank over its group's link (0 at cp=1)."""
        if cp == 1:
            return 0.0
        gbps = self.intra_node_gbps if cp <= self.gpus_per_node else self.inter_node_gbps
        return (cp - 1) * 4 * (seq_len / cp) * self.kv_bytes_per_token / (gbps * 1e9) * 1e3

    def cost(self, seq_len: int, cp: int) -> float:
        return self.linear_ms_per_token * seq_len / cp + max(self.attention_ms(seq_len, cp), self.comm_ms(seq_len, cp))

    def costs(self, lengths: list[int], sizes: list[int]) -> torch.Tensor:
        """:meth:`cost` of every length (rows) at every size (columns), float64 (the same formulas, vectorised)."""
        n = torch.tensor(lengths, dtype=torch.float64)[:, None]
        c = torch.tensor(sizes, dtype=torch.float64)[None, :]
        share = (n / c) / self.budget
        attention = torch.where(c == 1, self.whole_overhead_ms * share + self.whole_quadratic_ms * n**2,
                                self.step_overhead_ms * c * share + self.quadratic_ms * n**2 / c
                                + self.linear_attention_ms * n / c)
        gbps = torch.where(c <= self.gpus_per_node, self.intra_node_gbps, self.inter_node_gbps)
        comm = (c - 1) * 4 * (n / c) * self.kv_bytes_per_token / (gbps * 1e9) * 1e3
        return self.linear_ms_per_token * n / c + torch.maximum(attention, comm)

    def rank_plan_ms(self, seq_len: int, cp: int) -> float:
        """One sequence alone (its own pack): what the measured tables time."""
        return self.attention_ms(seq_len, cp, overhead_share=1.0)

    @classmethod
    def fit(cls, rows: list[tuple[int, int, float]], **fixed) -> CostModel:
        """Fit the attention coefficients to ``(seq_len, cp, milliseconds)`` rows of one rank's
        plan (cp=1: the whole-sequence kernel), minimising relative error. ``fixed``: the other fields.

        Raises:
            ValueError: fewer than two cp=1 rows or three cp > 1 rows.
        """
        whole = [(n, t) for n, c, t in rows if c == 1]
        split = [(n, c, t) for n, c, t in rows if c > 1]
        if len(whole) < 2 or len(split) < 3:
            raise ValueError(f"CostModel.fit needs >= 2 rows at cp=1 and >= 3 at cp > 1, got {len(whole)} and "
                             f"{len(split)}")
        w0, w1 = relative_lstsq([[1.0, n * n] for n, _ in whole], [t for _, t in whole])
        k0, k1, k2 = relative_lstsq([[c, n * n / c, n / c] for n, c, _ in split], [t for *_, t in split])
        model = cls(whole_overhead_ms=w0, whole_quadratic_ms=w1, step_overhead_ms=k0, quadratic_ms=k1,
                    linear_attention_ms=k2, **fixed)
        errors = [abs(model.rank_plan_ms(n, c) - t) / t for n, c, t in rows]
        return replace(model, fit_error={"rows": len(rows), "median_rel": statistics.median(errors),
                                         "max_rel": max(errors)})

    @classmethod
    def from_rank_times_csv(cls, path: str, column: str = "rank_fa2_ms", **fixed) -> CostModel:
        """From a table like ``h100_ring_rank_times.csv`` (``seq_len_total``, ``cp``, ``column``)."""
        with open(path) as f:
            rows = [(int(r["seq_len_total"]), int(r["cp"]), float(r[column])) for r in csv.DictReader(f)]
        return cls.fit(rows, **fixed)

    @classmethod
    def from_plan_json(cls, path: str, pattern: str = "p2p", qkv_format: str = "bshd", **fixed) -> CostModel:
        """From ``cp-bench --modes plan`` results (its ``whole`` rows are the cp=1 rows)."""
        with open(path) as f:
            results = json.load(f)["plan"]["rows"]
        rows = [(r["seq_len"], 1 if r["pattern"] == "whole" else r["cp_size"], r["median_ms"]) for r in results
                if r["qkv_format"] == qkv_format and r["pattern"] in ("whole", pattern)]
        return cls.fit(rows, **fixed)

    def describe(self) -> dict:
        return asdict(self)


def relative_lstsq(design: list[list[float]], times: list[float], clamp: bool = True) -> list[float]:
    """Least squares of ``design @ x = times`` on relative residuals; coefficients clamped at >= 0 (``clamp``)."""
    a = torch.tensor(design, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    solution = torch.linalg.lstsq(a / t[:, None], torch.ones_like(t)[:, None]).solution[:, 0]
    return [max(v, 0.0) for v in solution.tolist()] if clamp else solution.tolist()
