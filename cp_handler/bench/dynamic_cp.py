"""Dynamic CP benchmarks (``python -m cp_handler.bench.dynamic_cp``): tables and JSON.

1. **Scheduler quality**: the Python stdlib's file sizes (tokens) cut at 32768,
   4096 tokens per rank, cost ``L^2 / cp`` for every scheduler; makespan (sum over micro-batches of
   the busiest rank) over the lower bound ``sum L^2 / ranks``, and scheduling time; median of 5
   draws; Megatron-LM's ``BalancedCPScheduler`` beside ours where megatron-core is installed
   (:mod:`.megatron_peer`), else marked not run.
2. **Simulated step time**, dynamic vs static CP, with the GPU cost model
   (:class:`~cp_handler.dynamic.CostModel`) fitted to a measured per-rank table (default: the H100
   table in cp_handler/dynamic/rank_times/h100_ring_rank_times.csv, shipped in the wheel): one Llama-3-8B layer
   forward+backward
   on a long-context mix (stdlib file sizes cut at 131072 tokens: median 6.5k, a tail to 128k),
   ``--sim-budgets`` tokens per rank, so static CP is what the longest needs (16 at 8192: two
   8-GPU nodes; 8 at 16384: one node); per rank count the median over draws of the estimated step
   time of both and the speedup.
3. **Measured** ``cp-train`` at 4 CPU ranks, dynamic vs static (every sequence at the size the
   longest needs, 4): tokens/s of both and the largest relative difference of their loss curves.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from ..cli.common import write_output
from ..cli.flag_names import FlagParser
from ..dynamic import CostModel, Workload, schedule_sequences
from ..dynamic.scheduler import cp_size_for, group_sizes
from ..training.data import stdlib_files
from .megatron_peer import load_balanced_cp_scheduler, megatron_makespan, megatron_version

RANK_TIMES = os.path.join(os.path.dirname(__file__), "..", "dynamic", "rank_times", "h100_ring_rank_times.csv")
QUALITY_CASES = ((8, 512), (32, 512), (256, 2048), (1024, 4096))


def stdlib_lengths(cap: int) -> list[int]:
    """Token counts of the stdlib files (bytes plus the end-of-document token), cut at ``cap``."""
    return [min(cap, p.stat().st_size + 1) for p in stdlib_files()]


def draw_lengths(sizes: list[int], n: int, seed: int) -> list[int]:
    """``n`` lengths drawn (with replacement, seeded) from ``sizes``."""
    rng = random.Random(seed)
    return [rng.choice(sizes) for _ in range(n)]


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, 1e3 * (time.perf_counter() - start)


def scheduler_quality(draws: int) -> list[dict]:
    sizes, square = stdlib_lengths(32768), Workload(quadratic=1.0, linear=0.0)
    megatron, reason = load_balanced_cp_scheduler()
    rows = []
    for ranks, n in QUALITY_CASES:
        ours, peer = [], []
        for seed in range(draws):
            lengths = draw_lengths(sizes, n, seed)
            bound = sum(x * x for x in lengths) / ranks
            schedule, ms = _timed(lambda lengths=lengths, r=ranks: schedule_sequences(lengths, r, 4096, 1, square))
            ours.append((schedule.makespan / bound, ms))
            if megatron:
                makespan, ms = _timed(lambda lengths=lengths, r=ranks: megatron_makespan(megatron, lengths, r, 4096))
                peer.append((makespan / bound, ms))
        row = {"ranks": ranks, "sequences": n, "ours_over_bound": statistics.median(r for r, _ in ours),
               "ours_worst": max(r for r, _ in ours), "ours_ms": statistics.median(t for _, t in ours)}
        if peer:
            row.update(megatron_over_bound=statistics.median(r for r, _ in peer),
                       megatron_worst=max(r for r, _ in peer), megatron_ms=statistics.median(t for _, t in peer),
                       megatron_version=megatron_version())
        else:
            row["megatron"] = f"not run: {reason}"
        rows.append(row)
    return rows


def simulate(model: CostModel, ranks_list: list[int], budget: int, docs_per_rank: int, draws: int) -> list[dict]:
    model = replace(model, budget=budget)
    sizes = stdlib_lengths(131072)
    static_cp = cp_size_for(max(sizes), budget, group_sizes(max(ranks_list), rule="powers_of_two"))
    rows = []
    for ranks in ranks_list:
        times = {"dynamic": [], "static": []}
        for seed in range(draws):
            lengths = draw_lengths(sizes, docs_per_rank * ranks, seed)
            fixed = min(static_cp, ranks)
            for mode, (low, high) in (("dynamic", (1, None)), ("static", (fixed, fixed))):
                times[mode].append(schedule_sequences(lengths, ranks, budget, low, model, high).makespan)
        dynamic, static = statistics.median(times["dynamic"]), statistics.median(times["static"])
        rows.append({"budget": budget, "ranks": ranks, "static_cp": min(static_cp, ranks),
                     "documents": docs_per_rank * ranks, "dynamic_ms": dynamic, "static_ms": static,
                     "speedup": static / dynamic})
    return rows


def _cp_train(min_cp: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        static = ["--max-cp-size", str(min_cp)] if min_cp > 1 else []
        subprocess.run([sys.executable, "-m", "cp_handler.cli.train", "--nproc", "4", "--dynamic-cp",
                        "--max-seqlen-per-rank", str(args.budget), "--seq-len", str(4 * args.budget), "--min-cp-size",
                        str(min_cp), *static, "--steps", str(args.steps), "--batch-size", "4", "--metrics-out", out],
                       check=True, capture_output=True)
        with open(out) as f:
            return json.load(f)


def measured(args) -> dict:
    dynamic, static = _cp_train(1, args), _cp_train(4, args)
    curves = [(a["loss"], b["loss"]) for a, b in zip(dynamic["steps"], static["steps"], strict=True)]
    return {"budget": args.budget, "cap": 4 * args.budget, "steps": args.steps,
            "dynamic_tokens_per_s": dynamic["tokens_per_s_mean"], "static_tokens_per_s": static["tokens_per_s_mean"],
            "speedup": dynamic["tokens_per_s_mean"] / static["tokens_per_s_mean"],
            "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in curves),
            "dynamic_loss": [a for a, _ in curves], "static_loss": [b for _, b in curves]}


def report(result: dict) -> str:
    lines = ["| ranks | sequences | ours / bound (median, worst) | ours ms | Megatron / bound (median, worst) "
             "| Megatron ms |", "|---|---|---|---|---|---|"]
    for r in result["quality"]:
        peer = (f"{r['megatron_over_bound']:.4f}, {r['megatron_worst']:.4f} | {r['megatron_ms']:.1f}"
                if "megatron_over_bound" in r else f"{r['megatron']} | -")
        lines.append(f"| {r['ranks']} | {r['sequences']} | {r['ours_over_bound']:.4f}, {r['ours_worst']:.4f} "
                     f"| {r['ours_ms']:.1f} | {peer} |")
    fit = result["cost_model"]["fit_error"]
    lines += ["", f"Cost model fitted to {result['rank_times']} ({fit['rows']} rows): median relative error "
              f"{fit['median_rel']:.3f}, max {fit['max_rel']:.3f}", "",
              "| tokens/rank | ranks | static CP | documents | dynamic ms | static ms | speedup |",
              "|---|---|---|---|---|---|---|"]
    for r in result["simulation"]:
        lines.append(f"| {r['budget']} | {r['ranks']} | {r['static_cp']} | {r['documents']} | {r['dynamic_ms']:.1f} "
                     f"| {r['static_ms']:.1f} | {r['speedup']:.2f} |")
    if "measured" in result:
        m = result["measured"]
        lines += ["", f"cp-train, 4 CPU ranks, budget {m['budget']}, documents cut at {m['cap']} (static CP 4), "
                  f"{m['steps']} steps: dynamic {m['dynamic_tokens_per_s']:.0f} tokens/s, static "
                  f"{m['static_tokens_per_s']:.0f} tokens/s ({m['speedup']:.2f}x); loss curves differ by at most "
                  f"{m['max_loss_rel_diff']:.1e} (relative)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = FlagParser(prog="python -m cp_handler.bench.dynamic_cp", description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=5)
    p.add_argument("--rank-times", default=RANK_TIMES, help="per-rank plan times (CSV like the H100 table)")
    p.add_argument("--column", default="rank_fa2_ms", help="which kernel's column of --rank-times to fit")
    p.add_argument("--sim-ranks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--sim-budgets", type=int, nargs="+", default=[8192, 16384],
                   help="tokens per rank in the simulation (one table block each)")
    p.add_argument("--docs-per-rank", type=int, default=4)
    p.add_argument("--budget", type=int, default=512, help="max_seqlen_per_rank of the measured cp-train runs")
    p.add_argument("--steps", type=int, default=8, help="cp-train steps of the measured comparison (0: skip)")
    p.add_argument("--out", default="runs/bench_dynamic_cp.json")
    args = p.parse_args(argv)
    model = CostModel.from_rank_times_csv(args.rank_times, args.column)
    result = {"command": "python -m cp_handler.bench.dynamic_cp " + " ".join(sys.argv[1:] if argv is None else argv),
              "quality": scheduler_quality(args.draws), "rank_times": f"{os.path.basename(args.rank_times)} "
              f"({args.column})", "cost_model": model.describe(),
              "simulation": [row for budget in args.sim_budgets
                             for row in simulate(model, args.sim_ranks, budget, args.docs_per_rank, args.draws)]}
    if args.steps:
        result["measured"] = measured(args)
    print(report(result))
    return 0 if write_output("python -m cp_handler.bench.dynamic_cp", "--out", args.out, result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
