"""cp-train's training flags: steps, the learning-rate schedule, gradient clipping, micro-batches
(gradient accumulation), activation recomputation, per-block compilation and the memory flags (FSDP2, activation
offload, loss and MLP chunks), the deterministic mode, with their rules. Every error names the flag."""

from __future__ import annotations

import argparse

import torch

from ..core.comm_types import CANONICAL_COMM_TYPES
from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask
from ..ops.tiling import tiles_refusal
from ..training.schedule import DECAY_STYLES


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """The "training" group of cp-train's flags."""
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=50, help="optimizer steps")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (finite, > 0): the peak of the schedule")
    g.add_argument("--lr-warmup-steps", type=int, default=0, metavar="N",
                   help="linear warm-up of the learning rate over the first N steps (0: none; Megatron-LM's "
                        "schedule)")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="constant",
                   help="after the warm-up: keep --lr, or decay it linearly or along a cosine to --min-lr")
    g.add_argument("--lr-decay-steps", type=int, default=None, metavar="N",
                   help="linear / cosine: the step at which the decay reaches --min-lr, counted from the start of "
                        "the run (default: --steps; give it when a resumed run will go on longer)")
    g.add_argument("--min-lr", type=float, default=0.0, help="linear / cosine: the learning rate at the end of the "
                                                                  "decay (0 <= --min-lr <= --lr)")
    g.add_argument("--clip-grad", type=float, default=0.0,
                   help="clip the global gradient norm to this before each optimizer step (0: no clipping)")
    g.add_argument("--recompute", action="store_true",
                   help="recompute every layer's activations in the backward instead of keeping them (activation "
                        "checkpointing: Megatron-LM's full recompute; transformers' gradient checkpointing): less "
                        "memory per rank for one more forward of each layer, its CP communication included")
    g.add_argument("--compile", action="store_true",
                   help="compile every layer with torch.compile (Inductor, fullgraph=True, one layer at a time, as "
                        "torchtitan's --compile); the CP attention is one operator in each layer's graph, so a "
                        "handler per batch recompiles nothing (docs/compile.md); not with --moe-experts or a Hugging "
                        "Face model's linear-attention / Mamba mixers")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer states over every rank of the job (FSDP2's "
                        "fully_shard over dp x cp, one unit per layer) instead of replicating them (DDP)")
    g.add_argument("--offload-activations", action="store_true",
                   help="keep the activations saved for the backward in pinned host memory instead of GPU memory "
                        "(torch.autograd.graph.save_on_cpu; exact: copies); CUDA only, not yet run on a GPU")
    g.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N",
                   help="compute the logits and the loss over chunks of N of a rank's tokens, each recomputed in the "
                        "backward, so at most N x vocabulary logits exist at once (0: the whole loss at once; "
                        "default: chunks of 4096 when a rank's float32 logits would exceed 256 MiB)")
    g.add_argument("--mlp-chunk-tokens", type=int, default=None, metavar="N",
                   help="run every feed-forward block over chunks of N of a rank's tokens, each recomputed in the "
                        "backward (ALST's tiled MLP), so the backward keeps no MLP intermediates beyond one chunk's, "
                        "for one more forward of each MLP (default: off; dense MLPs only, not --moe-experts)")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per forward/backward: each step accumulates gradients over --batch-size / "
                        "--micro-batch-size passes (Megatron-LM's micro-batches; default --batch-size: one pass)")


def check_lr_schedule(args: argparse.Namespace) -> int | None:
    """The schedule's flags fit together; returns where the decay ends (``None``: constant).
    Raises ValueError naming the flag."""
    if args.lr_decay_style == "constant":
        for flag, value, default in (("--lr-decay-steps", args.lr_decay_steps, None), ("--min-lr", args.min_lr, 0.0)):
            if value != default:
                raise ValueError(f"{flag} {value} needs --lr-decay-style linear or cosine (the learning rate is "
                                 "constant after the warm-up)")
        return None
    decay_steps = args.lr_decay_steps if args.lr_decay_steps is not None else args.steps
    if decay_steps <= args.lr_warmup_steps:
        raise ValueError(f"--lr-decay-steps {decay_steps} must be > --lr-warmup-steps {args.lr_warmup_steps} (the "
                         "decay starts after the warm-up; --lr-decay-steps defaults to --steps)")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} must be <= --lr {args.lr}")
    return decay_steps


def check_micro_batch_size(args: argparse.Namespace) -> int | None:
    """``--micro-batch-size`` divides ``--batch-size``; dynamic CP makes its own micro-batches. Returns it.
    Raises ValueError naming the flags."""
    if args.micro_batch_size is None:
        return None
    if args.dynamic_cp:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: --dynamic-cp schedules its own micro-batches "
                         "(--max-seqlen-per-rank); drop one of them")
    if args.batch_size % args.micro_batch_size:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size} must divide --batch-size {args.batch_size}")
    return args.micro_batch_size


def check_offload(args: argparse.Namespace) -> bool:
    """``--offload-activations`` needs CUDA. Raises ValueError naming the flag."""
    if args.offload_activations and not torch.cuda.is_available():
        raise ValueError("--offload-activations: no CUDA device here; on the CPU the activations already live in "
                         "host memory, so offloading them cannot save anything")
    return args.offload_activations


def check_fsdp(args: argparse.Namespace) -> bool:
    """``--fsdp`` and what it does not combine with. Raises ValueError naming the flags."""
    reasons = {"--moe-experts": "experts are sharded over ep and reduced by their own groups",
               "--dynamic-cp": "each rank runs other CP groups per step and reduces the gradients itself"}
    for flag, value in (("--moe-experts", args.moe_experts), ("--dynamic-cp", args.dynamic_cp)):
        if args.fsdp and value:
            raise ValueError(f"--fsdp with {flag}: not implemented ({reasons[flag]}); drop one of them")
    return args.fsdp


def check_loss_chunk_tokens(args: argparse.Namespace) -> int | None:
    """``--loss-chunk-tokens`` (``None``: automatic). Raises ValueError naming the flag."""
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 0:
        raise ValueError(f"--loss-chunk-tokens {args.loss_chunk_tokens} must be >= 0 (0: the whole loss at once)")
    return args.loss_chunk_tokens


def check_mlp_chunk_tokens(args: argparse.Namespace) -> int | None:
    """``--mlp-chunk-tokens`` (``None``: off) is >= 1 and meets dense MLPs only. Raises ValueError naming the
    flags (a Hugging Face model's MLPs are checked by :func:`~.model_args.check_hf_training`)."""
    if args.mlp_chunk_tokens is None:
        return None
    if args.mlp_chunk_tokens < 1:
        raise ValueError(f"--mlp-chunk-tokens {args.mlp_chunk_tokens} must be >= 1 (leave it out for whole MLPs)")
    if args.moe_experts:
        raise ValueError(f"--mlp-chunk-tokens with --moe-experts {args.moe_experts}: a mixture of experts routes and "
                         "balances its load over all tokens, it is not tiled; drop one of them")
    return args.mlp_chunk_tokens


def check_compile(args: argparse.Namespace, gpt_config, backend: str, handler_cls) -> bool:
    """``--compile``: a layer compiles whole when its CP work is operators of a backend that declares them
    (``opaque_under_compile``, :mod:`cp_handler.handlers.opaque`: the attention, the reference GPT's Gated DeltaNet
    convolution and delta rule); the reference GPT's expert exchange is not one yet (a Hugging Face model's mixers:
    :func:`check_compile_mixers`). Raises ValueError naming the flag."""
    if not args.compile:
        return False
    if not handler_cls.opaque_under_compile:
        raise ValueError(f"--compile with --backend {backend}: its attention is not one operator under "
                         "torch.compile (it reads its own state on the attention module); use --backend local")
    if args.moe_experts:
        raise ValueError(f"--compile with --moe-experts {args.moe_experts}: the expert exchange is not one operator "
                         "under torch.compile yet (a layer would not compile whole); leave one of them out")
    return True


def routed_mixers(config) -> list[str]:
    """The classes of the token mixers (gated delta rule, Mamba, short convolutions) that a Hugging Face ``config``'s
    model routes through the handler (:func:`~cp_handler.integrations.hf_mixers.kernel_names`; built on ``meta``)."""
    from transformers import AutoModelForCausalLM

    from ..integrations.hf_mixers import kernel_names

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sorted({type(m).__name__ for m in model.modules() if kernel_names(m)})  # kernels, or helpers to them


def check_compile_mixers(config) -> None:
    """``--compile`` with a Hugging Face config: no token mixer routed through the handler (the routes find the
    forward's handler in a context variable, which Dynamo cannot trace, so the layer would not compile whole).
    Raises ValueError."""
    mixers = routed_mixers(config)
    if mixers:
        raise ValueError(f"--compile: {', '.join(mixers)} reach the handler through a context variable, which "
                         "torch.compile cannot trace (a layer would not compile whole); leave --compile out")


def check_deterministic_mixers(config) -> None:
    """``--deterministic`` with a Hugging Face config: no token mixer other than attention (their halo convolution
    and state passing compute in pieces that follow the CP group; the handler refuses them in the mode too).
    Raises ValueError."""
    mixers = routed_mixers(config)
    if mixers:
        raise ValueError(f"--deterministic: {', '.join(mixers)} mix tokens other than by attention, which is not "
                         "bitwise the same at every CP degree (docs/deterministic.md); leave --deterministic out")


DETERMINISTIC_REFUSED = {
    "dynamic_cp": "documents are packed (thd) and their CP groups change per micro-batch",
}
"""Flags ``--deterministic`` does not combine with, and why (each refused by name)."""


def check_deterministic(args: argparse.Namespace) -> None:
    """``--deterministic``: ``--cp-comm-type`` a2a (its default then; p2p without the flag), or p2p, all_gather or
    a2a+p2p on canonical tiles (thd packing, or bshd and a ``--seq-len`` whose zigzag chunks over the ring's ranks
    are whole tiles: a2a+p2p's p2p level from ``--hierarchical-cp-sizes``, else the whole CP size), or auto (among
    the patterns that run each call), and none of :data:`DETERMINISTIC_REFUSED`. Raises ValueError naming the flag."""
    if not args.deterministic:
        args.cp_comm_type = args.cp_comm_type or "p2p"
        return
    args.cp_comm_type = args.cp_comm_type or "a2a"
    types = [t.strip() for t in args.cp_comm_type.split(",")]
    for comm_type in sorted(set(types) & set(CANONICAL_COMM_TYPES)):
        if args.packing == "thd":  # a 48th of each document: 2 x cp must divide 48 (checked by the handler)
            continue
        sizes = getattr(args, "hierarchical_cp_sizes", None)
        ring = sizes[-1] if comm_type == "a2a+p2p" and sizes else args.cp_size
        refusal = tiles_refusal(ZigzagDocs.uniform(args.seq_len, ring), AttentionMask(), ring, comm_type)
        if refusal:
            raise ValueError(f"--seq-len {args.seq_len}: {refusal}")
    for name, why in DETERMINISTIC_REFUSED.items():
        value = getattr(args, name, None)
        if value:
            raise ValueError(f"--deterministic with --{name.replace('_', '-')}: not implemented ({why}); drop one of "
                             "them")
