"""End-to-end figures for ``cp-bench --modes e2e``: training throughput, activation memory, cp=1 cost.

* ``train``: a training run (:func:`~cp_handler.training.run.run_training`, what ``cp-train`` calls)
  at each cp size (one sequence per step, ``cp`` ranks): mean tokens/s after the first step and
  peak RSS per rank, from its metrics.
* ``memory``: one GPT training step (forward + backward of the local shard) under
  ``MemTracker`` on every rank: peak bytes live by category; ``activation_bytes`` is the peak
  minus parameters, gradients and optimizer state, the part context parallelism divides.
* ``overhead``: at cp=1 in one process, the reference GPT's forward + backward through our
  cp=1 handler vs through :class:`~cp_handler.training.reference.PlainAttention`, the same model with
  RoPE and ``F.scaled_dot_product_attention`` called directly; interleaved repetitions; the overhead is the
  median of the per-round time ratios minus one.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from ..handlers import build_cp_handler
from ..models import GPTConfig, GPTModel
from ..runtime.config import AttentionShape, ContextParallelConfig
from ..runtime.groups import build_dp_cp_groups
from ..runtime.launch import launch, rank_session
from ..training import TrainConfig, masked_token_loss_sum, next_token_batch
from ..training.reference import PlainAttention
from ..training.run import run_training
from ..training.tokens import BYTE_VOCAB_SIZE
from .case_progress import each_case

MODEL = {"hidden_size": 256, "num_layers": 2, "num_attention_heads": 8, "num_query_groups": 4, "ffn_hidden_size": 704}


def _model() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(**MODEL))


def _tokens(seq_len: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))


def _train_step(model: GPTModel, handler, tokens: torch.Tensor) -> None:
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask).backward()


def memory_worker(seq_len: int) -> list[dict]:
    """One training step per rank under MemTracker; rows of every rank (on rank 0)."""
    with rank_session("cp-bench", device_type="cpu"):
        groups = build_dp_cp_groups(dist.get_world_size())
        handler = build_cp_handler(ContextParallelConfig(context_parallel_size=groups.cp_size),
                                   groups.cp_group if groups.cp_size > 1 else None)
        model, tokens = _model(), _tokens(seq_len)
        _train_step(model, handler, tokens)  # warm-up: lazily built state is not an activation
        model.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _train_step(model, handler, tokens)
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        peak = {getattr(k, "value", str(k)): v for k, v in snapshot.items()}
        kept = ("Parameter", "Gradient", "Optstate", "Buffer")
        row = {"cp_size": groups.cp_size, "rank": dist.get_rank(), "seq_len": seq_len, "peak_bytes": peak["Total"],
               "activation_bytes": peak["Total"] - sum(peak[k] for k in kept),
               "by_category": peak}
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return rows


def overhead(seq_len: int, reps: int) -> dict:
    """cp=1 handler vs plain SDPA: median forward+backward ms of the reference GPT, one process."""
    model, tokens = _model(), _tokens(seq_len)
    ours = build_cp_handler(ContextParallelConfig())
    variants = {"handler_cp1": ours, "plain_sdpa": PlainAttention()}
    times = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, handler in variants.items():
            start = time.perf_counter()
            logits = model(tokens, cp_handler=handler)
            F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
            model.zero_grad(set_to_none=True)
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    handler_ms, plain_ms = (1e3 * statistics.median(times[n]) for n in variants)
    paired = statistics.median(a / b for a, b in zip(times["handler_cp1"], times["plain_sdpa"], strict=True))
    return {"seq_len": seq_len, "reps": reps, "handler_cp1_ms": handler_ms, "plain_sdpa_ms": plain_ms,
            "overhead": paired - 1.0}


def train(args, cp_size: int) -> dict:
    """A training run at ``cp_size`` (the equivalent ``cp-train`` command is recorded); its throughput
    and memory."""
    model = GPTConfig(vocab_size=BYTE_VOCAB_SIZE, **MODEL)
    cp = ContextParallelConfig(context_parallel_size=cp_size, num_layers=model.num_layers)
    shape = AttentionShape(model.num_attention_heads, model.num_query_groups, model.kv_channels, model.v_head_dim)
    config = TrainConfig(world_size=cp_size, cp=cp, eval_cp=cp, model=model, attn_shape=shape, seq_len=args.e2e_seq_len,
                         batch_size=1, steps=args.e2e_steps)
    command = (f"cp-train --nproc {cp_size} --cp-size {cp_size} --seq-len {args.e2e_seq_len} --batch-size 1 --steps "
               f"{args.e2e_steps} --hidden-size {MODEL['hidden_size']} --num-heads {MODEL['num_attention_heads']} "
               f"--num-kv-heads {MODEL['num_query_groups']} --ffn-hidden-size {MODEL['ffn_hidden_size']}")
    metrics = run_training(config)
    return {"cp_size": cp_size, "seq_len": args.e2e_seq_len, "steps": args.e2e_steps, "command": command,
            "tokens_per_s": metrics["tokens_per_s_mean"], "memory_kind": metrics["memory_kind"],
            "peak_memory_bytes_per_rank": metrics["peak_memory_bytes_per_rank"]}


def run(args) -> dict:
    """All three e2e measurements at ``args.cp_sizes``, a progress line per launch or run."""
    steps = [*(("memory", cp) for cp in args.cp_sizes), *(("train", cp) for cp in args.cp_sizes), ("overhead", 1)]
    memory, trained, cost = [], [], None
    for kind, cp in each_case(steps, "e2e", lambda step: f"{step[0]} cp={step[1]}"):
        if kind == "memory":
            memory += launch(memory_worker, cp, args.e2e_seq_len, program="cp-bench")[0]
        elif kind == "train":
            trained.append(train(args, cp))
        else:
            cost = overhead(args.e2e_seq_len, args.reps)
    return {"model": MODEL, "train": trained, "memory": memory, "overhead": cost}
