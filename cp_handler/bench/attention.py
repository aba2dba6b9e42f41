"""One attention benchmark case on the ranks of a CP group: time, memory, bytes sent, work balance.

A case is an implementation (``single``: one process, the reference; ``local``: our pure-torch
handler; ``torch_ring``: PyTorch's ring, :mod:`.torch_ring`) x ``cp_comm_type`` x cp size x global
sequence length x qkv_format x pass (``fwd`` or ``fwd_bwd``). The ``single`` case of a cp size runs
inside that cp size's launch, on rank 0 alone with all the launch's threads while the other ranks
wait at the barrier, so that it is timed interleaved with the CP cases it is the reference of.
Every rank builds the same global q, k, v (seeded), takes its shard with the handler's
``dispatch`` (zigzag; thd pads each document), and runs the attention. Measured per case:

* ``median_ms``: median wall time over ``reps`` repetitions after ``warmup``, each between two
  barriers of the CP group (so the slowest rank sets it);
* ``peak_memory_bytes``: max over ranks of the peak bytes live during one repetition
  (``torch.distributed._tools.mem_tracker.MemTracker``, which works on CPU and CUDA), inputs included;
* ``bytes_sent``: max over ranks of :func:`~cp_handler.ops.collectives.count_comms`;
* ``load_balance``: max / mean over ranks of the forward score pairs
  (:func:`~cp_handler.ops.kernels.count_attn_work`); 1.0 is perfect; ``None`` for ``single``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from ..handlers import build_cp_handler
from ..ops.collectives import count_comms
from ..ops.kernels import count_attn_work
from ..ops.patterns import PATTERNS
from ..ops.qkv_format import from_bhsd, to_bhsd
from ..runtime.config import ContextParallelConfig
from ..runtime.groups import build_dp_cp_groups
from ..runtime.launch import launch, rank_session
from ..training.data import stdlib_files
from . import report
from .case_progress import case_progress
from .plan import hierarchical_sizes
from .torch_ring import ROTATE_METHODS, check_available, torch_ring_attn

IMPLS = ("single", "local", "torch_ring")
PASSES = ("fwd", "fwd_bwd")


@dataclass(frozen=True)
class Shape:
    """Attention shape of the benchmark: batch, query heads, KV heads, head dim, dtype name, and the
    device type the ranks run on (``"cuda"``: one GPU per rank, NCCL)."""

    batch: int = 1
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"


@dataclass(frozen=True)
class Case:
    """One benchmark configuration (``comm_type``: ours' cp_comm_type, or PyTorch's rotate method)."""

    impl: str
    comm_type: str
    cp_size: int
    seq_len: int
    qkv_format: str
    pass_name: str
    threads: int


def stdlib_document_lengths(seq_len: int, seed: int = 0, pieces: int = 8) -> list[int]:
    """A packed thd batch of ``seq_len`` tokens with stdlib documents: the ``.py`` files (bytes +
    end-of-document) in an order shuffled by ``seed``, each cut at ``seq_len // pieces`` tokens (so
    a pack holds at least ``pieces`` documents, as long-context packs of many short documents do),
    packed until ``seq_len`` (the last one cut to fit).

    Raises:
        ValueError: ``seq_len`` longer than the corpus.
    """
    cap = max(1, seq_len // pieces)
    sizes = [min(p.stat().st_size + 1, cap) for p in stdlib_files()]
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    lengths, total = [], 0
    for i in order:
        lengths.append(min(sizes[i], seq_len - total))
        total += lengths[-1]
        if total == seq_len:
            return lengths
    raise ValueError(f"seq_len={seq_len} exceeds the stdlib corpus ({total} tokens)")


class CaseRunner:
    """Inputs and the attention call of one case on this rank."""

    def __init__(self, case: Case, shape: Shape, group, sub_groups: list | None = None):
        self.case, self.shape, self.group = case, shape, group
        self.active = case.impl != "single" or dist.get_rank(group) == 0  # single: rank 0 runs, others wait
        cu_seqlens = None
        if case.qkv_format == "thd":
            lengths = stdlib_document_lengths(case.seq_len)
            cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        distributed = case.impl != "single" and case.cp_size > 1
        comm_type = case.comm_type if case.impl == "local" else "p2p"
        hierarchical = PATTERNS[comm_type].hierarchical
        config = ContextParallelConfig(
            context_parallel_size=case.cp_size if distributed else 1, cp_comm_type=comm_type,
            qkv_format=case.qkv_format, hierarchical_context_parallel_sizes=(
                hierarchical_sizes(case.cp_size) if hierarchical and distributed else None))
        self.handler = build_cp_handler(config, group if distributed else None,
                                        sub_groups if hierarchical else None, cu_seqlens=cu_seqlens)
        g = torch.Generator().manual_seed(case.seq_len)
        dtype = getattr(torch, shape.dtype)
        heads = (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads, shape.num_heads)
        lead = (case.seq_len,) if case.qkv_format == "thd" else (shape.batch, case.seq_len)
        tensors = [torch.randn(*lead, h, shape.head_dim, generator=g, dtype=dtype).to(shape.device) for h in heads]
        seq_dim = 0 if case.qkv_format == "thd" else 1
        self.q, self.k, self.v, self.dout = (self.handler.dispatch(t, seq_dim).contiguous() for t in tensors)
        for t in (self.q, self.k, self.v):
            t.requires_grad_(case.pass_name == "fwd_bwd")
        self.scale = shape.head_dim**-0.5

    def attention(self) -> torch.Tensor:
        if self.case.impl != "torch_ring":
            return self.handler.core_attn(None, self.q, self.k, self.v)
        q, k, v = (to_bhsd(t, "bshd") for t in (self.q, self.k, self.v))
        out = torch_ring_attn(q, k, v, group=self.group, causal=True, scale=self.scale,
                              rotate_method=self.case.comm_type)
        return from_bhsd(out, "bshd", self.q)

    def __call__(self) -> None:
        if not self.active:
            return
        if self.case.pass_name == "fwd":
            with torch.no_grad():
                self.attention()
        else:
            self.attention().backward(self.dout)
            for t in (self.q, self.k, self.v):
                t.grad = None


def _device() -> torch.device:
    """Where this rank's collectives put their tensors: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync() -> None:
    """Wait for this rank's queued GPU work (timings end when the kernels do, not when they are queued)."""
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def _max_over(group, value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _all(group, value: float) -> list[float]:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def time_interleaved(runs: list[CaseRunner], group, warmup: int, reps: int) -> list[list[float]]:
    """Seconds per repetition of each run, repetitions interleaved across the runs (run 0, run 1,
    ..., run 0, ...) so that drift of a shared machine hits every implementation alike."""
    for run in runs:
        torch.set_num_threads(run.case.threads)
        for _ in range(warmup):
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, own in zip(runs, times, strict=True):
            torch.set_num_threads(run.case.threads)
            _sync()
            dist.barrier(group=group)
            start = time.perf_counter()
            run()
            _sync()
            dist.barrier(group=group)
            own.append(_max_over(group, time.perf_counter() - start))
    return times


def measure(run: CaseRunner, group, times: list[float]) -> dict:
    """Memory, bytes and work of one case, with its timings (every rank of ``group`` calls it)."""
    torch.set_num_threads(run.case.threads)
    with count_comms() as comms, count_attn_work() as work:
        run()
    tracker = MemTracker()
    with tracker:
        run()
    peak = tracker.get_tracker_snapshot("peak")
    peak_bytes = sum(v["Total"] for v in peak.values())
    inputs = sum(t.nbytes for t in (run.q, run.k, run.v, run.dout)) if run.active else 0
    pairs = _all(group, work.pairs)
    balance = max(pairs) / (sum(pairs) / len(pairs)) if sum(pairs) and run.case.impl != "single" else None
    docs = len(run.handler.token_layout.document_lengths) if run.handler.qkv_format == "thd" else run.shape.batch
    return {
        **asdict(run.case), **asdict(run.shape), "num_docs": docs,
        "median_ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times],
        "peak_memory_bytes": int(_max_over(group, peak_bytes + inputs)),
        "bytes_sent": int(_max_over(group, comms.bytes_sent)),
        "work_pairs_per_rank": pairs, "load_balance": balance,
    }


def run_cases(cases: list[Case], shape: Shape, warmup: int, reps: int, progress,
              started=lambda batch: None) -> list[dict]:
    """Run ``cases`` (all of this launch's cp size) on the default group; rows on every rank.
    Cases that differ only in implementation / comm type are timed interleaved (``started(batch)`` before each such
    batch, ``progress(case)`` after each case)."""
    size = dist.get_world_size()
    levels = hierarchical_sizes(size) if size > 1 else None
    groups = build_dp_cp_groups(size, hierarchical_context_parallel_sizes=levels, device_type=_device().type)
    group, sub_groups = groups.cp_group, groups.hierarchical_cp_groups
    batches: dict[tuple, list[Case]] = {}
    for case in cases:
        batches.setdefault((case.seq_len, case.qkv_format, case.pass_name), []).append(case)
    rows = []
    for batch in batches.values():
        started(batch)
        runs = [CaseRunner(case, shape, group, sub_groups) for case in batch]
        for run, times in zip(runs, time_interleaved(runs, group, warmup, reps), strict=True):
            rows.append(measure(run, group, times))
            progress(run.case)
    return rows


def threads_per_rank(cp_size: int, cores: int) -> int:
    """Threads of each of ``cp_size`` ranks sharing ``cores`` cores (at least one)."""
    return max(1, cores // cp_size)


def build_cases(args) -> dict[int, list[Case]]:
    """Cases grouped by the launch that runs them (key: number of ranks)."""
    by_world: dict[int, list[Case]] = {}
    peer = check_available() is None
    for cp in args.cp_sizes:
        threads = threads_per_rank(cp, args.cores)
        for seq_len in args.seq_lens:
            for fmt in args.formats:
                for pass_name in args.passes:  # the single-process reference runs in the same launch
                    by_world.setdefault(cp, []).append(Case("single", "none", cp, seq_len, fmt, pass_name,
                                                            threads * cp))
                    if cp == 1:
                        continue
                    impls = [("local", c) for c in args.comm_types if not PATTERNS[c].hierarchical or cp >= 4]
                    if peer and fmt == "bshd":
                        impls += [("torch_ring", m) for m in ROTATE_METHODS]
                    by_world.setdefault(cp, []).extend(
                        Case(impl, comm, cp, seq_len, fmt, pass_name, threads) for impl, comm in impls
                    )
    return by_world


def attn_worker(cases: list[Case], shape: Shape, warmup: int, reps: int) -> list[dict] | None:
    with rank_session("cp-bench", device_type=shape.device):  # CUDA: one GPU per rank, NCCL
        rank0 = dist.get_rank() == 0
        bar = case_progress(len(cases), f"attn cp={dist.get_world_size()}", enabled=rank0)
        rows = run_cases(cases, shape, warmup, reps, lambda case: bar.update(
            case=f"{case.impl} {case.comm_type} S={case.seq_len} {case.qkv_format} {case.pass_name}"),
            lambda batch: bar.begin(case=f"{len(batch)} implementations at S={batch[0].seq_len} {batch[0].qkv_format} "
                                         f"{batch[0].pass_name}, timed interleaved"))
        bar.close()
        return rows if rank0 else None


def run_attn(args) -> list[dict]:
    shape = Shape(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                  device=args.device)
    rows = []
    for world, cases in sorted(build_cases(args).items()):
        rows += launch(attn_worker, world, cases, shape, args.warmup, args.reps, program="cp-bench")[0]
    return report.add_efficiency(rows)
