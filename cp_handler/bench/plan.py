"""Per-rank compute of every CP pattern, timed on one device without communication (``cp-bench --modes plan``).

What one rank of a CP group computes, run alone: rank 0's plan of blocks for every step of the
pattern (:func:`~cp_handler.ops.ring.ring_blocks`, :func:`~cp_handler.ops.all_gather.all_gather_blocks`,
the a2a's whole-sequence block on ``H / cp`` heads, a2a+p2p's ring on ``H / A`` heads, rounded up where
the a2a pads uneven heads) through :func:`~cp_handler.ops.blocks.blocks_forward_` / ``blocks_backward_``
on tensors of the rank's shapes (remote K/V stand in with the local ones: same shapes, same work). The
reference is the whole sequence on one device, by each of ``--whole-kernels`` (:mod:`.whole`: SDPA,
FlexAttention with a document-causal mask, FlashAttention-4). Per-rank compute efficiency =
``T(reference) / (cp * T(rank))`` against each: 1.0 means splitting costs nothing but communication
(communication is measured by ``--modes attn`` on several ranks).

Forward + backward, causal, batch 1; thd packs ``seq_len`` tokens as documents with exponentially
distributed lengths of mean ``--thd-mean-doc`` (seeded). On CUDA, times are CUDA-event medians;
on CPU (the emulation mode, for small sizes), wall-clock medians.
"""

from __future__ import annotations

import bisect
import itertools
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..core.layout import ZigzagDocs
from ..core.masks import CAUSAL
from ..ops.blocks import LseRows, blocks_backward_, blocks_forward_, new_accumulators
from ..ops.kernels import AttnKernel, select_kernel
from ..ops.kernels.work import block_tiles
from ..ops.kv import kv_seq_dim, pack_kv
from ..ops.patterns import PATTERNS
from ..ops.spec import AttnSpec
from ..ops.ulysses import a2a_head_plan
from .case_progress import each_case
from .whole import resolve, whole_step


@dataclass(frozen=True)
class PlanCase:
    pattern: str  # "whole" (a reference) or a cp_comm_type
    qkv_format: str
    cp_size: int
    seq_len: int
    reference: str = ""  # "whole" rows: the whole-sequence kernel (:mod:`.whole`)

    def describe(self) -> str:
        """The case in a progress line: ``p2p thd S=16384 cp=4`` (``whole sdpa bshd S=4096``)."""
        where = f"S={self.seq_len}" + (f" cp={self.cp_size}" if self.pattern != "whole" else "")
        return " ".join(filter(None, (self.pattern, self.reference, self.qkv_format, where)))


@dataclass(frozen=True)
class PlanShape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    device: str = "cuda"
    kernel: str | None = None
    thd_mean_doc: int = 1024


def doc_lengths(seq_len: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths summing to ``seq_len``: exponential with mean ``mean`` (at least 1), the last one cut."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < seq_len:
        lengths.append(max(1, min(round(rng.expovariate(1 / mean)), seq_len - sum(lengths))))
    return lengths


@dataclass
class RankPlan:
    """One rank's work: query/KV lengths and heads, the block plans of its steps (first step fresh),
    whether they come from packed documents (a new block shape per document pair), and the K/V blocks it
    gathers into another row order per pass (:attr:`~cp_handler.ops.patterns.RankSteps.kv_gathers`)."""

    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    steps: list
    varying_shapes: bool = False
    kv_gathers: int = 0


def hierarchical_sizes(cp_size: int) -> list[int]:
    """The levels cp-bench runs a hierarchical pattern on: a2a over pairs of adjacent ranks, the ring
    across them (``[cp, 1]`` for an odd cp)."""
    return [2, cp_size // 2] if cp_size % 2 == 0 else [cp_size, 1]


def rank_plan(case: PlanCase, shape: PlanShape, packed: bool = False, rank: int = 0) -> RankPlan:
    """``rank``'s work in ``case`` (the pattern's :attr:`~cp_handler.ops.patterns.CommPattern.rank_steps`), as a
    packed kernel (``packed``) or a block kernel runs it; an all-to-all's heads per rank are those of its head plan
    (:func:`~cp_handler.ops.ulysses.a2a_head_plan`: ``ceil``-like, padded heads included)."""
    lengths = [case.seq_len] if case.qkv_format == "bshd" else doc_lengths(case.seq_len, shape.thd_mean_doc)
    layout = ZigzagDocs.from_lengths(lengths, case.cp_size)
    pattern = PATTERNS[case.pattern]
    plan = pattern.rank_steps(layout, rank, pattern.a2a_size(case.cp_size, hierarchical_sizes(case.cp_size)) or 1,
                              packed)
    if plan.head_divisor > 1:  # the a2a's heads per rank, padded when the a2a size does not split them
        split = a2a_head_plan(shape.num_heads, shape.num_kv_heads, plan.head_divisor)
        heads = (split.heads_per_rank, split.kv_heads_per_rank)
    else:
        heads = (shape.num_heads, shape.num_kv_heads)
    return RankPlan(plan.q_len, plan.kv_len, *heads, plan.steps, varying_shapes=case.qkv_format == "thd",
                    kv_gathers=plan.kv_gathers)


TILE = 128
"""Tile edge of the work model: FlexAttention's default block size (FlashAttention-2's tiles for head
dim 128 are 128 x 64 in the forward, 64 x 128 in the backward)."""


def plan_tiles(plan: RankPlan, tile: int = TILE) -> int:
    """Score tiles (summed over query heads) that ``plan``'s blocks visit, partly masked ones included:
    :func:`~cp_handler.ops.kernels.work.block_tiles` over every block of every step (a block with a
    window or chunk mask counts all its tiles: an upper bound; the plans timed here have none)."""
    return plan.heads * sum(block_tiles(q.stop - q.start, k.stop - k.start, mask is True, tile)
                            for step in plan.steps for q, k, mask in step)


def whole_tiles(case: PlanCase, shape: PlanShape, tile: int = TILE) -> int:
    """Score tiles (summed over query heads) of the whole-sequence reference: the causal triangle (bshd),
    or the tiles of the pack's document-causal mask holding a computed pair (thd: FlexAttention's
    BlockMask; documents are not aligned to tiles, so a tile may straddle two)."""
    if case.qkv_format == "bshd":
        return shape.num_heads * block_tiles(case.seq_len, case.seq_len, True, tile)
    starts = [0, *itertools.accumulate(doc_lengths(case.seq_len, shape.thd_mean_doc))][:-1]
    # row tile i sees the column tiles from the one holding its first row's document start up to i
    doc_start = (starts[bisect.bisect_right(starts, i * tile) - 1] for i in range(-(-case.seq_len // tile)))
    return shape.num_heads * sum(i - start // tile + 1 for i, start in enumerate(doc_start))


def _timer(device: str):
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return lambda: (end.record(), torch.cuda.synchronize(), start.elapsed_time(end))[2]
    begin = time.perf_counter()
    return lambda: (time.perf_counter() - begin) * 1e3


def _inputs(q_len, kv_len, heads, kv_heads, shape: PlanShape):
    dtype, device = getattr(torch, shape.dtype), shape.device
    q = torch.randn(1, heads, q_len, shape.head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(1, kv_heads, kv_len, shape.head_dim, dtype=dtype, device=device) for _ in range(2))
    return q, k, v


def check_kernel(attn_kernel: str, shape: PlanShape, formats=("bshd",)) -> None:
    """Raises ``ValueError`` (from :func:`~cp_handler.ops.kernels.select_kernel`) when the forced
    kernel cannot run blocks of ``shape`` on ``shape.device`` in one of ``formats``."""
    select_kernel(torch.empty(1, shape.num_heads, 1, shape.head_dim, device=shape.device,
                              dtype=getattr(torch, shape.dtype)), attn_kernel, varying_shapes="thd" in formats)


def rank_step(plan: RankPlan, shape: PlanShape, kernel: AttnKernel | None = None):
    """A function running ``plan`` forward + backward once on fresh inputs of ``shape`` (no
    communication), with ``kernel`` or else ``shape.kernel`` (a name; ``None``: automatic)."""
    q, k, v = _inputs(plan.q_len, plan.kv_len, plan.heads, plan.kv_heads, shape)
    scale = shape.head_dim ** -0.5
    # a kernel that cannot run fails here; the spec as a handler's call gives it (the layout is not read)
    spec = AttnSpec(CAUSAL, scale, None, select_kernel(q, kernel or shape.kernel, varying_shapes=plan.varying_shapes))

    kv, rows = pack_kv(k, v), torch.arange(plan.kv_len, device=q.device)

    def gathers():  # the K/V blocks this rank sends in another row order (the ring's wrap)
        for _ in range(plan.kv_gathers):
            kv.index_select(kv_seq_dim(kv), rows)

    def run():
        out, lse = new_accumulators(q)
        gathers()
        for i, blocks in enumerate(plan.steps):
            blocks_forward_(out, lse, q, k, v, blocks, spec, fresh=i == 0)
        out = out.to(q.dtype)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        lse_rows = LseRows(lse)  # shared by the steps, as the ring's backward shares it
        gathers()
        for blocks in plan.steps:
            blocks_backward_(dq, dk, dv, out, q, k, v, out, lse_rows, blocks, spec)
    return run


def _whole_step(case: PlanCase, shape: PlanShape):
    q, k, v = _inputs(case.seq_len, case.seq_len, shape.num_heads, shape.num_kv_heads, shape)
    lengths = None if case.qkv_format == "bshd" else doc_lengths(case.seq_len, shape.thd_mean_doc)
    return whole_step(case.reference, q, k, v, lengths)


def _case_step(case: PlanCase, shape: PlanShape):
    """``(step, kernel)``: :func:`rank_step` of rank 0's plan in ``case`` with the kernel ``shape`` selects."""
    kernel = select_kernel(torch.empty(1, shape.num_heads, 1, shape.head_dim, device=shape.device,
                                       dtype=getattr(torch, shape.dtype)), shape.kernel,
                           varying_shapes=case.qkv_format == "thd")
    return rank_step(rank_plan(case, shape, kernel.packed), shape, kernel), kernel


def time_case(case: PlanCase, shape: PlanShape, warmup: int, reps: int) -> dict:
    """Median forward+backward milliseconds of ``case`` (rank 0's plan, or the whole-sequence reference)."""
    step = _whole_step(case, shape) if case.pattern == "whole" else _case_step(case, shape)[0]
    times = []
    for i in range(warmup + reps):
        stop = _timer(shape.device)
        step()
        elapsed = stop()
        if i >= warmup:
            times.append(elapsed)
    return {**asdict(case), "median_ms": statistics.median(times), "times_ms": times}


def cases(seq_lens, cp_sizes, comm_types, formats, whole_kernels=("auto",), device: str = "cuda") -> list[PlanCase]:
    """The reference and every pattern's rank plan for each (format, seq_len, cp > 1).

    Raises:
        ValueError: a ``seq_len`` not divisible by ``2 * cp`` (the zigzag chunks).
    """
    out = []
    for fmt in formats:
        for seq_len in seq_lens:
            out += [PlanCase("whole", fmt, 1, seq_len, reference) for reference in
                    dict.fromkeys(resolve(name, fmt, device) for name in whole_kernels)]
            for cp in cp_sizes:
                if seq_len % (2 * cp):
                    raise ValueError(f"seq_len {seq_len} is not divisible by 2 * cp = {2 * cp} (zigzag chunks)")
                if cp == 1:
                    continue
                out += [PlanCase(comm, fmt, cp, seq_len) for comm in comm_types
                        if not PATTERNS[comm].hierarchical or cp >= 4]  # two levels of at least 2 ranks
    return out


def add_efficiency(rows: list[dict]) -> list[dict]:
    """``efficiency = T(whole) / (cp * T(rank))`` on every rank row against each whole-sequence reference
    (``efficiency_vs``; ``efficiency``: against the first one listed)."""
    whole: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["pattern"] == "whole":
            whole.setdefault((r["qkv_format"], r["seq_len"]), {})[r["reference"]] = r["median_ms"]
    for r in rows:
        if r["pattern"] != "whole":
            refs = whole[(r["qkv_format"], r["seq_len"])]
            r["efficiency_vs"] = {name: ms / (r["cp_size"] * r["median_ms"]) for name, ms in refs.items()}
            r["efficiency"] = next(iter(r["efficiency_vs"].values()))
    return rows


def run(args) -> dict:
    """``--modes plan``: every case on ``args.device`` (heads of a Llama-3-8B layer by default)."""
    shape = PlanShape(num_heads=args.plan_heads, num_kv_heads=args.plan_kv_heads, head_dim=args.plan_head_dim,
                      dtype=args.plan_dtype, device=args.device, kernel=args.attn_kernel,
                      thd_mean_doc=args.thd_mean_doc)
    if shape.device == "cpu":
        torch.set_num_threads(args.cores)
    todo = cases(args.plan_seq_lens, args.plan_cp_sizes, args.comm_types, args.formats, args.whole_kernels,
                 shape.device)
    rows = [time_case(c, shape, args.warmup, args.reps) for c in each_case(todo, "plan", PlanCase.describe)]
    probe = torch.empty(1, 1, 1, shape.head_dim, device=shape.device, dtype=getattr(torch, shape.dtype))
    kernel = select_kernel(probe, shape.kernel).name
    device_name = torch.cuda.get_device_name() if shape.device == "cuda" else "cpu"
    return {"shape": asdict(shape), "kernel": kernel, "device_name": device_name, "rows": add_efficiency(rows)}


def profile_case(case: PlanCase, shape: PlanShape, trace_path: str, warmup: int = 2, rows: int = 25) -> str:
    """One forward + backward of rank 0's plan in ``case`` under :mod:`torch.profiler` (after ``warmup`` runs):
    writes a Chrome trace to ``trace_path`` (gzip when it ends in ``.gz``) and returns the ``rows`` operators with the
    most device time (CUDA) or CPU time, as :meth:`~torch.autograd.profiler_util.EventList.table` prints them."""
    step, kernel = _case_step(case, shape)
    for _ in range(warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if shape.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if shape.device == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    sort = "self_device_time_total" if shape.device == "cuda" else "self_cpu_time_total"
    return f"kernel {kernel.name}\n" + prof.key_averages().table(sort_by=sort, row_limit=rows)
