"""The cost of exact parameter gradients on this machine's CPU: one training forward + backward of the reference GPT
at cp 2 (gloo, 2 spawned ranks, one thread each), bshd, fp32, through the deterministic mode's handler (``a2a``), with
the gradients reduced as without exact sums (autograd's float32 sums, one float32 all-reduce of all gradients: DDP's
sum) and as ``cp-train --deterministic`` now reduces them (``training/exact_grads.py``: a GEMM per unit, fixed-point
limbs, one int64 all-reduce). The two run one after another per round, 5 rounds after a warm-up, medians on rank 0.

    PYTHONPATH=. python scripts/exact_grads_cost.py --seq-lens 2048 8192 --out runs/exact_grads_cost.json

Prints a table and writes JSON (docs/deterministic.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = {"vocab_size": 4096, "hidden_size": 256, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 8,
         "ffn_hidden_size": 704}
"""The GPT timed: 4 layers of 256 wide, a vocabulary of 4096 (8.2M parameters, 2.1M of them the LM head)."""


def _rank(rank: int, world: int, init: str, seq_len: int, rounds: int, out: str) -> None:
    from cp_handler import LocalContextParallelHandler
    from cp_handler.models import GPTConfig, GPTModel
    from cp_handler.training.exact_grads import ExactGradients, unit_lengths

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**MODEL))
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    handler = LocalContextParallelHandler(cp_group=dist.group.WORLD, cp_comm_type="a2a", deterministic=True)
    inputs, labels = (handler.dispatch(t, 1) for t in (tokens[:, :-1], tokens[:, 1:]))
    sums = ExactGradients(model)
    sums.units = unit_lengths(handler, inputs.shape[1])

    def once(exact: bool) -> float:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        began = time.perf_counter()
        with sums if exact else torch.enable_grad():
            logits = model(inputs, cp_handler=handler)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        if exact:
            sums.all_reduce_(dist.group.WORLD)
        else:
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            dist.all_reduce(flat)
        return time.perf_counter() - began

    modes = {"all-reduced": False, "exact": True}
    for exact in modes.values():
        once(exact)
    times = {name: [] for name in modes}
    for _ in range(rounds):
        for name, exact in modes.items():
            times[name].append(once(exact))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192],
                        help="global tokens (default 2048 8192)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (default 5)")
    parser.add_argument("--out", default="runs/exact_grads_cost.json", help="the JSON written")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in args.seq_lens:
            result = os.path.join(tmp, f"{seq_len}.json")
            mp.start_processes(_rank, args=(2, os.path.join(tmp, f"init{seq_len}"), seq_len, args.rounds, result),
                               nprocs=2, start_method="spawn")
            with open(result) as f:
                rows.append({"seq_len": seq_len, "cp": 2, **json.load(f)})
    print("| S | cp | all-reduced ms | exact ms | exact / all-reduced |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['seq_len']} | 2 | {row['all-reduced']:.1f} | {row['exact']:.1f} | "
              f"{row['exact'] / row['all-reduced']:.3f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "model": MODEL, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
