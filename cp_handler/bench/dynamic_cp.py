"""Dynamic vs static CP on the stdlib length distribution (``python -m cp_handler.bench.dynamic_cp``).

Static CP is the same scheduler with every group at the size the longest sequence needs
(``min_dynamic_context_parallel_size`` = that size), i.e. a fixed CP degree with data parallelism
over the rest. Per rank count: estimated makespan per global batch (sum over micro-batches of
the slowest group, :class:`~cp_handler.dynamic.Workload` units) against its lower bound (total
work / ranks), idle fraction (rank-time not spent on work) and padding fraction (tokens added to
reach multiples of 2*cp). Then the measured step time of ``cp-train`` at 4 ranks both ways, and the
scheduler's run time for 4096 sequences on 1024 ranks. Prints markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from ..cli.data import collect_files, read_token_stream
from ..dynamic import Workload, schedule_sequences
from ..dynamic.scheduler import cp_size_for, padded_len


def stdlib_lengths(cap: int, max_bytes: int) -> list[int]:
    stream, starts = read_token_stream(collect_files(None), max_bytes)
    bounds = [*starts.tolist(), stream.numel()]
    return [min(cap, e - s - o) for s, e in zip(bounds[:-1], bounds[1:], strict=True) for o in range(0, e - s, cap)]


def estimate(lengths, ranks, budget, min_size, workload) -> dict:
    schedule = schedule_sequences(lengths, ranks, budget, min_size, workload)
    makespan = sum(max(g.cost for g in mb.groups) for mb in schedule.micro_batches)
    work = sum(workload.cost(n, 1) for n in lengths)
    padded = sum(padded_len(n, c) for n, c in zip(lengths, schedule.cp_sizes, strict=True))
    return {"micro_batches": len(schedule.micro_batches), "makespan": makespan, "lower_bound": work / ranks,
            "makespan_over_bound": makespan * ranks / work, "idle_fraction": 1 - work / (ranks * makespan),
            "padding_fraction": padded / sum(lengths) - 1}


def measured_step_time(min_cp: int, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        subprocess.run([sys.executable, "-m", "cp_handler.cli.train", "--nproc", "4", "--dynamic-cp",
                        "--max-seqlen-per-rank", str(args.budget), "--seq-len", str(args.cap), "--min-cp-size",
                        str(min_cp), "--steps", str(args.steps), "--batch-size", "2", "--metrics-out", out],
                       check=True, capture_output=True)
        steps = json.load(open(out))["steps"][1:]
    return statistics.median(s["step_time_s"] for s in steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cp_handler.bench.dynamic_cp", description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=int, default=2048, help="documents cut at this many tokens")
    p.add_argument("--budget", type=int, default=512, help="max_seqlen_per_dp_cp_rank")
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 64, 1024])
    p.add_argument("--steps", type=int, default=6, help="cp-train steps for the measured comparison (0: skip)")
    p.add_argument("--out", default="runs/bench_dynamic_cp.json")
    args = p.parse_args(argv)
    workload, rng = Workload(), random.Random(0)
    lengths = stdlib_lengths(args.cap, 32 << 20)
    static_cp = cp_size_for(args.cap, args.budget, 1, max(args.ranks))
    result = {"cap": args.cap, "budget": args.budget, "static_cp": static_cp, "estimates": []}
    print(f"{len(lengths)} stdlib documents cut at {args.cap} tokens; budget {args.budget} tokens/rank; "
          f"static CP = {static_cp} (what the longest needs)\n")
    print("| ranks | sequences | mode | micro-batches | makespan / lower bound | idle | padding |")
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        batch = rng.sample(lengths, min(len(lengths), 2 * ranks))
        for mode, min_size in (("dynamic", 1), ("static", min(static_cp, ranks))):
            est = {"ranks": ranks, "sequences": len(batch), "mode": mode,
                   **estimate(batch, ranks, args.budget, min_size, workload)}
            result["estimates"].append(est)
            print(f"| {ranks} | {len(batch)} | {mode} | {est['micro_batches']} | {est['makespan_over_bound']:.2f} "
                  f"| {100 * est['idle_fraction']:.1f}% | {100 * est['padding_fraction']:.1f}% |")
    big = rng.choices(lengths, k=4096)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        schedule_sequences(big, 1024, args.budget, 1, workload)
        times.append(time.perf_counter() - start)
    result["scheduler_ms_4096_seqs_1024_ranks"] = 1e3 * statistics.median(times)
    print(f"\nscheduler: 4096 sequences on 1024 ranks in {result['scheduler_ms_4096_seqs_1024_ranks']:.1f} ms "
          "(median of 5)")
    if args.steps:
        dyn, sta = measured_step_time(1, args), measured_step_time(min(static_cp, 4), args)
        result["measured_4_ranks"] = {"dynamic_step_s": dyn, "static_step_s": sta, "speedup": sta / dyn}
        print(f"\nmeasured, cp-train at 4 ranks (median step, {args.steps} steps, first excluded): dynamic "
              f"{dyn:.3f} s, static (cp={min(static_cp, 4)}) {sta:.3f} s, speedup {sta / dyn:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
