"""Attention variants per rank (``cp-bench --modes masks``): full causal, a sliding window, chunked attention,
soft-capped scores (Gemma 2's 50) and a soft-capped window (Gemma 2's local layers) at one shape, every rank's
plan timed forward + backward on ``--device`` (no communication, as ``--modes plan``), with the K/V each rank
sends per layer from the same plans.

Explicit-score blocks per rank and layer forward (all its steps; the masked blocks no kernel takes,
:mod:`cp_handler.ops.kernels.masked`): counted on the device that runs (``count_attn_work``) and, for CUDA plans,
from the routing rule itself without a GPU: a block is explicit on CUDA unless some CUDA kernel's verified masks
hold what it needs (``cuda automatic``), or an opt-in kernel's declared masks do (``cuda flash_gqa opt-in``:
``CP_HANDLER_MASKED_KERNEL=flash_gqa``, FlashAttention-2's windows; ``cuda fa4 opt-in``: FlashAttention-4's windows
and soft-cap). Where a kernel takes some of a plan's masked blocks, the same plan is also timed with every masked
block on the explicit scores (``explicit_scores_ms``: before and after the kernels took them, interleaved).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import asdict

import torch

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask, BlockMask, block_needs
from ..ops.halo import halo_applies, halo_plan
from ..ops.kernels import EXPLICIT, KERNELS, MASKED_KERNEL_ENV, count_attn_work, select_kernel
from ..ops.ring import ring_blocks
from .case_progress import each_case
from .plan import PlanShape, RankPlan, _timer, rank_step


def rank_work(layout: ZigzagDocs, mask: AttentionMask, rank: int, heads: int, kv_heads: int) -> tuple[RankPlan, int]:
    """``(plan, K/V rows sent)`` of ``rank`` under ``p2p`` with ``mask``."""
    if halo_applies(layout, mask):
        plan = halo_plan(layout, mask, rank)
        return (RankPlan(layout.local_len, layout.local_len + sum(plan.recv_splits), heads, kv_heads,
                         [list(plan.blocks)]), sum(plan.send_splits))
    steps = [ring_blocks(layout, step, rank, mask) for step in range(layout.size)]
    return RankPlan(layout.local_len, layout.local_len, heads, kv_heads, steps), (layout.size - 1) * layout.local_len


def explicit_blocks(plan: RankPlan, takes) -> int:
    """Masked blocks of ``plan`` (all its steps: one rank's forward) whose needs ``takes(needs)`` rejects."""
    return sum(isinstance(m, BlockMask) and not takes(block_needs(m, q.stop - q.start, k.stop - k.start))
               for step in plan.steps for q, k, m in step)


CUDA_RULES = {
    "cuda automatic": lambda needs: any(needs <= k.verified_masks for k in KERNELS.values() if k.device_type == "cuda"),
    "cuda flash_gqa opt-in": lambda needs: needs <= KERNELS["flash_gqa"].masks,
    "cuda fa4 opt-in": lambda needs: needs <= KERNELS["fa4"].masks,
}
"""How the CUDA routing treats a block's needs (:func:`~cp_handler.ops.kernels.masked_kernel`), without a GPU."""


@contextlib.contextmanager
def _masked_on(explicit: bool):
    """Every masked block on the explicit scores (``CP_HANDLER_MASKED_KERNEL=explicit``) inside, if ``explicit``."""
    before = os.environ.get(MASKED_KERNEL_ENV)
    if explicit:
        os.environ[MASKED_KERNEL_ENV] = EXPLICIT
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MASKED_KERNEL_ENV, None)
        else:
            os.environ[MASKED_KERNEL_ENV] = before


def _median_ms(step, warmup: int, reps: int, device: str, compare: bool = False) -> tuple[float, float | None]:
    """Median ms of ``step``, and with ``compare`` the median of the same step with every masked block on the
    explicit scores (the path before the kernels took masked blocks), the two interleaved rep by rep so that the
    machine's drift hits both alike."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(warmup + reps):
        for explicit in (False, True) if compare else (False,):
            with _masked_on(explicit):
                stop = _timer(device)
                step()
                elapsed = stop()
            if i >= warmup:
                times[explicit].append(elapsed)
    return statistics.median(times[False]), statistics.median(times[True]) if compare else None


def run(args) -> dict:
    """Time every rank's plan for full causal, ``--mask-window`` and ``--mask-chunk`` (``--mask-seq-len``,
    ``--mask-cp-size``; heads, head dim and dtype from the plan flags)."""
    shape = PlanShape(num_heads=args.plan_heads, num_kv_heads=args.plan_kv_heads, head_dim=args.plan_head_dim,
                      dtype=args.plan_dtype, device=args.device, kernel=args.attn_kernel)
    if shape.device == "cpu":
        torch.set_num_threads(args.cores)
    layout = ZigzagDocs.uniform(args.mask_seq_len, args.mask_cp_size)
    row_bytes = 2 * shape.num_kv_heads * shape.head_dim * torch.tensor([], dtype=getattr(torch, shape.dtype)).itemsize
    rows = []
    masks = {"full causal": AttentionMask(), f"window {args.mask_window}": AttentionMask(window=args.mask_window),
             f"chunk {args.mask_chunk}": AttentionMask(chunk=args.mask_chunk),
             "softcap 50": AttentionMask(softcap=50.0),
             f"window {args.mask_window} + softcap 50": AttentionMask(window=args.mask_window, softcap=50.0)}
    ranks: dict[str, list[dict]] = {name: [] for name in masks}
    for name, rank in each_case([(name, rank) for name in masks for rank in range(layout.size)], "masks",
                                lambda case: f"{case[0]} rank {case[1]}"):
        plan, sent = rank_work(layout, masks[name], rank, shape.num_heads, shape.num_kv_heads)
        step = rank_step(plan, shape)
        with count_attn_work() as work:
            step()
        masked = sum(isinstance(m, BlockMask) for step_blocks in plan.steps for _, _, m in step_blocks)
        median_ms, explicit_ms = _median_ms(step, args.warmup, args.reps, shape.device,
                                            compare=work.explicit_blocks < masked)
        ranks[name].append({"rank": rank, "median_ms": median_ms, "explicit_scores_ms": explicit_ms,
                            "kv_tokens_sent": sent, "pairs": work.pairs, "blocks": work.blocks,
                            "explicit_blocks": work.explicit_blocks,
                            **{rule: explicit_blocks(plan, takes) for rule, takes in CUDA_RULES.items()}})
    for name, mask in masks.items():
        per_rank = ranks[name]
        slowest = max(per_rank, key=lambda r: r["median_ms"])
        rows.append({"case": name, "window": mask.window, "chunk": mask.chunk,
                     "halo": halo_applies(layout, mask), "median_ms": slowest["median_ms"],
                     "explicit_scores_ms": slowest["explicit_scores_ms"],
                     "kv_tokens_sent": max(r["kv_tokens_sent"] for r in per_rank),
                     "kv_bytes_sent": max(r["kv_tokens_sent"] for r in per_rank) * row_bytes,
                     "pairs": max(r["pairs"] for r in per_rank), "ranks": per_rank,
                     "explicit_blocks": {where: max(r[key] for r in per_rank) for where, key in
                                         ((shape.device, "explicit_blocks"), *((rule, rule) for rule in CUDA_RULES))}})
    full = rows[0]
    for row in rows:
        row["time_vs_full"] = row["median_ms"] / full["median_ms"]
        row["pairs_vs_full"] = row["pairs"] / full["pairs"]
    probe = torch.empty(1, 1, 1, shape.head_dim, device=shape.device, dtype=getattr(torch, shape.dtype))
    return {"shape": asdict(shape), "seq_len": args.mask_seq_len, "cp_size": args.mask_cp_size,
            "kernel": select_kernel(probe, shape.kernel).name, "rows": rows}
