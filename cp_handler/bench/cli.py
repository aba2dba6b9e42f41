"""``cp-bench``: attention and end-to-end context-parallel benchmarks on this machine.

Modes (``--modes``, default both):

* ``attn``: :mod:`.attention` over implementation x ``cp_comm_type`` x cp size x sequence length x
  qkv_format x pass, with PyTorch's own ring (:mod:`.torch_ring`) beside ours and the
  single-process reference on the same total threads (for CP efficiency). With ``--device cuda``
  the ranks run one per GPU over NCCL (at least as many GPUs as the largest cp size; bf16; not yet
  run on GPUs);
* ``e2e``: :mod:`.e2e`: ``cp-train --metrics-out`` at each cp size (tokens/s, peak RSS per rank),
  activation memory of one GPT training step per rank, and the cost of the handler at cp=1;
* ``plan`` (only when asked for): :mod:`.plan`: one rank's compute of every pattern, bshd and thd,
  timed on ``--device`` (one GPU is enough; CPU is the emulation mode) without communication beside
  the whole sequence on one device: per-rank compute efficiency;
* ``launches`` (only when asked for): :mod:`.launches`: the same rank plans on ``meta`` tensors through
  each of ``--launch-kernels`` (CUDA kernels), counting the operators (kernel launches) per rank-step;
  no GPU needed, sizes from the plan flags: a Llama-3-8B attention layer on a small grid (S 4k-64k, cp 2-8),
  the CUDA grid of ``plan`` (S 4k-128k, cp 1-32: tens of minutes on a 2-core CPU) with ``--device cuda``;
* ``generate`` (only when asked for): :mod:`.generation`: prefill time and decode time per token against
  prompt length at each CP size (a KV cache sharded over the ranks);
* ``hybrid`` (only when asked for): :mod:`.hybrid`: one Gated DeltaNet layer (short convolution and gated delta
  rule) forward + backward per rank with state passing, beside all-gathering the sequence, with the bytes each
  rank sends;
* ``memory`` (only when asked for): :mod:`.memory`: bytes saved for the backward per token per layer (saved-tensor
  hooks, on fake tensors: no arithmetic) at the Llama-3-8B layer shape, training state and peak RSS per rank of
  DDP vs FSDP runs here, and the longest sequence per rank an 80 GB GPU holds (a projection from those
  measurements);
* ``masks`` (only when asked for): :mod:`.masks`: full causal vs a sliding window vs chunked attention,
  every rank's ``p2p`` plan timed like ``plan`` (heads, head dim, dtype from the plan flags), with the
  K/V tokens each rank sends;
* ``compile`` (only when asked for): :mod:`.compiled`: the reference GPT's training step with every layer
  compiled (Inductor, fullgraph) beside eager, per comm type, with the compiled forward's graphs and breaks and the
  eager forward's cp_handler Python calls;
* ``calibrate`` (only when asked for, or ``--calibrate``): :mod:`cp_handler.bench.calibrate`: this machine's cost
  profile (compute and links at ``--calibrate-cp-sizes``, under a minute on 2 CPU cores), written to
  ``<out-dir>/cost_profile.json`` (``--cp-comm-profile`` of cp-train, ``cp_comm_profile`` of the config);
* ``auto`` (only when asked for): :mod:`.auto`: every pattern measured on CPU ranks over a grid beside the cost
  model's prediction and ``cp_comm_type="auto"``'s pick;
* ``links`` (only when asked for): :mod:`.links`: every pattern's exposed communication on emulated links (a timing
  shim holds each collective to a bandwidth set against the ring step's compute), beside the cost model's;
* ``tp`` (only when asked for): :mod:`.tensor_parallel`: ``cp-train`` at every TP x CP layout of ``--tp-world``
  ranks, with and without sequence parallelism (tokens/s, peak RSS per rank);
* ``backtest`` (only when asked for): :mod:`.backtest`: the cost model's named GPU profiles against published GPU
  results (:mod:`.published`), every pair of rows a comparison of winner and ratio; no device, under a second.

Each cp size runs as its own launch of ``cp`` ranks with ``max(1, cores // cp)`` threads each. Every mode's
defaults (:mod:`.defaults`, shown by ``--help``) depend on ``--device`` and ``--quick``; on CPU each mode finishes
in a few minutes on 2 cores (attn's full grid: tens of minutes). Every mode prints its sizes when it starts and its
progress per case (:mod:`.case_progress`). Writes ``results.json``, ``results.md`` and PNG plots (:mod:`.plots`,
matplotlib: the ``bench`` extra; ``--no-plots`` without it) to ``--out-dir`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from ..cli.flag_names import FlagParser, HelpFormatter
from ..runtime.config import CP_COMM_TYPES
from ..runtime.forking import fresh_process
from . import (
    auto,
    backtest,
    compiled,
    defaults,
    e2e,
    generation,
    hybrid,
    launches,
    links,
    masks,
    memory,
    plan,
    plots,
    report,
    tensor_parallel,
    whole,
)
from .attention import PASSES, run_attn
from .defaults import default_help
from .flag_rules import check_flags
from .torch_ring import check_available

RUNS = {"attn": ("attention", run_attn), "e2e": ("e2e", e2e.run), "plan": ("plan", plan.run),
        "launches": ("launches", launches.run), "masks": ("masks", masks.run), "generate": ("generate", generation.run),
        "hybrid": ("hybrid", hybrid.run), "memory": ("memory", memory.run), "compile": ("compile", compiled.run),
        "calibrate": ("calibrate", auto.run_calibrate), "auto": ("auto", auto.run),
        "backtest": ("backtest", backtest.run), "links": ("links", links.run), "tp": ("tp", tensor_parallel.run)}
"""mode -> (its key in results.json, its run), in the order the modes run."""


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default shown (:class:`~cp_handler.cli.flag_names.HelpFormatter`); the defaults list kept as laid out."""


def _default(what: str, key: str) -> str:
    """A flag's help: ``what`` and its default in every mode that reads it (:func:`.defaults.default_help`)."""
    return f"{what} ({default_help(key)})"


def build_parser() -> argparse.ArgumentParser:
    """The flags of cp-bench, in groups: run, attention, end to end, plan and launches, masks, hybrid, memory,
    generation; the help closes with every mode's defaults on CPU and with ``--device cuda``."""
    p = FlagParser(prog="cp-bench", formatter_class=_Formatter, epilog=defaults.epilog(),
                   description=__doc__.split("\n\n")[0] + " Tables and plots: docs/benchmarks.md.")
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="runs/bench", help="where results.json, results.md and the plots go")
    g.add_argument("--no-plots", action="store_true",
                   help="write no PNG plots (plots need matplotlib: cp_handler's bench extra)")
    g.add_argument("--quick", action="store_true",
                   help="every mode's smaller defaults (--quick in each flag's default and in the list below; on "
                        "CPU each mode finishes in a few minutes on 2 cores, attn and e2e together in about 3)")
    g.add_argument("--modes", nargs="+", choices=tuple(RUNS), default=None,
                   help="attn: every pattern beside PyTorch's ring; e2e: cp-train throughput and memory; plan: "
                        "per-rank compute on one device; launches: kernel launches per rank-step of CUDA kernels, "
                        "counted on meta tensors (no GPU needed; a small grid unless --device cuda); masks: sliding "
                        "window and chunked attention vs full causal per rank; generate: prefill and decode with a "
                        "sharded KV cache; hybrid: one Gated DeltaNet layer; memory: saved activations (fake tensors "
                        "of the Llama-3-8B layer), training state and the 80 GB projection; calibrate: this machine's "
                        "cost profile; auto: every pattern measured beside the cost model and auto's pick; tp: "
                        "cp-train at every TP x CP layout (default: attn e2e; only calibrate with --calibrate)")
    g.add_argument("--calibrate", action="store_true",
                   help="measure this machine's cost profile first (the calibrate mode; alone unless --modes is "
                        "given): <out-dir>/cost_profile.json, used by --modes auto in the same run")
    g.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the ranks (each of cp ranks gets cores // cp threads)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="attn: cuda runs one rank per GPU over NCCL; plan and masks: the device timed; launches: "
                        "the grid only (cuda: plan's CUDA grid, tens of minutes on a 2-core CPU; no GPU needed); "
                        "e2e, generate, hybrid, memory and tp run on CPU only. The defaults follow it (list below)")
    g = p.add_argument_group("attention (--modes attn; --cp-sizes and --reps also e2e's)")
    g.add_argument("--cp-sizes", type=int, nargs="+", default=None, help=_default("CP sizes", "cp_sizes"))
    g.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help=_default("global sequence lengths in tokens, each divisible by 2 * cp", "seq_lens"))
    g.add_argument("--comm-types", nargs="+", choices=CP_COMM_TYPES, default=None,
                   help=_default("cp_comm_type values", "comm_types"))
    g.add_argument("--formats", nargs="+", choices=("bshd", "thd"), default=["bshd", "thd"],
                   help="qkv formats (thd: packs of stdlib documents)")
    g.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES), help="timed passes")
    g.add_argument("--num-heads", type=int, default=None, help=_default("query heads", "num_heads"))
    g.add_argument("--num-kv-heads", type=int, default=None, help=_default("KV heads", "num_kv_heads"))
    g.add_argument("--head-dim", type=int, default=64, help="head dim")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="q/k/v dtype")
    g.add_argument("--reps", type=int, default=None, help=_default("timed repetitions, median reported", "reps"))
    g.add_argument("--warmup", type=int, default=1, help="untimed repetitions before timing")
    g = p.add_argument_group("end to end (--modes e2e)")
    g.add_argument("--e2e-seq-len", type=int, default=None, help=_default("cp-train --seq-len", "e2e_seq_len"))
    g.add_argument("--e2e-steps", type=int, default=None, help=_default("cp-train --steps", "e2e_steps"))
    g = p.add_argument_group("plan and launches (--modes plan / launches: one rank's compute, no communication; "
                             "masks reads the shape)")
    g.add_argument("--attn-kernel", default=None,
                   help="plan, masks: force a block kernel (a name of cp_handler.ops.kernels.KERNELS; default: "
                        "automatic)")
    g.add_argument("--plan-seq-lens", type=int, nargs="+", default=None,
                   help=_default("global sequence lengths", "plan_seq_lens"))
    g.add_argument("--plan-cp-sizes", type=int, nargs="+", default=None, help=_default("CP sizes", "plan_cp_sizes"))
    g.add_argument("--plan-heads", type=int, default=None, help=_default("query heads", "plan_heads"))
    g.add_argument("--plan-kv-heads", type=int, default=None, help=_default("KV heads", "plan_kv_heads"))
    g.add_argument("--plan-head-dim", type=int, default=None, help=_default("head dim", "plan_head_dim"))
    g.add_argument("--plan-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help=_default("dtype", "plan_dtype"))
    g.add_argument("--thd-mean-doc", type=int, default=1024, help="mean document length of thd packs (tokens)")
    g.add_argument("--whole-kernels", nargs="+", choices=whole.WHOLE_KERNELS, default=["auto"],
                   help="plan: the whole-sequence references the efficiency is measured against (sdpa; flex: "
                        "FlexAttention with a document-causal mask, CUDA; fa4: FlashAttention-4, one block or one "
                        "varlen call over the pack; auto: sdpa for bshd, flex for thd on CUDA, sdpa on CPU)")
    g.add_argument("--launch-kernels", nargs="+", default=list(launches.DEFAULT_KERNELS),
                   help="--modes launches: the CUDA kernels whose launches are counted")
    g = p.add_argument_group("attention variants (--modes masks: every rank's p2p plan, no communication)")
    g.add_argument("--mask-seq-len", type=int, default=16384, help="global sequence length (tokens)")
    g.add_argument("--mask-cp-size", type=int, default=4, help="CP size")
    g.add_argument("--mask-window", type=int, default=1024, help="sliding window W (keys, the query's own included)")
    g.add_argument("--mask-chunk", type=int, default=2048, help="chunked attention: chunk length C (tokens)")
    g = p.add_argument_group("cost model (--modes calibrate / auto: CPU ranks)")
    g.add_argument("--calibrate-cp-sizes", type=int, nargs="+", default=[2, 4], help="group sizes measured")
    g.add_argument("--calibrate-dtype", default="float32", help="the dtype of the compute fits")
    g.add_argument("--cost-profile", default=None, metavar="NAME_OR_JSON",
                   help="--modes auto: the profile to predict with (default: --calibrate's of this run, else the "
                        "device's named one)")
    g.add_argument("--auto-grid", choices=("regret", "full", "quick", "tiny"), default=None,
                   help=_default("--modes auto: the grid (regret: 48 cases with sinks, Hkv < cp, flat and two-level "
                                 "groups; full: 24 cases, about 20 min on 2 CPU cores; quick: 12 of at most 4k tokens; "
                                 "tiny: 4 of 256 tokens)", "auto_grid"))
    g = p.add_argument_group("emulated links (--modes links: every pattern on CPU ranks, links held to a bandwidth)")
    g.add_argument("--links-cp-sizes", type=int, nargs="+", default=[2, 4], help="CP sizes")
    g.add_argument("--links-seq-len", type=int, default=None,
                   help=_default("global sequence length (tokens; heads 8/8 of 64, float32)", "links_seq_len"))
    g = p.add_argument_group("hybrid layer (--modes hybrid: the reference Gated DeltaNet layer, float32, CPU ranks)")
    g.add_argument("--hybrid-seq-lens", type=int, nargs="+", default=None,
                   help=_default("global sequence lengths in tokens", "hybrid_seq_lens"))
    g.add_argument("--hybrid-cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="CP sizes")
    g.add_argument("--hybrid-hidden-size", type=int, default=256, help="layer hidden size")
    g.add_argument("--hybrid-heads", type=int, default=4, help="value heads")
    g.add_argument("--hybrid-key-heads", type=int, default=2, help="key heads (each serves heads / key heads)")
    g.add_argument("--hybrid-head-dim", type=int, default=64, help="head dim of keys and values")
    g = p.add_argument_group("memory (--modes memory, CPU: saved activations, training state, the 80 GB projection)")
    g.add_argument("--mem-layer-tokens", type=int, default=None,
                   help=_default("tokens of the Llama-3-8B layer measurement, bfloat16 on fake tensors (bytes per "
                                 "token do not depend on it)", "mem_layer_tokens"))
    g.add_argument("--mem-seq-len", type=int, default=None,
                   help=_default("sequence of the DDP / FSDP runs here (4 ranks, cp 2)", "mem_seq_len"))
    g.add_argument("--mem-local-model", type=json.loads, default=memory.LOCAL_MODEL, metavar="JSON",
                   help="the reference GPT shape of the runs here (GPTConfig fields)")
    g = p.add_argument_group("tensor parallelism (--modes tp: cp-train of e2e's reference GPT, CPU ranks)")
    g.add_argument("--tp-world", type=int, default=4, help="ranks: every TP x CP layout of them")
    g.add_argument("--tp-seq-len", type=int, default=None, help=_default("cp-train --seq-len", "tp_seq_len"))
    g.add_argument("--tp-steps", type=int, default=None, help=_default("cp-train --steps", "tp_steps"))
    g = p.add_argument_group("compiled vs eager (--modes compile: the reference GPT of e2e, CPU ranks)")
    g.add_argument("--compile-seq-len", type=int, default=None,
                   help=_default("global sequence length in tokens", "compile_seq_len"))
    g.add_argument("--compile-cp-size", type=int, default=2, help="CP size (ranks)")
    g.add_argument("--compile-comm-types", nargs="+", choices=("p2p", "all_gather", "a2a"),
                   default=["p2p", "all_gather", "a2a"], help="comm types")
    g = p.add_argument_group("generation (--modes generate: the reference GPT, greedy, one prompt, CPU ranks)")
    g.add_argument("--gen-prompt-lens", type=int, nargs="+", default=None,
                   help=_default("prompt lengths in tokens", "gen_prompt_lens"))
    g.add_argument("--gen-cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="CP sizes (1 is the baseline)")
    g.add_argument("--gen-new-tokens", type=int, default=16, help="tokens generated per prompt")
    g.add_argument("--gen-hidden-size", type=int, default=256, help="model hidden size")
    g.add_argument("--gen-layers", type=int, default=2, help="model layers")
    g.add_argument("--gen-heads", type=int, default=8, help="query heads")
    g.add_argument("--gen-kv-heads", type=int, default=2, help="KV heads")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags as given (unset ones ``None``: each mode fills its own defaults, :func:`.defaults.resolve`), every
    requested mode's rules checked on them.

    Raises:
        SystemExit: a flag breaking its mode's rule (:mod:`.flag_rules`: a cp size below 1, a sequence length not
            divisible by ``2 * cp``, a shape a kernel cannot run, ...); ``--device cuda`` without CUDA for attn,
            plan or masks, with a CPU-only mode, or for attn with fewer GPUs than the largest cp size or not bf16.
    """
    p = build_parser()
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = [] if args.calibrate else ["attn", "e2e"]
    if args.calibrate and "calibrate" not in args.modes:
        args.modes = ["calibrate", *args.modes]
    check_flags(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as the command: nothing computed in this process yet (runtime/launch.py)
        fresh_process()
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    started = time.time()
    results = {"command": "cp-bench " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": {"cores": args.cores, "platform": platform.platform(), "torch": torch.__version__,
                           "processor": platform.processor()},
               "peer_unavailable": check_available()}
    for mode, (key, run) in RUNS.items():
        if mode in args.modes:
            mode_args = defaults.resolve(args, mode)
            print(f"cp-bench: {mode}: {defaults.summary(mode_args, mode)}", file=sys.stderr, flush=True)
            results[key] = run(mode_args)
    results["seconds"] = time.time() - started
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    markdown = report.markdown(results)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown)
    written = [] if args.no_plots else plots.plots(results, args.out_dir)
    print(markdown)
    names = ", ".join(os.path.basename(path) for path in written)
    plotted = f" and {len(written)} plot{'s' * (len(written) > 1)} ({names})" if written else ""  # only those written
    print(f"cp-bench: wrote {args.out_dir}/results.json, results.md{plotted} in {results['seconds']:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
