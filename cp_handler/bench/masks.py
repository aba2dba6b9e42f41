"""Attention variants per rank (``cp-bench --modes masks``): full causal, a sliding window and chunked
attention at one shape, every rank's plan timed forward + backward on ``--device`` (no communication,
as ``--modes plan``), with the K/V each rank sends per layer from the same plans.

``p2p`` plans: the zigzag ring for full causal; for a window / chunks the halo exchange when it applies
(:func:`~cp_handler.ops.halo.halo_applies`: the rows each rank's queries see), else the ring with the
masked blocks. Tokens sent per rank are the rows of K/V leaving the rank in the forward (the backward
returns as many dK/dV rows); ``count_comms`` counts the same in tests/test_masks.py. Per rank the
slowest rank's median is reported (a step waits for it), with the score pairs computed.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from ..layout import ZigzagDocs
from ..masks import AttentionMask
from ..ops.halo import halo_applies, halo_plan
from ..ops.kernels import count_attn_work, select_kernel
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


def _median_ms(step, warmup: int, reps: int, device: str) -> float:
    times = []
    for i in range(warmup + reps):
        stop = _timer(device)
        step()
        if i >= warmup:
            times.append(stop())
    return statistics.median(times)


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
             f"chunk {args.mask_chunk}": AttentionMask(chunk=args.mask_chunk)}
    ranks: dict[str, list[dict]] = {name: [] for name in masks}
    for name, rank in each_case([(name, rank) for name in masks for rank in range(layout.size)], "masks",
                                lambda case: f"{case[0]} rank {case[1]}"):
        plan, sent = rank_work(layout, masks[name], rank, shape.num_heads, shape.num_kv_heads)
        step = rank_step(plan, shape)
        with count_attn_work() as work:
            step()
        ranks[name].append({"rank": rank, "median_ms": _median_ms(step, args.warmup, args.reps, shape.device),
                            "kv_tokens_sent": sent, "pairs": work.pairs, "blocks": work.blocks})
    for name, mask in masks.items():
        per_rank = ranks[name]
        slowest = max(per_rank, key=lambda r: r["median_ms"])
        rows.append({"case": name, "window": mask.window, "chunk": mask.chunk,
                     "halo": halo_applies(layout, mask), "median_ms": slowest["median_ms"],
                     "kv_tokens_sent": max(r["kv_tokens_sent"] for r in per_rank),
                     "kv_bytes_sent": max(r["kv_tokens_sent"] for r in per_rank) * row_bytes,
                     "pairs": max(r["pairs"] for r in per_rank), "ranks": per_rank})
    full = rows[0]
    for row in rows:
        row["time_vs_full"] = row["median_ms"] / full["median_ms"]
        row["pairs_vs_full"] = row["pairs"] / full["pairs"]
    probe = torch.empty(1, 1, 1, shape.head_dim, device=shape.device, dtype=getattr(torch, shape.dtype))
    return {"shape": asdict(shape), "seq_len": args.mask_seq_len, "cp_size": args.mask_cp_size,
            "kernel": select_kernel(probe, shape.kernel).name, "rows": rows}
