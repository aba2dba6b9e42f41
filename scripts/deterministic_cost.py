"""The deterministic mode's cost on this machine's CPU: ``core_attn`` forward + backward at cp 2 (gloo, 2 spawned
ranks), bshd, causal, H = 8, D = 64, fp32, of the default ring (``p2p``), the default Ulysses (``a2a``),
``deterministic=True`` with Ulysses (the block kernel pinned), the default KV all-gather and ``deterministic=True``
with the all-gather (canonical tiles, ``ops/canonical.py``). Each timed call builds its handler (as a batch does);
the modes run one after another per round, 5 rounds after a warm-up, medians per rank 0.

    PYTHONPATH=. python scripts/deterministic_cost.py --seq-lens 4096 8192 --out runs/deterministic_cost.json

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

MODES = {"default p2p": ("p2p", False), "default a2a": ("a2a", False), "deterministic a2a": ("a2a", True),
         "default all_gather": ("all_gather", False), "deterministic all_gather": ("all_gather", True)}


def _rank(rank: int, world: int, init: str, seq_len: int, rounds: int, out: str) -> None:
    from cp_handler import LocalContextParallelHandler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    heads, dim = 8, 64
    module = torch.nn.Module()
    module.softmax_scale = dim**-0.5

    def once(comm_type: str, deterministic: bool) -> float:
        handler = LocalContextParallelHandler(cp_group=dist.group.WORLD, cp_comm_type=comm_type,
                                              deterministic=deterministic)
        q, k, v = (torch.randn(1, seq_len // world, heads, dim, requires_grad=True) for _ in range(3))
        dist.barrier()
        began = time.perf_counter()
        output = handler.core_attn(module, q, k, v, attn_mask_type="causal")
        output.backward(torch.ones_like(output))
        return time.perf_counter() - began

    for mode in MODES.values():
        once(*mode)
    times = {name: [] for name in MODES}
    for _ in range(rounds):  # interleaved: each round runs every mode once
        for name, mode in MODES.items():
            times[name].append(once(*mode))
    times = {name: sorted(t) for name, t in times.items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({name: t[len(t) // 2] * 1e3 for name, t in times.items()}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192],
                        help="global tokens (default 4096 8192)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (default 5)")
    parser.add_argument("--out", default="runs/deterministic_cost.json", help="the JSON written")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in args.seq_lens:
            result = os.path.join(tmp, f"{seq_len}.json")
            mp.start_processes(_rank, args=(2, os.path.join(tmp, f"init{seq_len}"), seq_len, args.rounds, result),
                               nprocs=2, start_method="spawn")
            with open(result) as f:
                rows.append({"seq_len": seq_len, "cp": 2, **json.load(f)})
    print("| S | cp | " + " | ".join(f"{m} ms" for m in MODES) + " | deterministic a2a / default p2p | "
          "deterministic all_gather / default all_gather |")
    print("|---" * (len(MODES) + 4) + "|")
    for row in rows:
        times = " | ".join(f"{row[m]:.1f}" for m in MODES)
        print(f"| {row['seq_len']} | 2 | {times} | {row['deterministic a2a'] / row['default p2p']:.3f} | "
              f"{row['deterministic all_gather'] / row['default all_gather']:.3f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
