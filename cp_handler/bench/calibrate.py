"""Measure a cost profile on the machine it runs on (``cp-bench --calibrate``): compute fits and link fits.

For each group size the ranks of one launch (gloo on CPU, NCCL on GPUs, the threads per rank that cp-train and
cp-bench give them) do, all at once:

* **compute**: each rank times its own plan (:func:`~.pattern_work.rank_plan`: the blocks it runs under ``p2p``,
  ``all_gather``, ``a2a``, a window, packed documents) forward + backward through the block functions every
  pattern uses (:func:`~cp_handler.ops.blocks.blocks_forward_` / ``blocks_backward_``, the automatic kernel), no
  communication; the median of ``reps`` after a warm-up. The rows (the plan's features, milliseconds) of every
  rank are fitted by least squares on relative error (:class:`~.profile.ComputeFit`);
* **links**: each collective kind (a ring step's send + receive, all-gather, reduce-scatter, all-to-all) at three
  payloads, fitted to ``latency + bytes / bandwidth`` (:class:`~.profile.LinkFit`);
* **each pattern as a whole**: the pattern itself through the local handler (:func:`handler_step`) on
  :data:`PATTERN_CASES`; its times against the compute and link fits' prediction give the pattern's
  ``scale``, ``fixed`` cost and cost per element of q, k, v (:class:`~.profile.PatternFit`: what the shared fits
  miss for it, its copies, reorders and the handler's Python).

Sizes stay small (:data:`CALIBRATION_TOKENS`, :data:`PATTERN_CASES`): a group size takes about a minute on two CPU
cores.
"""

from __future__ import annotations

import datetime
import platform
import random
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from ..auto.choice import candidates, predict
from ..auto.pattern_work import AttnCase, pattern_work, plan_work, rank_plan
from ..auto.profile import ComputeFit, CostProfile, GroupProfile, LinkFit, PatternFit
from ..core.masks import CAUSAL, AttentionMask
from ..core.progress import Progress
from ..dynamic.cost_model import relative_lstsq
from ..handlers import build_cp_handler
from ..ops.blocks import LseRows, blocks_backward_, blocks_forward_, new_accumulators
from ..ops.collectives import all_gather_single, all_to_all_single, reduce_scatter_single
from ..ops.kernels import select_kernel
from ..ops.spec import AttnSpec
from ..runtime.config import ContextParallelConfig
from ..runtime.groups import build_dp_cp_groups
from ..runtime.launch import launch, rank_session

CALIBRATION_TOKENS = (1024, 4096)
"""Sequence lengths of the calibration plans (each divisible by ``2 * cp`` for cp up to 8): the block sizes of
layers of 1k to 16k tokens over 2 to 8 ranks."""
CALIBRATION_SHAPES = ((4, 4, 64), (8, 2, 128), (4, 1, 64))
"""``(heads, kv_heads, head_dim)`` of the calibration plans: MHA at 64, GQA at 128, and one key-value head at 64 (the
key-value heads' share of the work, :class:`~cp_handler.auto.pattern_work.PlanWork`, is told apart from the
head dim's)."""
LINK_BYTES = (1 << 14, 1 << 18, 1 << 22)
"""Payloads per rank of the link measurements: 16 KiB, 256 KiB, 4 MiB."""
PATTERN_CASES = ((1024, (4, 4, 64), None, 1), (4096, (4, 4, 64), None, 1), (1024, (8, 2, 128), None, 1),
                 (4096, (8, 2, 128), None, 1), (1024, (16, 16, 32), None, 1), (4096, (4, 4, 64), 512, 1),
                 (4096, (4, 4, 64), None, 8), (4096, (4, 1, 64), None, 1), (4096, (4, 1, 64), None, 8),
                 (4096, (16, 2, 32), None, 8))
"""``(tokens, (heads, kv_heads, head_dim), window, documents)`` of the patterns' own runs."""


def levels_of(cp: int) -> tuple[int, int] | None:
    """The two levels calibration and ``cp-bench --modes auto`` give ``a2a+p2p``: pairs of adjacent ranks, a ring
    across them (none below 4 ranks)."""
    return (2, cp // 2) if cp >= 4 else None


class _Layer(torch.nn.Module):
    """An attention module as a model's: a layer number (the ranks agree once per layer), the case's window and,
    ``sinks``, a learnable sink logit per query head (gpt-oss)."""

    def __init__(self, mask: AttentionMask, sinks: torch.Tensor | None = None):
        super().__init__()
        self.layer_number = 1
        if mask.window is not None:
            self.window_size = (mask.window - 1, 0)
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def handler_step(comm_type: str, case: AttnCase, groups, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 sinks: bool = False):
    """A function running ``case`` forward + backward once through the local handler with ``comm_type`` on this
    rank (``groups``: :func:`~cp_handler.runtime.groups.build_dp_cp_groups` of the CP group, with the levels of
    :func:`levels_of` for ``a2a+p2p``); thd when the case has several documents. Causal or a causal window; with
    ``sinks``, a sink logit per query head (their gradient computed too)."""
    thd = len(case.lengths) > 1
    hierarchical = comm_type == "a2a+p2p"
    config = ContextParallelConfig(context_parallel_size=case.cp, cp_comm_type=comm_type,
                                   qkv_format="thd" if thd else "bshd",
                                   hierarchical_context_parallel_sizes=list(case.hierarchical) if hierarchical
                                   else None)
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    handler = build_cp_handler(config, groups.cp_group, groups.hierarchical_cp_groups if hierarchical else None,
                               **({"cu_seqlens": cu} if thd else {}))
    g = torch.Generator().manual_seed(seed)
    tokens = sum(case.lengths)
    lead, dim = ((tokens,), 0) if thd else ((case.batch, tokens), 1)
    widths = ((case.heads, case.head_dim), (case.kv_heads, case.head_dim), (case.kv_heads, case.v_head_dim),
              (case.heads, case.v_head_dim))
    q, k, v, dout = (handler.dispatch(torch.randn(*lead, h, d, generator=g, dtype=dtype).to(device), dim).contiguous()
                     for h, d in widths)
    for t in (q, k, v):
        t.requires_grad_(True)
    layer = _Layer(case.mask, torch.randn(case.heads, generator=g, dtype=dtype).to(device) if sinks else None)

    def run():
        handler.core_attn(layer, q, k, v).backward(dout)
        for t in (q, k, v):
            t.grad = None
    return run


def documents(tokens: int, docs: int) -> tuple[int, ...]:
    """``docs`` document lengths summing to ``tokens`` (seeded cuts)."""
    cuts = sorted(random.Random(tokens).sample(range(1, tokens), docs - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True))


def calibration_cases(cp: int) -> list[tuple[str, AttnCase]]:
    """``(comm_type, case)`` of the compute calibration at group size ``cp``: causal under p2p, all_gather and
    a2a, a window of an eighth of the sequence, and eight packed documents, for every shape and length."""
    out = []
    for heads, kv_heads, dim in CALIBRATION_SHAPES:
        for tokens in CALIBRATION_TOKENS:
            base = AttnCase((tokens,), 1, heads, kv_heads, dim, dim, 4, CAUSAL, cp)
            docs = documents(tokens, 8)
            out += [("p2p", base), ("all_gather", base), ("a2a", base),
                    ("p2p", AttnCase((tokens,), 1, heads, kv_heads, dim, dim, 4, AttentionMask(window=tokens // 8),
                                     cp)),
                    ("p2p", AttnCase(docs, 1, heads, kv_heads, dim, dim, 4, CAUSAL, cp))]
    return out


def _barrier_timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up, every rank starting each run together."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def plan_step(comm_type: str, case: AttnCase, rank: int, dtype: torch.dtype, device: torch.device):
    """A function running ``rank``'s plan of ``case`` forward + backward once (no communication: remote K/V stand in
    with local tensors of the same shapes)."""
    plan = rank_plan(comm_type, case, rank)
    b = case.batch
    q = torch.randn(b, plan.heads, plan.q_len, case.head_dim, dtype=dtype, device=device)
    k = torch.randn(b, plan.kv_heads, plan.kv_len, case.head_dim, dtype=dtype, device=device)
    v = torch.randn(b, plan.kv_heads, plan.kv_len, case.v_head_dim, dtype=dtype, device=device)
    kernel = select_kernel(q, None, varying_shapes=len(case.lengths) > 1)
    spec = AttnSpec(case.mask, case.head_dim ** -0.5, None, kernel)

    def run():
        out, lse = new_accumulators(q, case.v_head_dim)
        for i, blocks in enumerate(plan.steps):
            blocks_forward_(out, lse, q, k, v, list(blocks), spec, fresh=i == 0)
        out = out.to(q.dtype)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        rows = LseRows(lse)
        for blocks in plan.steps:
            blocks_backward_(dq, dk, dv, out, q, k, v, out, rows, list(blocks), spec)
    return run


def _link_step(kind: str, nbytes: int, dtype: torch.dtype, device: torch.device):
    world, rank = dist.get_world_size(), dist.get_rank()
    n = max(world, nbytes // dtype.itemsize // world * world)
    x = torch.randn(n, dtype=dtype, device=device)
    if kind == "p2p":
        def run():
            recv = torch.empty_like(x)
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    elif kind == "all_gather":
        gathered = torch.empty(n * world, dtype=dtype, device=device)

        def run():
            all_gather_single(gathered, x, None)
    elif kind == "reduce_scatter":
        big = torch.randn(n * world, dtype=dtype, device=device)

        def run():
            reduce_scatter_single(torch.empty_like(x), big, None)
    else:
        received = torch.empty_like(x)

        def run():
            all_to_all_single(received, x, None)
    return run


def _fit_link(rows: list[tuple[int, float]]) -> LinkFit:
    latency, per_byte = relative_lstsq([[1.0, float(b)] for b, _ in rows], [ms for _, ms in rows])
    return LinkFit(latency, 1e-6 / per_byte if per_byte > 0 else 1e6)


def calibrate_worker(dtype_name: str, device_type: str, reps: int) -> dict | None:
    with rank_session("cp-bench", device_type=device_type) as device:
        rank, world = dist.get_rank(), dist.get_world_size()
        dtype = getattr(torch, dtype_name)
        rows, plan_cases = [], calibration_cases(world)
        # about 3 minutes per group size on 2 CPU cores: a line every tenth of the measurements (a bar on a terminal)
        progress = Progress(len(plan_cases) + len(PATTERN_CASES) + 4, f"cp-bench: calibrate cp={world}: measured",
                            enabled=rank == 0)
        for comm_type, case in plan_cases:
            progress.update(stage="compute")
            ms = _barrier_timed(plan_step(comm_type, case, rank, dtype, device), reps, device)
            plan = rank_plan(comm_type, case, rank)
            work = [plan_work(s, plan.heads * case.batch, plan.kv_heads * case.batch, case.head_dim + case.v_head_dim)
                    for s in plan.steps]
            rows.append((sum(work[1:], work[0]).features(), ms))
        patterns = []
        groups = build_dp_cp_groups(world, device.type, list(levels_of(world) or []) or None)
        for tokens, (heads, kv_heads, dim), window, docs in PATTERN_CASES:
            progress.update(stage="patterns")
            lengths = (tokens,) if docs == 1 else documents(tokens, docs)
            mask = AttentionMask(window=window) if window else CAUSAL
            case = AttnCase(lengths, 1, heads, kv_heads, dim, dim, dtype.itemsize, mask, world, levels_of(world))
            for comm_type in candidates(case):
                ms = _barrier_timed(handler_step(comm_type, case, groups, dtype, device), reps, device)
                patterns.append((comm_type, case, _max(ms)))
        links = {}
        for kind in ("p2p", "all_gather", "reduce_scatter", "all_to_all"):
            progress.update(stage=f"links {kind}")
            links[kind] = [(nbytes, _barrier_timed(_link_step(kind, nbytes, dtype, device), reps, device))
                           for nbytes in LINK_BYTES]
        progress.close()
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        return {"rows": [r for part in gathered for r in part], "links": links, "patterns": patterns} \
            if rank == 0 else None


def _max(ms: float) -> float:
    """The slowest rank's value (a call ends when its slowest rank does)."""
    t = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fit_compute(rows: list[tuple[tuple[float, ...], float]]) -> ComputeFit:
    """The :class:`~.profile.ComputeFit` of ``(features, ms)`` rows, with its relative errors."""
    weights = relative_lstsq([list(f) for f, _ in rows], [ms for _, ms in rows])
    fit = ComputeFit(tuple(weights))
    errors = [abs(sum(w * x for w, x in zip(weights, f, strict=True)) - ms) / ms for f, ms in rows]
    return ComputeFit(tuple(weights), {"rows": len(rows), "median_rel": statistics.median(errors),
                                       "max_rel": max(errors)}) if errors else fit


def fit_patterns(rows, group: GroupProfile, cp: int, dtype: str, device: str) -> dict[str, PatternFit]:
    """Each pattern's :class:`~.profile.PatternFit`: its measured calls against the compute and link fits'
    prediction, ``ms = scale * modelled + fixed + per element + per packed element`` by least squares on relative
    error, each coefficient >= 0 (one that comes out negative is held at 0 and the others fitted again)."""
    bare = CostProfile("bare", "", device, 0.0, {cp: group})
    out = {}
    for comm_type in dict.fromkeys(name for name, _, _ in rows):
        design, times = [], []
        for name, case, ms in rows:
            if name == comm_type:
                work = pattern_work(name, case)
                design.append([predict(name, case, bare, dtype).total_ms, 1.0, work.elements / 1e6,
                               work.packed_elements / 1e6])
                times.append(ms)
        out[comm_type] = PatternFit(*_nonnegative_lstsq(design, times))
    return out


def _nonnegative_lstsq(design: list[list[float]], times: list[float]) -> list[float]:
    """:func:`~cp_handler.dynamic.cost_model.relative_lstsq` with every coefficient >= 0: a column whose
    coefficient comes out negative is dropped (held at 0) and the rest fitted again."""
    kept = list(range(len(design[0])))
    while True:
        solution = relative_lstsq([[row[j] for j in kept] for row in design], times, clamp=False)
        negative = [j for j, c in zip(kept, solution, strict=True) if c < 0]
        if not negative:
            coefficients = [0.0] * len(design[0])
            for j, c in zip(kept, solution, strict=True):
                coefficients[j] = c
            return coefficients
        kept.remove(min(negative, key=lambda j: solution[kept.index(j)]))


def calibrate(cp_sizes=(2, 4), dtype: str = "float32", device: str = "cpu", reps: int = 5,
              name: str | None = None, progress=None) -> CostProfile:
    """Measure a :class:`~.profile.CostProfile` here: one launch of ``cp`` ranks per size (module doc).

    Raises:
        SystemExit: a rank failed (:func:`~cp_handler.runtime.launch.launch`).
    """
    groups = {}
    for cp in cp_sizes:
        if progress:
            progress(f"calibrate cp={cp}")
        result = launch(calibrate_worker, cp, dtype, device, reps, program="cp-bench")[0]
        links = {k: _fit_link(v) for k, v in result["links"].items()}
        group = GroupProfile({dtype: fit_compute(result["rows"])}, links)
        groups[cp] = replace(group, patterns=fit_patterns(result["patterns"], group, cp, dtype, device))
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    when = datetime.date.today().isoformat()
    source = (f"measured by cp-bench --calibrate on {device} ({machine}, torch {torch.__version__}), {when}; "
              f"compute and links with every rank of the group busy")
    return CostProfile(name or f"{device}-calibrated-{when}", source, device, 0.0 if device == "cpu" else 1.0,
                       groups)
