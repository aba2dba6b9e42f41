"""The deterministic mode's cost on this machine's CPU, at cp 2 (gloo, 2 spawned ranks, one thread each), medians on
rank 0 of rounds that run every mode once after a warm-up:

* ``--part attention``: ``core_attn`` forward + backward, bshd, causal, H = 8, D = 64, fp32, of the ring (``p2p``),
  Ulysses (``a2a``) and the KV all-gather, each by default and with ``deterministic=True`` (canonical tiles,
  ``ops/canonical.py``; the block kernel pinned); each timed call builds its handler (as a batch does).
* ``--part gradients``: one training forward + backward of the reference GPT (:data:`MODEL`), bshd, fp32, through the
  mode's handler (``a2a``), with the gradients reduced as without exact sums (autograd's float32 sums, one float32
  all-reduce of all gradients: DDP's sum) and as ``cp-train --deterministic`` reduces them
  (``runtime/exact_grads.py``: a GEMM per unit, fixed-point limbs, one int64 all-reduce).
* ``--part step``: the same training forward + backward + reduction as ``cp-train`` runs it in each mode: by default
  (the ring, ``p2p``; autograd's sums and one float32 all-reduce) and with ``--deterministic`` (``a2a`` in the mode;
  the exact sums): the whole cost of turning the mode on, attention and gradients together.
* ``--part fused-head``: what the Hugging Face trainers add in the mode (``integrations/hf_exact_grads.py``): TRL's
  fused LM head (``ChunkedLogProbFunction``: log-probabilities and entropies, forward + backward) on a rank's tokens
  of :data:`MODEL`'s width and vocabulary, in one call (as without exact sums) and in one call per unit with the weight
  gradient's pieces into the exact sums (no all-reduce; needs TRL).

    PYTHONPATH=. python scripts/deterministic_cost.py --seq-lens 4096 8192 --out runs/deterministic_cost.json
    PYTHONPATH=. python scripts/deterministic_cost.py --part gradients --seq-lens 2048 8192 --out runs/exact_grads.json
    PYTHONPATH=. python scripts/deterministic_cost.py --part step --seq-lens 4096 8192 --out runs/step.json
    PYTHONPATH=. python scripts/deterministic_cost.py --part fused-head --seq-lens 2048 8192 --out runs/head.json

Prints a table and writes JSON (docs/deterministic.md quotes both).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = {"default p2p": ("p2p", False), "deterministic p2p": ("p2p", True), "default a2a": ("a2a", False),
         "deterministic a2a": ("a2a", True), "default all_gather": ("all_gather", False),
         "deterministic all_gather": ("all_gather", True)}
"""``--part attention``'s modes: ``(cp_comm_type, deterministic)``."""

MODEL = {"vocab_size": 4096, "hidden_size": 256, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 8,
         "ffn_hidden_size": 704}
"""The GPT timed: 4 layers of 256 wide, a vocabulary of 4096 (8.2M parameters, 2.1M of them the LM head)."""


def _medians(modes: dict, rounds: int, rank: int, out: str) -> None:
    """Each of ``modes`` (name -> a call returning its seconds) once as a warm-up, then ``rounds`` rounds that run every
    mode once (interleaved); rank 0 writes each mode's median in ms to ``out``; the process group is ended."""
    for once in modes.values():
        once()
    times = {name: [] for name in modes}
    for _ in range(rounds):
        for name, once in modes.items():
            times[name].append(once())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}, f)
    dist.destroy_process_group()


def _attention_rank(rank: int, world: int, init: str, seq_len: int, rounds: int, out: str) -> None:
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

    _medians({name: functools.partial(once, *mode) for name, mode in MODES.items()}, rounds, rank, out)


def _gradients_rank(rank: int, world: int, init: str, seq_len: int, rounds: int, out: str,
                    step: bool = False) -> None:
    """``--part gradients`` (the mode's handler; its gradients all-reduced in float32 and summed exactly), or with
    ``step`` ``--part step``: the default mode's step (the default ring, float32 all-reduce) against the mode's."""
    from cp_handler import LocalContextParallelHandler
    from cp_handler.models import GPTConfig, GPTModel
    from cp_handler.runtime.exact_grads import ExactGradients, unit_lengths

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**MODEL))
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    mode = LocalContextParallelHandler(cp_group=dist.group.WORLD, cp_comm_type="a2a", deterministic=True)
    default = LocalContextParallelHandler(cp_group=dist.group.WORLD, cp_comm_type="p2p")
    sums = ExactGradients(model)
    sums.units = unit_lengths(mode, mode.dispatch(tokens[:, :-1], 1).shape[1])

    def once(handler, exact: bool) -> float:
        inputs, labels = (handler.dispatch(t, 1) for t in (tokens[:, :-1], tokens[:, 1:]))
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

    modes = ({"default": (default, False), "deterministic": (mode, True)} if step else
             {"all-reduced": (mode, False), "exact": (mode, True)})
    _medians({name: functools.partial(once, *how) for name, how in modes.items()}, rounds, rank, out)


def _fused_head_rank(rank: int, world: int, init: str, seq_len: int, rounds: int, out: str) -> None:
    from trl.kernels import ChunkedLogProbFunction

    from cp_handler import LocalContextParallelHandler
    from cp_handler.integrations.hf_exact_grads import _PerUnit
    from cp_handler.runtime.exact_grads import ExactGradients, unit_lengths

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(rank)
    head = torch.nn.Linear(MODEL["hidden_size"], MODEL["vocab_size"], bias=False)
    tokens = seq_len // world
    hidden = torch.randn(tokens, MODEL["hidden_size"], requires_grad=True)
    labels = torch.randint(0, MODEL["vocab_size"], (tokens,))
    handler = LocalContextParallelHandler(cp_group=dist.group.WORLD, cp_comm_type="a2a", deterministic=True)
    sums = ExactGradients(head)
    sums.units = unit_lengths(handler, tokens)
    per_unit = _PerUnit(ChunkedLogProbFunction, sums)
    arguments = (1.0, 32768, None, 1.0, ("log_probs", "entropy"))

    def once(exact: bool) -> float:
        head.zero_grad(set_to_none=True)
        began = time.perf_counter()
        function = per_unit if exact else ChunkedLogProbFunction
        log_probs, entropy, *_ = function.apply(hidden, head.weight, None, labels, *arguments)
        (log_probs.sum() + entropy.sum()).backward()
        return time.perf_counter() - began

    _medians({"one call": functools.partial(once, False), "per unit": functools.partial(once, True)}, rounds, rank,
             out)


RATIOS = (("deterministic p2p", "default p2p"), ("deterministic a2a", "default a2a"),
          ("deterministic a2a", "default p2p"), ("deterministic all_gather", "default all_gather"))
"""``--part attention``'s ratios: ``(mode, base)``, printed as ``mode / base``."""


def _attention_table(rows: list[dict]) -> None:
    print("| S | cp | " + " | ".join(f"{m} ms" for m in MODES) + " | " +
          " | ".join(f"{m} / {b}" for m, b in RATIOS) + " |")
    print("|---" * (len(MODES) + len(RATIOS) + 2) + "|")
    for row in rows:
        times = " | ".join(f"{row[m]:.1f}" for m in MODES)
        ratios = " | ".join(f"{row[m] / row[b]:.3f}" for m, b in RATIOS)
        print(f"| {row['seq_len']} | 2 | {times} | {ratios} |")


def _two_modes_table(base: str, other: str, rows: list[dict]) -> None:
    """The table of a part timing two modes: each one's median and ``other / base``."""
    print(f"| S | cp | {base} ms | {other} ms | {other} / {base} |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['seq_len']} | 2 | {row[base]:.1f} | {row[other]:.1f} | {row[other] / row[base]:.3f} |")


PARTS = {"attention": (_attention_rank, _attention_table),
         "gradients": (_gradients_rank, functools.partial(_two_modes_table, "all-reduced", "exact")),
         "fused-head": (_fused_head_rank, functools.partial(_two_modes_table, "one call", "per unit")),
         "step": (functools.partial(_gradients_rank, step=True), functools.partial(_two_modes_table, "default",
                                                                                    "deterministic"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=sorted(PARTS), default="attention",
                        help="what is timed (module doc; default attention)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192],
                        help="global tokens (default 4096 8192)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (default 5)")
    parser.add_argument("--out", default="runs/deterministic_cost.json", help="the JSON written")
    args = parser.parse_args(argv)
    rank_fn, table = PARTS[args.part]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in args.seq_lens:
            result = os.path.join(tmp, f"{seq_len}.json")
            mp.start_processes(rank_fn, args=(2, os.path.join(tmp, f"init{seq_len}"), seq_len, args.rounds, result),
                               nprocs=2, start_method="spawn")
            with open(result) as f:
                rows.append({"seq_len": seq_len, "cp": 2, **json.load(f)})
    table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    extra = {"model": MODEL} if args.part != "attention" else {}
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, **extra, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
