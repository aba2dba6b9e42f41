"""cp-bench's rules for its flags, checked before any run, each error naming its flag (``parser.error``)."""

from __future__ import annotations

import argparse

import torch

from . import launches, plan, plots, whole
from .defaults import resolve


def check_at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Each flag of ``names`` (argparse dests) is >= 1, else an error naming the flag and its value."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")


def check_zigzag(p: argparse.ArgumentParser, cp_flag: str, cp_sizes, len_flag: str, seq_lens) -> None:
    """Every cp size >= 1 and every sequence length divisible by ``2 * cp`` (the zigzag chunks)."""
    for cp in cp_sizes:
        if cp < 1:
            p.error(f"{cp_flag}: {cp} must be >= 1")
        for seq_len in seq_lens:
            if seq_len % (2 * cp):
                p.error(f"{len_flag} {seq_len} must be divisible by 2 * cp = {2 * cp} (zigzag chunks)")


def check_cuda_attn_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--modes attn --device cuda``: one GPU per rank (NCCL refuses two ranks on one GPU) and a
    dtype FlashAttention-2 runs (PyTorch's ring, the peer, uses it)."""
    gpus, need = torch.cuda.device_count(), max(args.cp_sizes)
    if gpus < need:
        p.error(f"--modes attn --device cuda: --cp-sizes up to {need} needs {need} GPUs (one per rank; "
                f"NCCL refuses two ranks on one GPU), this machine has {gpus}; use --modes plan on one GPU")
    if args.dtype != "bfloat16":
        p.error(f"--modes attn --device cuda: --dtype {args.dtype}: use bfloat16 "
                "(PyTorch's ring runs FlashAttention-2)")


def check_shape(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The plan flags' attention shape (plan, launches, masks): every size >= 1, query heads a multiple of KV heads."""
    check_at_least_one(p, args, "plan_heads", "plan_kv_heads", "plan_head_dim", "thd_mean_doc")
    if args.plan_heads % args.plan_kv_heads:
        p.error(f"--plan-heads {args.plan_heads} must be a multiple of --plan-kv-heads {args.plan_kv_heads} (GQA)")


def check_plan_grid(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The plan and launches modes' grid: :func:`check_shape` and zigzag lengths (every head count runs: an
    all-to-all whose size does not split the heads pads them, :func:`~cp_handler.ops.ulysses.a2a_head_plan`)."""
    check_shape(p, args)
    check_zigzag(p, "--plan-cp-sizes", args.plan_cp_sizes, "--plan-seq-lens", args.plan_seq_lens)


def _shape(args: argparse.Namespace, device: str = "cuda") -> plan.PlanShape:
    return plan.PlanShape(num_heads=args.plan_heads, num_kv_heads=args.plan_kv_heads, head_dim=args.plan_head_dim,
                          dtype=args.plan_dtype, device=device)


def _check_attn_kernel(p: argparse.ArgumentParser, args: argparse.Namespace, formats) -> None:
    """A forced ``--attn-kernel`` runs the shape on ``--device`` in ``formats`` (plan, masks)."""
    if args.attn_kernel is not None:
        try:
            plan.check_kernel(args.attn_kernel, _shape(args, args.device), formats)
        except ValueError as err:
            p.error(str(err).replace("attn_kernel=", "--attn-kernel "))


def check_attn(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        check_cuda_attn_flags(p, args)
    check_zigzag(p, "--cp-sizes", args.cp_sizes, "--seq-lens", args.seq_lens)


def check_e2e(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        p.error("--device cuda runs --modes attn, plan and launches (e2e runs cp-train on gloo CPU ranks)")
    check_at_least_one(p, args, "e2e_steps", "reps")
    check_zigzag(p, "--cp-sizes", args.cp_sizes, "--e2e-seq-len", [args.e2e_seq_len])


def check_plan(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_plan_grid(p, args)
    _check_attn_kernel(p, args, args.formats)
    for fmt in args.formats:
        for name in args.whole_kernels:
            kernel = whole.resolve(name, fmt, args.device)
            reason = whole.cannot_run(kernel, args.device, getattr(torch, args.plan_dtype))
            if reason:
                p.error(f"--whole-kernels {name} ({fmt}): {reason}")


def check_launches(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_plan_grid(p, args)
    try:
        launches.check_kernels(args.launch_kernels, _shape(args))
    except ValueError as err:
        p.error(str(err))


def check_masks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_shape(p, args)
    _check_attn_kernel(p, args, ["bshd"])
    check_at_least_one(p, args, "mask_window", "mask_chunk", "mask_cp_size")
    check_zigzag(p, "--mask-cp-size", [args.mask_cp_size], "--mask-seq-len", [args.mask_seq_len])


def check_generate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device != "cpu":
        p.error("--modes generate runs on CPU ranks (gloo): drop --device cuda")
    check_at_least_one(p, args, "gen_new_tokens", "gen_hidden_size", "gen_layers", "gen_heads", "gen_kv_heads")
    if min(args.gen_prompt_lens) < 1 or min(args.gen_cp_sizes) < 1:
        p.error("--gen-prompt-lens and --gen-cp-sizes must be >= 1")
    if 1 not in args.gen_cp_sizes:
        p.error("--gen-cp-sizes must include 1 (the baseline of the efficiency)")
    if args.gen_heads % args.gen_kv_heads or args.gen_hidden_size % args.gen_heads:
        p.error(f"--gen-heads {args.gen_heads} must divide --gen-hidden-size {args.gen_hidden_size} and be a "
                f"multiple of --gen-kv-heads {args.gen_kv_heads}")


def check_hybrid(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device != "cpu":
        p.error("--modes hybrid runs on CPU ranks (gloo): drop --device cuda")
    check_at_least_one(p, args, "hybrid_hidden_size", "hybrid_heads", "hybrid_key_heads", "hybrid_head_dim")
    if args.hybrid_heads % args.hybrid_key_heads:
        p.error(f"--hybrid-heads {args.hybrid_heads} must be a multiple of --hybrid-key-heads {args.hybrid_key_heads}")
    check_zigzag(p, "--hybrid-cp-sizes", args.hybrid_cp_sizes, "--hybrid-seq-lens", args.hybrid_seq_lens)


def check_memory(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device != "cpu":
        p.error("--modes memory runs on CPU (saved-tensor counts are machine-independent): drop --device cuda")
    check_at_least_one(p, args, "mem_layer_tokens")
    check_zigzag(p, "cp size of --modes memory", [2], "--mem-seq-len", [args.mem_seq_len])


def check_compile(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device != "cpu":
        p.error("--modes compile runs on CPU ranks (gloo): drop --device cuda")
    check_zigzag(p, "--compile-cp-size", [args.compile_cp_size], "--compile-seq-len", [args.compile_seq_len])


def check_calibrate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Group sizes of at least 2; a dtype torch knows; CPU ranks unless a GPU per rank is there (NCCL)."""
    if any(size < 2 for size in args.calibrate_cp_sizes):
        p.error(f"--calibrate-cp-sizes {' '.join(map(str, args.calibrate_cp_sizes))}: a link needs groups of >= 2 "
                "ranks")
    if not isinstance(getattr(torch, args.calibrate_dtype, None), torch.dtype):
        p.error(f"--calibrate-dtype {args.calibrate_dtype}: not a torch dtype (float32, bfloat16, float16)")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.calibrate_cp_sizes):
        p.error(f"--calibrate --device cuda needs a GPU per rank: {torch.cuda.device_count()} GPUs for "
                f"--calibrate-cp-sizes up to {max(args.calibrate_cp_sizes)}")


def check_auto(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """CPU ranks only (the grid's links are measured here); a named or existing profile."""
    if args.device == "cuda":
        p.error("--modes auto measures the patterns on CPU ranks (gloo): drop --device cuda (on GPUs: the GPU pass)")
    if args.cost_profile:
        from ..auto import load_profile

        try:
            load_profile(args.cost_profile)
        except ValueError as err:
            p.error(f"--cost-profile: {err}")


def check_backtest(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nothing runs on a device: the model's predictions beside published results."""
    if args.device == "cuda":
        p.error("--modes backtest prices published GPU runs with the cost model (no device runs): drop --device cuda")


def check_links(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """CPU ranks (the shim wraps gloo's collectives); a2a+p2p at even sizes of 4 and more."""
    if args.device == "cuda":
        p.error("--modes links emulates links between CPU ranks (gloo): drop --device cuda")
    if any(c < 2 for c in args.links_cp_sizes):
        p.error(f"--links-cp-sizes {' '.join(map(str, args.links_cp_sizes))}: a link needs groups of >= 2 ranks")
    check_zigzag(p, "--links-cp-sizes", args.links_cp_sizes, "--links-seq-len", [args.links_seq_len])


def check_tp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """CPU ranks (cp-train's runs); a world of at least 2 ranks; each layout's own rules are cp-train's (checked per
    run before its ranks start)."""
    if args.device == "cuda":
        p.error("--modes tp runs cp-train on CPU ranks: drop --device cuda")
    if args.tp_world < 2:
        p.error(f"--tp-world {args.tp_world}: tensor parallelism needs at least 2 ranks")
    if args.tp_seq_len < 2 * args.tp_world:
        p.error(f"--tp-seq-len {args.tp_seq_len}: at least 2 tokens per rank of --tp-world {args.tp_world} (2 x world)")


RULES = {"attn": check_attn, "e2e": check_e2e, "plan": check_plan, "launches": check_launches, "masks": check_masks,
         "generate": check_generate, "hybrid": check_hybrid, "memory": check_memory, "compile": check_compile,
         "calibrate": check_calibrate, "auto": check_auto, "backtest": check_backtest,
         "links": check_links, "tp": check_tp}
"""Each mode's rules, given the flags with that mode's defaults filled in (:func:`~.defaults.resolve`)."""

TIMED_ON_DEVICE = ("attn", "plan", "masks")
"""Modes that run kernels on ``--device`` (launches counts CUDA kernels on ``meta`` tensors: no GPU needed)."""


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every requested mode's rules, on the flags with that mode's defaults filled in (:func:`~.defaults.resolve`),
    before any run. Exits through ``p.error`` naming the flag, its value and the rule."""
    if not args.no_plots:
        try:
            plots.require_matplotlib()
        except ImportError as err:
            p.error(str(err))
    timed = [mode for mode in args.modes if mode in TIMED_ON_DEVICE]
    if args.device == "cuda" and timed and not torch.cuda.is_available():
        p.error(f"--device cuda: no CUDA device is available here (--modes {' '.join(timed)} runs on it; "
                "launches needs none)")
    for mode in dict.fromkeys(args.modes):
        RULES[mode](p, resolve(args, mode))
