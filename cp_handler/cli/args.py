"""Flags of ``cp-train`` and every rule between them, checked before any rank starts."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from ..dynamic.scheduler import cp_size_for, group_sizes
from ..handlers import get_cp_handler_cls
from ..handlers.registry import load_plugins
from ..ops.patterns import PATTERNS
from ..runtime.config import CP_COMM_TYPES, ContextParallelConfig, check_seq_len
from ..runtime.groups import check_world_divisible
from ..runtime.launch import is_first_rank, rank_env, under_torchrun
from ..runtime.parallel_layout import ParallelLayout, default_hierarchical_sizes
from ..training import DynamicCP, TrainConfig
from ..training.eval_cp import check_eval_layout, eval_config
from ..training.tensor_parallel import TP_REFUSED, check_tensor_parallel, local_attention_shape
from .checkpoint_args import add_checkpoint_flags, check_checkpoint_flags, check_checkpoints, check_resume_folder
from .common import check_numbers, check_writable, world_size_from
from .data_args import check_data
from .flag_names import EVAL_FLAGS, FlagParser, HelpFormatter, flags_in_errors, to_flags
from .model_args import check_moe_flags, hf_config, hf_layers, model_shape
from .training_args import (
    add_training_flags,
    check_compile,
    check_deterministic,
    check_fsdp,
    check_loss_chunk_tokens,
    check_lr_schedule,
    check_micro_batch_size,
    check_mlp_chunk_tokens,
    check_offload,
)

DTYPES = ("float32", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    """The flags of cp-train, in groups: layout, context parallelism, model, data, training, checks, output."""
    p = FlagParser(
        prog="cp-train", formatter_class=HelpFormatter,
        description="Train the reference GPT (or a Hugging Face causal LM) context-parallel on real text "
        "(byte-level tokens). Spawns --nproc ranks itself, or runs as one rank under torchrun. Every rule "
        "between the flags is checked before any rank starts (docs/cp-train.md).",
    )
    g = p.add_argument_group("layout (ranks and groups)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default: WORLD_SIZE under torchrun, else 1)")
    g.add_argument("--cp-size", type=int, default=None,
                   help="context_parallel_size: ranks one sequence is split over (default: all ranks); "
                        "world = tp x cp x dp, CP groups on adjacent ranks (every tp-th rank with --tp-size)")
    g.add_argument("--tp-size", type=int, default=1,
                   help="tensor_model_parallel_size: ranks one layer's heads and MLP are split over (PyTorch's tensor "
                        "parallelism; the reference GPT, or a Hugging Face model by transformers' plan; default 1); "
                        "world = tp x cp x dp, TP ranks adjacent; --backend auto is local with it "
                        "(docs/parallel_layout.md)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp-size: Megatron-LM's sequence parallelism: norms and residuals on each TP rank's "
                        "share of the tokens (activations / tp there), gathered before attention and the MLP and "
                        "reduce-scattered after them; the reference GPT (default off)")
    g.add_argument("--expert-parallel-size", type=int, default=1,
                   help="expert_model_parallel_size: ranks sharing one copy of the experts (divides dp x cp)")
    g.add_argument("--print-layout", action="store_true", help="print the rank layout of every group kind")
    g.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a rank that makes no progress for this long (frozen, dead, or stuck in a collective) ends "
                        "every rank; also the process groups' collective timeout")
    g = p.add_argument_group("context parallelism")
    g.add_argument("--backend", default="auto",
                   help="handler backend: auto (transformer_engine where it is installed with CUDA, else local; "
                        "local with --tp-size above 1), "
                        "local, transformer_engine, magi, or any registered name")
    g.add_argument("--cp-comm-type", default=None,
                   help=f"one of {', '.join(CP_COMM_TYPES)}, auto (chosen per batch from --cp-comm-profile), or a "
                        "comma-separated list with one per layer (default: p2p; a2a with --deterministic)")
    g.add_argument("--deterministic", action="store_true",
                   help="attention, logits, loss and parameter gradients bitwise the same at every --cp-size "
                        "(docs/deterministic.md): --cp-comm-type a2a (the default then), p2p, all_gather, a2a+p2p "
                        "on canonical tiles or auto among them; bshd (zigzag chunks of whole tiles) or thd (2 x cp "
                        "divides 48); --backend local; the reference GPT (any --tp-size) or a Hugging Face model "
                        "without token mixers other than attention; gradients all-reduced in float32 under "
                        "--tp-size, --fsdp, --compile and fused experts (docs/deterministic.md)")
    g.add_argument("--cp-comm-profile", default=None, metavar="NAME_OR_JSON",
                   help="--cp-comm-type auto: the cost profile, a name (h100-nvlink, h200-nvlink, cpu-2core-gloo) or "
                        "a JSON file of cp-bench --calibrate; default: the device's (docs/auto_plan.md)")
    g.add_argument("--hierarchical-cp-sizes", type=int, nargs="+", default=None, metavar="SIZE",
                   help="hierarchical_context_parallel_sizes, inner (a2a, adjacent ranks) first, e.g. 2 2; default "
                        "for a2a+p2p (and auto across nodes): the node boundary, a2a over a CP group's ranks on one "
                        "node (torchrun's LOCAL_WORLD_SIZE), p2p across nodes")
    g.add_argument("--dynamic-cp", action="store_true",
                   help="each global batch gives every document a CP group size (a divisor of the world or a power of "
                        "two) from the cost model (documents = files, cut at --seq-len tokens; docs/dynamic_cp.md)")
    g.add_argument("--max-seqlen-per-rank", type=int, default=None,
                   help="--dynamic-cp: token budget of one rank in one micro-batch (max_seqlen_per_dp_cp_rank); "
                        "required with --dynamic-cp, no default")
    g.add_argument("--min-cp-size", type=int, default=1,
                   help="--dynamic-cp: min_dynamic_context_parallel_size (a divisor of the world or a power of two)")
    g.add_argument("--max-cp-size", type=int, default=None,
                   help="--dynamic-cp: max_dynamic_context_parallel_size (a divisor of the world or a power of two; "
                        "equal to --min-cp-size: static CP; default: the world)")
    g.add_argument("--eval-cp-size", type=int, default=None,
                   help="CP size of evaluation (default: training's)")
    g.add_argument("--eval-hierarchical-cp-sizes", type=int, nargs="+", default=None, metavar="SIZE",
                   help="hierarchical sizes at the evaluation CP size (a2a+p2p)")
    g = p.add_argument_group("model")
    g.add_argument("--hf-config", default=None, metavar="DIR",
                   help="train a Hugging Face causal LM built from DIR/config.json (random init) through "
                        "cp_handler.integrations.transformers; the GPT shape flags below are then not used; "
                        "text is read with DIR's tokenizer when it has one, else as bytes")
    g.add_argument("--hf-model", default=None, metavar="DIR", help="as --hf-config, with the weights in DIR")
    g.add_argument("--hidden-size", type=int, default=128, help="reference GPT: hidden size")
    g.add_argument("--num-layers", type=int, default=2, help="reference GPT: transformer layers")
    g.add_argument("--num-heads", type=int, default=4, help="reference GPT: query heads (num_attention_heads)")
    g.add_argument("--num-kv-heads", type=int, default=2,
                   help="reference GPT: KV heads (num_query_groups, GQA; divides --num-heads)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="reference GPT: head dim of queries and keys (kv_channels; default --hidden-size / "
                        "--num-heads)")
    g.add_argument("--v-head-dim", type=int, default=None,
                   help="reference GPT: head dim of values (Megatron's MLA v_head_dim, as DeepSeek-V3's 128 against "
                        "192; default --kv-channels)")
    g.add_argument("--ffn-hidden-size", type=int, default=352, help="reference GPT: SwiGLU hidden size")
    g.add_argument("--layer-pattern", default=None, metavar="PATTERN",
                   help="reference GPT: token mixer per layer, A (attention) or L (linear attention: Gated DeltaNet), "
                        "repeated over --num-layers (LLLA: three linear layers to one attention layer, as "
                        "Qwen3-Next); default all attention")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="reference GPT: RoPE base (theta)")
    g.add_argument("--moe-experts", type=int, default=0,
                   help="reference GPT: experts per MoE layer (0: dense SwiGLU layers)")
    g.add_argument("--moe-top-k", type=int, default=2, help="experts per token (moe_router_topk)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2, help="load-balancing loss coefficient")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter and activation dtype")
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="*", default=None,
                   help="UTF-8 text files or folders (default: the Python stdlib sources)")
    g.add_argument("--max-corpus-bytes", type=int, default=32 << 20, help="read at most this many bytes")
    g.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (global, before CP sharding)")
    g.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel rank and step")
    g.add_argument("--packing", choices=("bshd", "thd"), default="bshd",
                   help="bshd: fixed-length sequences; thd: files cut into documents of at most --thd-max-doc-len "
                        "tokens, packed into each sequence with cu_seqlens")
    g.add_argument("--thd-max-doc-len", type=int, default=None,
                   help="thd: longest document in tokens (default --seq-len // 4, so every sequence packs several)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batch order")
    add_training_flags(p)
    g = p.add_argument_group("checks")
    g.add_argument("--check-parity", action="store_true",
                   help="before every optimizer step, rank 0 runs the same global batch on one process from the "
                        "same parameters and compares the loss, the whole gradient and its global norm (relative "
                        "difference, tolerance 1e-5 in float32, 2e-2 in bfloat16); non-zero exit if any step differs")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate held-out batches every K steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=2, help="held-out batches per evaluation")
    g.add_argument("--check-eval-cp", action="store_true",
                   help="after training, evaluate one held-out batch at training's and at the evaluation CP size "
                        "and fail unless the losses agree")
    g = p.add_argument_group("output")
    g.add_argument("--metrics-out", default=None, metavar="FILE",
                   help="write JSON metrics (config, per-step loss, tokens/s, memory), atomically")
    g.add_argument("--log-every", type=int, default=None,
                   help="progress line every N steps when stderr is not a terminal (default: --steps // 10)")
    add_checkpoint_flags(p)
    return p


POSITIVE = ("nproc", "cp_size", "eval_cp_size", "steps", "batch_size", "seq_len", "num_layers", "hidden_size",
            "num_heads", "num_kv_heads", "kv_channels", "v_head_dim", "ffn_hidden_size", "eval_batches",
            "max_corpus_bytes",
            "min_cp_size", "max_cp_size", "max_seqlen_per_rank", "expert_parallel_size", "tp_size", "moe_top_k",
            "thd_max_doc_len", "log_every", "save_keep", "lr_decay_steps", "micro_batch_size")
"""Integer flags that must be >= 1 when given; zero is never "the default"."""
POSITIVE_FLOATS = ("timeout", "lr", "rotary_base")
"""Float flags that must be finite and > 0 (``--lr nan`` would train on NaN)."""
NON_NEGATIVE_FLOATS = ("moe_aux_loss_coeff", "min_lr", "clip_grad")
"""Float flags that must be finite and >= 0."""
NON_NEGATIVE = ("eval_every", "moe_experts", "save_every", "lr_warmup_steps")
"""Integer flags that must be >= 0."""


def check_positive(args: argparse.Namespace) -> None:
    """cp-train's number flags (:func:`~.rules.check_numbers`). Raises ValueError naming the first broken one."""
    check_numbers(args, POSITIVE, NON_NEGATIVE, POSITIVE_FLOATS, NON_NEGATIVE_FLOATS)


def hierarchical_sizes(args: argparse.Namespace, world: int, cp_size: int, tp: int = 1) -> list[int] | None:
    """``--hierarchical-cp-sizes``, or by default the levels of the node boundary (a2a inside a node, p2p across:
    :func:`~cp_handler.runtime.parallel_layout.default_hierarchical_sizes`), the ranks per node from torchrun's
    ``LOCAL_WORLD_SIZE`` (spawned by cp-train: one node), named on stderr."""
    if args.hierarchical_cp_sizes is not None or args.dynamic_cp or world % (cp_size * tp):
        return args.hierarchical_cp_sizes
    env = rank_env()
    per_node = env.local_world_size if env is not None else world
    with flags_in_errors({"hierarchical_context_parallel_sizes": "--hierarchical-cp-sizes"}):
        sizes = default_hierarchical_sizes(comm_type_arg(args.cp_comm_type),
                                           ParallelLayout(world, tensor_model_parallel_size=tp,
                                                          context_parallel_size=cp_size), per_node)
    if sizes is not None and is_first_rank():
        print(f"cp-train: --hierarchical-cp-sizes {sizes[0]} {sizes[1]} from the node boundary ({per_node} ranks per "
              "node, LOCAL_WORLD_SIZE): a2a inside a node, p2p across", file=sys.stderr)
    return sizes


def comm_type_arg(text: str) -> str | list[str]:
    parts = [t.strip() for t in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def validate(args: argparse.Namespace) -> TrainConfig:
    """Check every rule and build the run's frozen :class:`~cp_handler.training.TrainConfig`.

    Raises:
        ValueError / TypeError / ImportError / RuntimeError: naming the flag and the rule.
    """
    check_positive(args)
    check_deterministic(args)
    check_resume_folder(args)  # first: a missing folder is named at once, not after the data is read and hashed
    lr_decay_steps = check_lr_schedule(args)
    world = world_size_from(args)
    if args.nproc is not None and args.nproc != world:
        raise ValueError(f"--nproc {args.nproc} differs from torchrun's WORLD_SIZE={world}")
    dynamic = check_dynamic(args, world) if args.dynamic_cp else None
    tp = check_tp_flags(args, world)
    world_cp = world // tp  # the ranks of one TP position: CP and DP split them as without TP
    cp_size = args.cp_size if args.cp_size is not None else world_cp
    check_rank_count(args, world_cp, cp_size)
    packing = "thd" if dynamic else args.packing
    args.hierarchical_cp_sizes = hierarchical_sizes(args, world, cp_size, tp)
    model, attn_shape, heads_source = model_shape(args)
    if tp > 1:
        check_tp_model(args, model, tp)
        attn_shape = local_attention_shape(attn_shape, tp)  # what each TP rank's attention runs
        heads_source += f" split over --tp-size {tp}"
    config = ContextParallelConfig(
        context_parallel_size=cp_size,
        cp_comm_type=comm_type_arg(args.cp_comm_type),
        hierarchical_context_parallel_sizes=args.hierarchical_cp_sizes,
        backend=resolve_backend(args.backend, tp),
        qkv_format=packing,
        num_layers=model.num_layers if model else hf_layers(args),
        cp_comm_profile=args.cp_comm_profile,
        deterministic=args.deterministic,
    )
    check_seq_len(args.seq_len, cp_size, packing)
    check_moe_flags(args)
    ParallelLayout(world, tensor_model_parallel_size=tp, context_parallel_size=cp_size,
                   expert_model_parallel_size=args.expert_parallel_size,
                   hierarchical_context_parallel_sizes=args.hierarchical_cp_sizes)
    handler_cls = get_cp_handler_cls(config.backend, config.cp_comm_type)
    handler_cls.check_available()
    runs_mixers = handler_cls.token_layout_cls.mixers_cls.runs_mixers
    if model is not None and "linear_attention" in (model.layer_types or ()) and not runs_mixers:
        raise ValueError(f"--layer-pattern {args.layer_pattern}: --backend {config.backend} runs attention only; "
                         "linear-attention layers need --backend local or transformer_engine")
    with flags_in_errors(EVAL_FLAGS):
        evaluation = eval_config(config, args.eval_cp_size or cp_size, args.eval_hierarchical_cp_sizes)
        check_eval_layout(world_cp, evaluation, args.seq_len)
    if dynamic:
        sizes = [(replace(config, context_parallel_size=n), "a --dynamic-cp group of")
                 for n in dynamic_sizes(dynamic, world)]
    else:
        sizes = [(config, "--cp-size"), (evaluation, "--eval-cp-size")]
    for cp_config, flag in sizes:
        try:
            handler_cls.check_config(cp_config, attn_shape, getattr(torch, args.dtype))
        except ValueError as err:
            raise ValueError(f"{heads_source} with {flag} {cp_config.context_parallel_size}: {err}") from None
    compile_layers = check_compile(args, model, config.backend, handler_cls)
    check_data(args, world_cp // evaluation.context_parallel_size, dynamic is not None)
    check_writable("--metrics-out", args.metrics_out)
    check_checkpoint_flags(args)
    config = TrainConfig(
        world_size=world, cp=config, eval_cp=evaluation, attn_shape=attn_shape, model=model, tensor_parallel_size=tp,
        sequence_parallel=args.sequence_parallel,
        hf_source=args.hf_model or args.hf_config, hf_weights=bool(args.hf_model), dynamic=dynamic,
        expert_parallel_size=args.expert_parallel_size, print_layout=args.print_layout, timeout=args.timeout,
        data=tuple(args.data) if args.data else None, max_corpus_bytes=args.max_corpus_bytes, seq_len=args.seq_len,
        batch_size=args.batch_size, micro_batch_size=check_micro_batch_size(args),
        thd_max_doc_len=args.thd_max_doc_len, dtype=args.dtype, seed=args.seed,
        steps=args.steps, lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_style=args.lr_decay_style, lr_decay_steps=lr_decay_steps, clip_grad=args.clip_grad,
        recompute=args.recompute, compile=compile_layers, loss_chunk_tokens=check_loss_chunk_tokens(args),
        fsdp=check_fsdp(args),
        offload_activations=check_offload(args), mlp_chunk_tokens=check_mlp_chunk_tokens(args),
        check_parity=args.check_parity, eval_every=args.eval_every,
        eval_batches=args.eval_batches, check_eval_cp=args.check_eval_cp, log_every=args.log_every,
        save_dir=args.save, save_every=args.save_every, save_keep=args.save_keep, resume=args.resume,
        export_hf=args.export_hf, allow_data_change=args.allow_data_change,
    )
    return check_checkpoints(args, config)


def check_tp_flags(args: argparse.Namespace, world: int) -> int:
    """``--tp-size``: it divides the world, and what it does not combine with is refused by name. Raises
    ValueError."""
    tp = args.tp_size
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel splits the tokens over the TP group: it needs --tp-size above 1")
    if args.sequence_parallel and (args.hf_config or args.hf_model or args.moe_experts):
        raise ValueError("--sequence-parallel is built for the reference GPT's dense layers: drop it with "
                         "--hf-config / --hf-model / --moe-experts")
    if tp == 1:
        return tp
    if world % tp:
        raise ValueError(f"--tp-size {tp} does not divide the {world} ranks: world = tp x cp x dp")
    for field, why in TP_REFUSED.items():  # the training run's rules, said with the flags
        name = "dynamic_cp" if field == "dynamic" else field
        if getattr(args, name, None):
            raise ValueError(f"--tp-size {tp} with --{name.replace('_', '-')}: not implemented ({why}); drop one of "
                             "them")
    if args.backend not in ("auto", "local"):
        raise ValueError(f"--tp-size {tp} with --backend {args.backend}: tensor parallelism is tested with the "
                         "local backend only")
    if args.eval_cp_size is not None and args.eval_cp_size != args.cp_size:
        raise ValueError(f"--tp-size {tp} with --eval-cp-size {args.eval_cp_size}: evaluation at another CP degree "
                         "builds its own groups without TP (not implemented); evaluate at the training degree")
    return tp


def check_tp_model(args: argparse.Namespace, model, tp: int) -> None:
    """The model splits over ``tp`` ranks: the reference GPT's rules, or a Hugging Face model's plan in transformers
    (:func:`~cp_handler.integrations.hf_tensor_parallel.hf_tp_plan`, on the ``meta`` device). Raises ValueError."""
    if model is not None:
        check_tensor_parallel(model, tp)
        return
    from transformers import AutoModelForCausalLM

    from ..integrations.hf_tensor_parallel import hf_tp_plan

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(args))
    try:
        hf_tp_plan(hf, tp)
    except ValueError as err:
        raise ValueError(f"{args.hf_model or args.hf_config}: {err}") from None


def check_rank_count(args: argparse.Namespace, world: int, cp_size: int) -> None:
    """The world holds whole CP groups; a forgotten ``--nproc`` is named as such. Raises ValueError."""
    if cp_size > world and args.nproc is None and not under_torchrun():
        raise ValueError(f"--cp-size {cp_size} needs at least {cp_size} ranks, but --nproc defaults to 1 outside "
                         f"torchrun: add --nproc {cp_size} (or a multiple of it for data parallelism)")
    try:
        check_world_divisible(world, cp_size)
    except ValueError as err:
        raise ValueError(f"--cp-size {cp_size}: {err}") from None


def check_dynamic(args: argparse.Namespace, world: int) -> DynamicCP:
    """Rules of --dynamic-cp (packing becomes thd). Raises ValueError."""
    if args.max_seqlen_per_rank is None or args.max_seqlen_per_rank < 1:
        raise ValueError("--dynamic-cp needs --max-seqlen-per-rank N (N >= 1)")
    if args.cp_size is not None:
        raise ValueError("--dynamic-cp chooses the CP size of every micro-batch: drop --cp-size")
    if args.eval_every or args.check_eval_cp or args.eval_cp_size:
        raise ValueError("--dynamic-cp does not run evaluation: drop --eval-every / --eval-cp-size / --check-eval-cp")
    hierarchical = [t for t in comm_type_arg(args.cp_comm_type) if t in PATTERNS and PATTERNS[t].hierarchical]
    if hierarchical or args.hierarchical_cp_sizes:
        raise ValueError(f"--dynamic-cp builds groups of several sizes: a hierarchical --cp-comm-type "
                         f"({hierarchical or 'a2a+p2p'}) / --hierarchical-cp-sizes has no levels for them; use p2p, "
                         "all_gather or a2a")
    sizes = group_sizes(world, args.min_cp_size, args.max_cp_size)  # the size rules
    cp_size_for(args.seq_len, args.max_seqlen_per_rank, sizes)  # the longest piece must fit
    return DynamicCP(args.max_seqlen_per_rank, args.min_cp_size, args.max_cp_size)


def dynamic_sizes(dynamic: DynamicCP, world: int) -> list[int]:
    """Every CP group size dynamic CP may build (the world's divisors and the powers of two up to it, ascending)."""
    return group_sizes(world, dynamic.min_cp_size, dynamic.max_cp_size)


def resolve_backend(backend: str, tp: int = 1) -> str:
    """``"auto"`` -> ``"transformer_engine"`` if it can run here and ``tp`` is 1 (tensor parallelism runs on the local
    backend only: :func:`check_tp_flags`), else ``"local"``; others unchanged."""
    if backend != "auto":
        return backend
    if tp > 1:
        return "local"
    try:
        get_cp_handler_cls("transformer_engine", "p2p").check_available()
        return "transformer_engine"
    except (ImportError, RuntimeError):
        return "local"


def parse(argv: list[str] | None = None) -> tuple[TrainConfig, str | None]:
    """Parse and validate: ``(the run's config, --metrics-out)``; a broken rule exits with status 1 and
    one line ``cp-train: error: <rule>`` naming the flags."""
    args = build_parser().parse_args(argv)
    try:
        load_plugins()
        config = validate(args)
    except (ValueError, TypeError, ImportError, RuntimeError) as err:
        raise SystemExit(f"cp-train: error: {to_flags(str(err))}") from None
    if args.backend == "auto" and is_first_rank():  # once per job, also under torchrun
        print(f"cp-train: --backend auto picked {config.cp.backend!r}", file=sys.stderr)
    return config, args.metrics_out
