"""Dynamic CP's solver against its lower bound (``python -m cp_handler.bench.dynamic_solver``): a table and JSON.

For each length mix (:data:`MIXES`), rank count and batch size: the makespan of
:func:`~cp_handler.dynamic.schedule_sequences` over its lower bound (:func:`~cp_handler.dynamic.scheduler.
makespan_bound`, which counts compute and transfer through the same cost model), median and worst over seeded
draws; the solver's milliseconds on one thread (median, the cost table already built: its one-off build time is
reported apart); and against the same solver restricted to power-of-two groups, the ratio of the two bounds (what
other group sizes can gain at most) and of the two makespans (what they gained).

The cost model: :class:`~cp_handler.auto.workload.PatternWorkload` on a named profile (default ``h100-nvlink``:
modelled, docs/auto_plan.md), Llama-3-8B attention (32 query, 8 key-value heads of 128, bf16) and its other layers'
work per token (:data:`~cp_handler.dynamic.cost_model.LLAMA3_8B_LINEAR_MS_PER_TOKEN`, an assumption), one layer.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..auto.catalog import load_profile
from ..auto.workload import PatternWorkload
from ..cli.common import write_output
from ..cli.flag_names import FlagParser
from ..dynamic.cost_model import LLAMA3_8B_LINEAR_MS_PER_TOKEN
from ..dynamic.scheduler import schedule_sequences


def _lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def longalign_like(rng: random.Random) -> int:
    """A long tail: 10% long documents, log-uniform over 8k-64k tokens (LongAlign-10k's range, arXiv 2401.18058),
    in a mix of short chat turns (log-normal, median 700 tokens, sigma 1, cut at 8k), as LongAlign trains."""
    return _log_uniform(rng, 8192, 65536) if rng.random() < 0.1 else _lognormal(rng, 700, 1.0, 8192)


def chatqa_like(rng: random.Random) -> int:
    """A mix: 70% conversational QA with retrieved context (log-normal, median 1.5k, sigma 0.6, cut at 4k), 25%
    4k-16k (uniform), 5% long-context SFT of 32k-128k (log-uniform), as ChatQA 2 mixes them (arXiv 2407.14482)."""
    u = rng.random()
    if u < 0.05:
        return _log_uniform(rng, 32768, 131072)
    return rng.randint(4096, 16384) if u < 0.3 else _lognormal(rng, 1500, 0.6, 4096)


def sft_short(rng: random.Random) -> int:
    """99.9% short SFT samples (log-normal, median 400, sigma 0.8, cut at 4k), 0.1% of 64k-128k (log-uniform)."""
    return _log_uniform(rng, 65536, 131072) if rng.random() < 0.001 else _lognormal(rng, 400, 0.8, 4096)


MIXES = {"longalign-like": longalign_like, "chatqa-like": chatqa_like, "sft-99.9%-short": sft_short}
"""The length mixes (synthetic: their parameters are ours, modelled on the cited datasets' descriptions)."""
LONGEST = 131072
"""The longest document any mix draws."""


def draw(mix: str, n: int, seed: int) -> list[int]:
    """``n`` lengths of ``mix``, seeded."""
    rng = random.Random(seed)
    return [MIXES[mix](rng) for _ in range(n)]


def workload(profile: str) -> PatternWorkload:
    return PatternWorkload(load_profile(profile), "bfloat16", 32, 8, 128, 128, 2,
                           linear_ms_per_token=LLAMA3_8B_LINEAR_MS_PER_TOKEN)


def solver_rows(model: PatternWorkload, ranks_list: list[int], batches: list[int], budget: int, draws: int
                ) -> list[dict]:
    """One row per mix, rank count and batch size (documents per global batch; module doc)."""
    rows = []
    for mix in MIXES:
        for ranks in ranks_list:
            for n in batches:
                over, ms, gain, room = [], [], [], []
                for seed in range(draws):
                    lengths = draw(mix, n, seed)
                    schedule_sequences(lengths, ranks, budget, 1, model)  # the cost table, built once
                    start = time.perf_counter()
                    ours = schedule_sequences(lengths, ranks, budget, 1, model)
                    ms.append(1e3 * (time.perf_counter() - start))
                    over.append(ours.makespan / ours.bound)
                    powers = schedule_sequences(lengths, ranks, budget, 1, model, sizes_rule="powers_of_two")
                    gain.append(powers.makespan / ours.makespan)
                    room.append(powers.bound / ours.bound)
                rows.append({"mix": mix, "ranks": ranks, "documents": n, "budget": budget,
                             "over_bound_median": statistics.median(over), "over_bound_worst": max(over),
                             "solver_ms_median": statistics.median(ms), "powers_of_two_bound_ratio":
                             statistics.median(room), "powers_of_two_makespan_ratio": statistics.median(gain)})
                print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    return (f"| {r['mix']} | {r['ranks']} | {r['documents']} | {r['over_bound_median']:.4f}, "
            f"{r['over_bound_worst']:.4f} | {r['solver_ms_median']:.1f} | {r['powers_of_two_bound_ratio']:.3f} | "
            f"{r['powers_of_two_makespan_ratio']:.3f} |")


MEASURE_FLAGS = ["--nproc", "4", "--steps", "8", "--batch-size", "4", "--seq-len", "2048", "--hidden-size", "64",
                 "--ffn-hidden-size", "128", "--max-corpus-bytes", "4000000"]
"""The measured runs (``--measure``): 4 CPU ranks, 16 documents per step cut at 2,048 tokens."""


def _cp_train(flags: list[str]) -> list[float]:
    """Step times (s) of one ``cp-train --dynamic-cp`` run, the first (warm-up) step dropped."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.json")
        subprocess.run([sys.executable, "-m", "cp_handler.cli.train", "--dynamic-cp", *MEASURE_FLAGS, *flags,
                        "--metrics-out", out], check=True, capture_output=True)
        with open(out) as f:
            return [s["step_time_s"] for s in json.load(f)["steps"]][1:]


def _step_features(sizes_of_step: list[tuple[list[int], list[int]]], allowed: list[int]) -> torch.Tensor:
    """Per step: the tokens of its documents at each group size (the model's terms)."""
    rows = []
    for lengths, sizes in sizes_of_step:
        rows.append([float(sum(n for n, c in zip(lengths, sizes, strict=True) if c == size)) for size in allowed])
    return torch.tensor(rows, dtype=torch.float64)


def measured_prediction() -> dict:
    """``--measure``: the step time of a 4-rank CPU ``cp-train --dynamic-cp`` run against the model's prediction.

    The model of this machine: 4 ranks share 2 cores, so a step takes the rank-time of its documents (each at its
    schedule's size) over the cores: ``sum over documents of b_c L`` seconds, ``b_c`` the rank-time per token at
    group size ``c`` (the ring's transfers and per-rank overheads grow with ``c``; at these lengths, 2,048 tokens
    at most and a width of 64, a fitted ``L^2`` term came out at zero within the noise, and a fixed term per step
    negative, so neither is kept). ``b_1, b_2, b_4`` are fitted by least squares to static runs at sizes 1, 2 and 4
    (every document at one size), then predict the dynamic run (each document's size chosen by the solver) step by
    step."""
    from ..cli.train import parse
    from ..training.steps import load_documents

    config, _ = parse(["--dynamic-cp", "--max-seqlen-per-rank", "512", *MEASURE_FLAGS])
    documents, world = load_documents(config), 4
    allowed = [1, 2, 4]

    def steps_of(budget, low, high):
        out = []
        for step in range(1, 8):
            lengths = [d.numel() for d in documents.global_batch(step, config.batch_size * world)]
            schedule = schedule_sequences(lengths, world, budget, low, None, high)
            out.append((lengths, schedule.cp_sizes))
        return out

    # static: every document at size c (a budget of 2048 / c per rank holds the longest); dynamic: 512 per rank, so
    # documents up to 512 tokens may stay local, up to 1,024 take 2 ranks or more, longer ones 4
    static = {c: _cp_train(["--max-seqlen-per-rank", str(2048 // c), "--min-cp-size", str(c), "--max-cp-size",
                            str(c)]) for c in allowed}
    design = torch.cat([_step_features(steps_of(2048 // c, c, c), allowed) for c in allowed])
    times = torch.tensor([t for c in allowed for t in static[c]], dtype=torch.float64)
    coefficients = torch.linalg.lstsq(design, times[:, None]).solution[:, 0]
    dynamic_steps = steps_of(512, 1, None)
    measured = _cp_train(["--max-seqlen-per-rank", "512"])
    predicted = (_step_features(dynamic_steps, allowed) @ coefficients).tolist()
    return {"flags": MEASURE_FLAGS, "static_step_s": static, "coefficients": coefficients.tolist(),
            "dynamic_sizes": [sorted(set(sizes)) for _, sizes in dynamic_steps],
            "measured_step_s": measured, "predicted_step_s": predicted,
            "measured_mean_s": statistics.mean(measured), "predicted_mean_s": statistics.mean(predicted),
            "ratio": statistics.mean(predicted) / statistics.mean(measured)}


HEADER = ("| mix | ranks | documents | makespan / bound (median, worst) | solver ms | power-of-two bound / ours "
          "| power-of-two makespan / ours |\n|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    p = FlagParser(prog="python -m cp_handler.bench.dynamic_solver", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="h100-nvlink", help="the cost profile (a name or a cp-bench --calibrate file)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 6, 12, 24, 48])
    p.add_argument("--documents", type=int, nargs="+", default=[1024],
                   help="documents per global batch (one table block each)")
    p.add_argument("--budget", type=int, default=32768, help="max_seqlen_per_dp_cp_rank (tokens)")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--measure", action="store_true",
                   help="also the 4-rank CPU cp-train run against the model's prediction (about 2 minutes)")
    p.add_argument("--out", default="runs/bench_dynamic_solver.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the solver's time on one core
    model = workload(args.profile)
    start = time.perf_counter()
    model.costs([LONGEST], sorted({c for r in args.ranks for c in range(1, r + 1) if r % c == 0 or c & (c - 1) == 0}))
    build_s = time.perf_counter() - start
    print(f"cost table of {args.profile!r} built in {build_s:.1f} s (once per run)\n{HEADER}", flush=True)
    rows = solver_rows(model, args.ranks, args.documents, args.budget, args.draws)
    result = {"command": "python -m cp_handler.bench.dynamic_solver " + " ".join(sys.argv[1:] if argv is None
                                                                                 else argv),
              "profile": args.profile, "table_build_s": build_s, "rows": rows}
    if args.measure:
        m = result["measured"] = measured_prediction()
        print(f"cp-train --dynamic-cp, 4 CPU ranks: step {m['measured_mean_s']:.3f} s measured, "
              f"{m['predicted_mean_s']:.3f} s predicted ({m['ratio']:.2f}x)", flush=True)
    return 0 if write_output("python -m cp_handler.bench.dynamic_solver", "--out", args.out, result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
