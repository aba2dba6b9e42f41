"""Evaluation time per held-out batch at training's CP degree vs another (``python -m cp_handler.bench.eval_cp``).

The case it measures: a held-out batch with fewer sequences than data-parallel replicas. At the
training degree most replicas idle while one evaluates; at a higher evaluation degree every rank
shares every sequence. Each configuration: the reference GPT's forward on ``--sequences`` random
sequences per batch, median wall time over ``--reps`` batches after one warm-up, synchronized by
barriers. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..cli.flag_names import FlagParser
from ..models import GPTConfig, GPTModel
from ..runtime.config import ContextParallelConfig
from ..runtime.launch import launch, rank_session
from ..training.eval_cp import EvalContextParallel, eval_config


class _Rows:
    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return self.tokens.shape[0]

    def rows(self, index):
        return _Rows(self.tokens[index])


def _time_eval(evaluator, model, batch, reps: int) -> float:
    evaluator.evaluate(model, [batch], lambda b: (b.tokens, {}))  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        evaluator.evaluate(model, [batch], lambda b: (b.tokens, {}))
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args) -> list[dict] | None:
    with rank_session("bench.eval_cp", device_type="cpu"):
        base = ContextParallelConfig(context_parallel_size=args.train_cp_size)
        at_train = EvalContextParallel.build(base)
        at_eval = EvalContextParallel.build(eval_config(base, args.eval_cp_size))
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(hidden_size=args.hidden_size, num_layers=args.num_layers))
        rows = []
        for seq_len in args.seq_lens:
            batch = _Rows(torch.randint(0, 256, (args.sequences, seq_len), generator=torch.Generator().manual_seed(1)))
            t_train, t_eval = (_time_eval(e, model, batch, args.reps) for e in (at_train, at_eval))
            rows.append({"seq_len": seq_len, "sequences": args.sequences, "world_size": dist.get_world_size(),
                         "train_cp_size": args.train_cp_size, "eval_cp_size": args.eval_cp_size,
                         "train_cp_ms": 1e3 * t_train, "eval_cp_ms": 1e3 * t_eval, "speedup": t_train / t_eval})
        return rows if dist.get_rank() == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = FlagParser(prog="python -m cp_handler.bench.eval_cp", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--train-cp-size", type=int, default=1)
    p.add_argument("--eval-cp-size", type=int, default=4)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--sequences", type=int, default=1, help="held-out sequences per batch")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="runs/bench_eval_cp.json")
    args = p.parse_args(argv)
    rows = launch(worker, args.nproc, args, program="bench.eval_cp")[0]
    print("| seq_len | sequences | ranks | train cp | eval cp | train-cp ms/batch | eval-cp ms/batch | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']} | {r['sequences']} | {r['world_size']} | {r['train_cp_size']} | {r['eval_cp_size']} "
              f"| {r['train_cp_ms']:.1f} | {r['eval_cp_ms']:.1f} | {r['speedup']:.2f}x |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
