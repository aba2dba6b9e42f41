"""``cp-bench --modes auto``: every pattern measured beside the cost model's prediction and ``"auto"``'s pick.

A grid of attention layers (:data:`GRIDS`; the full one: tokens 1k-16k, cp 2 and 4 with ``a2a+p2p`` over ``[2, 2]``
at 4, heads 8/8, 16/2 and 8/1, head dims 64 and 128, causal, a window of 512 and thd packs of 8 documents) runs on
CP ranks of this machine (one launch per cp size, the threads per rank cp-train gives them, float32 on CPU). For
each case every candidate pattern (:func:`~cp_handler.auto.candidates`) runs forward + backward through the local
handler (:func:`~cp_handler.bench.calibrate.handler_step`, as the calibration times a pattern), the repetitions
interleaved across the patterns (drift hits them alike), each between two barriers, the
slowest rank's time kept; the median of ``--reps`` is the measured time. Beside it: the profile's prediction
(:func:`~cp_handler.auto.predict`) and ``"auto"``'s pick (:func:`~cp_handler.auto.choose_comm_type`; the handler
built with ``cp_comm_type="auto"`` runs exactly the picked pattern's code, so its measured time is that pattern's).

Scores (the issue's targets): the share of cases where auto's pick is within 5% of the fastest measured pattern
(and the worst ratio), and the share of (case, pattern) pairs whose prediction is within 25% of the measurement.
The profile: ``--cost-profile`` (a name or JSON), the one ``--calibrate`` measured in the same run, else the
device's default.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..auto import AttnCase, candidates, choose_comm_type, load_profile, predict
from ..auto.catalog import default_profile
from ..core.masks import CAUSAL, AttentionMask
from ..runtime.groups import build_dp_cp_groups
from ..runtime.launch import launch, rank_session
from .calibrate import calibrate, documents, handler_step, levels_of
from .case_progress import case_progress

WINDOW = 512
DOCS = 8


@dataclass(frozen=True)
class GridCase:
    """One attention layer of the grid: global tokens, cp, heads, head dim, the kind (``causal``, ``window`` of
    :data:`WINDOW`, ``sinks``: causal with a sink logit per head, ``thd``: :data:`DOCS` packed documents) and
    whether the group has two levels (``a2a+p2p`` a candidate; at cp >= 4)."""

    tokens: int
    cp: int
    heads: int
    kv_heads: int
    head_dim: int
    kind: str
    levels: bool = True

    def lengths(self) -> tuple[int, ...]:
        return documents(self.tokens, DOCS) if self.kind == "thd" else (self.tokens,)

    def attn_case(self) -> AttnCase:
        mask = AttentionMask(window=WINDOW) if self.kind == "window" else CAUSAL
        return AttnCase(self.lengths(), 1, self.heads, self.kv_heads, self.head_dim, self.head_dim, 4, mask, self.cp,
                        levels_of(self.cp) if self.levels else None)

    def describe(self) -> str:
        flat = "" if self.levels or self.cp < 4 else " flat"
        return f"S={self.tokens} cp={self.cp} H={self.heads}/{self.kv_heads} D={self.head_dim} {self.kind}{flat}"


_SHAPES = {"8/8/64": (8, 8, 64), "16/2/128": (16, 2, 128), "8/1/64": (8, 1, 64)}
_FULL = [(1024, "8/8/64", "causal"), (1024, "16/2/128", "causal"), (1024, "8/1/64", "causal"),
         (4096, "8/8/64", "causal"), (4096, "16/2/128", "causal"), (4096, "8/1/64", "causal"),
         (4096, "8/8/64", "window"), (16384, "8/1/64", "window"), (16384, "16/2/128", "window"),
         (4096, "8/8/64", "thd"), (16384, "8/1/64", "thd"), (8192, "16/2/128", "thd")]
_REGRET_SHAPES = {"8/8/64": (8, 8, 64), "8/2/64": (8, 2, 64), "8/1/64": (8, 1, 64), "16/1/64": (16, 1, 64),
                  "16/2/128": (16, 2, 128)}
_KINDS = ("causal", "window", "sinks", "thd")
GRIDS = {
    "regret": [GridCase(4096, 2, *_REGRET_SHAPES[s], k) for s in _REGRET_SHAPES for k in _KINDS] +
              [GridCase(1024, 2, *_REGRET_SHAPES[s], "causal") for s in ("8/8/64", "8/2/64", "8/1/64", "16/1/64")] +
              [GridCase(4096, 4, *_REGRET_SHAPES[s], k, levels) for levels in (False, True)
               for s in ("8/8/64", "8/1/64", "16/1/64") for k in _KINDS],
    "full": [GridCase(t, cp, *_SHAPES[s], k) for cp in (2, 4) for t, s, k in _FULL],
    "quick": [GridCase(t, cp, *_SHAPES[s], k) for cp in (2, 4) for t, s, k in _FULL if t <= 4096 and s != "16/2/128"],
    "tiny": [GridCase(256, cp, *_SHAPES[s], k) for cp in (2, 4) for s, k in (("8/8/64", "causal"),
                                                                            ("8/1/64", "thd"))],
}
"""The grids of ``--auto-grid``: ``regret`` (48 cases, issue 72: cp 2 and 4, head ratios 1:1 to 16:1 with fewer KV
heads than ranks, windows, sinks, thd packs, flat and two-level groups at cp 4), ``full`` (24 cases, about 20
minutes on 2 CPU cores), ``quick`` (12 cases of at most 4k tokens), ``tiny`` (4 cases of 256 tokens: the test
suite's)."""


def _interleaved(runs: list, warmup: int, reps: int) -> list[list[float]]:
    for run in runs:
        for _ in range(warmup):
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, own in zip(runs, times, strict=True):
            own.append(slowest_rank_seconds(run) * 1e3)
    return times


def slowest_rank_seconds(fn) -> float:
    """The slowest rank's seconds of ``fn``, every rank starting it together (between two barriers)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def auto_worker(cases: list[GridCase], warmup: int, reps: int) -> list[dict] | None:
    with rank_session("cp-bench", device_type="cpu"):
        world, rank0 = dist.get_world_size(), dist.get_rank() == 0
        groups = build_dp_cp_groups(world, "cpu", list(levels_of(world) or []) or None)
        bar = case_progress(len(cases), f"auto cp={world}", enabled=rank0)
        rows = []
        for case in cases:
            bar.begin(case=case.describe())
            attn_case = case.attn_case()
            names = candidates(attn_case)
            runs = [handler_step(name, attn_case, groups, torch.float32, torch.device("cpu"), seed=case.tokens,
                                 sinks=case.kind == "sinks") for name in names]
            for name, times in zip(names, _interleaved(runs, warmup, reps), strict=True):
                rows.append({**asdict(case), "pattern": name, "median_ms": statistics.median(times),
                             "times_ms": times})
            bar.update(case=case.describe())
        bar.close()
        return rows if rank0 else None


def score(rows: list[dict], profile, dtype: str = "float32") -> dict:
    """Predictions and picks beside the measured rows; the summary of the issue's targets."""
    by_case: dict[tuple, list[dict]] = {}
    for row in rows:
        case = GridCase(*(row[k] for k in ("tokens", "cp", "heads", "kv_heads", "head_dim", "kind", "levels")))
        pred = predict(row["pattern"], case.attn_case(), profile, dtype)
        row.update(predicted_ms=pred.total_ms, predicted_compute_ms=pred.compute_ms, predicted_comm_ms=pred.comm_ms,
                   prediction_error=(pred.total_ms - row["median_ms"]) / row["median_ms"])
        by_case.setdefault(case, []).append(row)
    cases = []
    for case, members in by_case.items():
        pick = choose_comm_type(case.attn_case(), profile, dtype).comm_type
        fastest = min(members, key=lambda r: r["median_ms"])
        picked = next(r for r in members if r["pattern"] == pick)
        cases.append({**asdict(case), "auto": pick, "fastest": fastest["pattern"],
                      "auto_over_fastest": picked["median_ms"] / fastest["median_ms"]})
    ratios = [c["auto_over_fastest"] for c in cases]
    errors = [abs(r["prediction_error"]) for r in rows]
    return {"cases": cases, "summary": {
        "cases": len(cases), "regret_mean": statistics.fmean(ratios), "regret_worst": max(ratios),
        "auto_within_5pct": sum(r <= 1.05 for r in ratios) / len(ratios),
        "auto_within_15pct": sum(r <= 1.15 for r in ratios) / len(ratios), "auto_worst_ratio": max(ratios),
        "pairs": len(rows), "prediction_within_25pct": sum(e <= 0.25 for e in errors) / len(errors),
        "prediction_median_abs_error": statistics.median(errors)}}


def run_calibrate(args) -> dict:
    """``--modes calibrate`` / ``--calibrate``: a profile of this machine at ``--calibrate-cp-sizes``, written to
    ``<out-dir>/cost_profile.json``."""
    profile = calibrate(args.calibrate_cp_sizes, args.calibrate_dtype, args.device, reps=args.reps,
                        progress=lambda text: print(f"cp-bench: {text}", flush=True))
    path = os.path.join(args.out_dir, "cost_profile.json")
    profile.save(path)
    return {"path": path, "profile": profile.to_json()}


def _profile(args):
    if args.cost_profile:
        return load_profile(args.cost_profile)
    calibrated = os.path.join(args.out_dir, "cost_profile.json")
    if "calibrate" in args.modes and os.path.isfile(calibrated):
        return load_profile(calibrated)
    return default_profile("cpu")


def run(args) -> dict:
    """``--modes auto``: the grid ``--auto-grid`` on CPU ranks, scored (module doc)."""
    profile = _profile(args)
    grid = GRIDS[args.auto_grid]
    rows = []
    for cp in sorted({c.cp for c in grid}):
        rows += launch(auto_worker, cp, [c for c in grid if c.cp == cp], args.warmup, args.reps,
                       program="cp-bench")[0]
    return {"profile": profile.name, "profile_source": profile.source, "grid": args.auto_grid, "rows": rows,
            **score(rows, profile)}
