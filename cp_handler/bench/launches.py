"""Kernel launches of one rank's plan, counted without a GPU (``cp-bench --modes launches``).

Small shards on CUDA are bound by launches, not by math (measured: docs/performance.md). This mode runs the plan of
the busier end of the ring (rank 0 or the last rank, whichever moves more bytes: :func:`_busiest`) of every pattern
(:func:`~.plan.rank_plan`, forward + backward, the code ``--modes plan`` times) on ``meta`` tensors through a CUDA
kernel's own Python code (the kernel re-labelled for ``meta``; the aten ops' meta kernels give every shape, so no
GPU is needed) and counts the aten operators dispatched, views and allocations left out. Every counted operator
launches at least one CUDA kernel (the flash backward launches several), so the count is a lower bound of a rank's
launches, exact in what our code adds around the attention kernels; it does not depend on the machine.

Beside the launches, the bytes the operators outside the attention kernels move (every tensor they read and
write: gathers, scatters, merges, casts, zero fills; :class:`LaunchCounter`), so thd and bshd can be compared at
the same tokens. Beside both, each row's ``tile_ratio``: the 128 x 128 score tiles the rank's blocks visit
(partly masked tiles count whole), times cp, over those of the whole-sequence reference
(:func:`~.plan.plan_tiles`, :func:`~.plan.whole_tiles`): the padded work that splitting adds (1.0 for
bshd; above 1 where packed documents are cut into pieces shorter than a tile). At one per-tile rate,
``--modes plan``'s efficiency would be ``1 / tile_ratio``.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import asdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..ops.kernels import KERNELS, AttnKernel
from .case_progress import each_case
from .plan import PlanCase, PlanShape, cases, plan_tiles, rank_plan, rank_step, whole_tiles

ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""Operators that only allocate (no kernel on CUDA)."""

HIDDEN_COPIES = {"_scaled_dot_product_flash_attention_backward": True, "_flash_attention_backward": False}
"""FlashAttention backward ops that copy ``grad_out`` and ``out`` inside (their CUDA code calls
``.contiguous()`` on them: ``_flash_attention_backward`` in torch's attention_backward.cu, which the SDPA
form reaches with the tensors transposed to ``(B, S, H, D)``; ``True`` marks that transpose). The meta
kernels do not, so the counter adds one ``contiguous (inside the op)`` per such argument that is not
already contiguous: the copies the accumulator layout decides."""


def hidden_copies(name: str, func, args, kwargs) -> int:
    """Copies ``func`` (one of :data:`HIDDEN_COPIES`) makes of its ``grad_out`` / ``out`` arguments."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    transposed = HIDDEN_COPIES[name]
    return sum(not (t.transpose(1, 2) if transposed else t).is_contiguous() for t in (bound["grad_out"], bound["out"]))

DEFAULT_KERNELS = ("flash", "flash_gqa", "flash_varlen", "cudnn")


ATTENTION_OPS = frozenset({
    "_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward"})
"""The attention kernels themselves: their launches are counted, their bytes are not (``bytes_outside``)."""


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a list / tuple of them; anything else 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class LaunchCounter(TorchDispatchMode):
    """Counts the dispatched aten operators that launch device work (not views, not allocations) and the bytes the
    ones outside the attention kernels move: every tensor argument read and every tensor result written (an
    in-place op's tensor both), i.e. the memory traffic a device does around the kernels (a lower bound: an op
    reading a broadcast tensor reads it once here)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes_outside: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and name not in ALLOCATIONS:
            self.ops[name] += 1
            if name not in ATTENTION_OPS:
                self.bytes_outside[name] += _tensor_bytes(list(args) + list(kwargs.values())) + _tensor_bytes(out)
        if name in HIDDEN_COPIES:
            copies = hidden_copies(name, func, args, kwargs)
            self.ops["contiguous (inside the op)"] += copies
            if copies:  # grad_out / out copied inside the op: read and written once each
                self.bytes_outside["contiguous (inside the op)"] += 2 * copies * _tensor_bytes(args[0])
        return out


def meta_kernel(name: str) -> AttnKernel:
    """CUDA kernel ``name`` re-labelled to run its code on ``meta`` tensors."""
    return dataclasses.replace(KERNELS[name], device_type="meta")


def check_kernels(names, shape: PlanShape | None = None) -> None:
    """Raises ``ValueError`` (naming ``--launch-kernels``) for a name that is not a CUDA kernel of
    :data:`~cp_handler.ops.kernels.KERNELS`, or one that cannot run ``shape`` (dtype, head dim)."""
    cuda = [name for name, k in KERNELS.items() if k.device_type == "cuda"]
    for name in names:
        if name not in cuda:
            raise ValueError(f"--launch-kernels: {name!r} is not a CUDA kernel; CUDA kernels: {cuda}")
        if shape is not None:
            probe = torch.empty(1, 1, 1, shape.head_dim, device="meta", dtype=getattr(torch, shape.dtype))
            reason = meta_kernel(name).cannot_run(probe)
            if reason:
                raise ValueError(f"--launch-kernels: {name!r} cannot run this shape: {reason}")


def count_launches(case, shape: PlanShape, kernel_name: str, rank: int = 0) -> LaunchCounter:
    """The :class:`LaunchCounter` of one forward + backward of ``rank``'s plan in ``case`` with CUDA kernel
    ``kernel_name`` (operators, and bytes outside the attention kernels).

    Raises:
        ValueError: ``kernel_name`` is not a CUDA kernel (:func:`check_kernels`).
    """
    check_kernels([kernel_name])
    meta_shape = dataclasses.replace(shape, device="meta", kernel=None)
    kernel = meta_kernel(kernel_name)
    step = rank_step(rank_plan(case, meta_shape, kernel.packed, rank), meta_shape, kernel)
    step()  # first call builds what later steps reuse (packed index tensors), as a training run's first step does
    with LaunchCounter() as counter:
        step()
    return counter


def _busiest(case, shape: PlanShape, names) -> tuple[int, dict[str, LaunchCounter]]:
    """``(rank, {kernel: its count})`` of rank 0 or the last rank, whichever moves more bytes outside the kernels
    (summed over ``names``): the ring's two ends. Rank 0 meets the most steps from later ranks (second-chunk queries
    against whole blocks), the last rank the most from earlier ones, and it gathers the blocks it sends over the
    ring's wrap (:mod:`cp_handler.ops.halves`); under zigzag the ranks between do a mix of the two."""
    counts = {rank: {name: count_launches(case, shape, name, rank) for name in names}
              for rank in sorted({0, case.cp_size - 1})}
    return max(counts.items(), key=lambda item: sum(sum(c.bytes_outside.values()) for c in item[1].values()))


def run(args) -> dict:
    """``--modes launches``: every pattern's rank plan (the plan flags' sizes) for each of ``args.launch_kernels``,
    a progress line per case."""
    shape = PlanShape(num_heads=args.plan_heads, num_kv_heads=args.plan_kv_heads, head_dim=args.plan_head_dim,
                      dtype=args.plan_dtype, thd_mean_doc=args.thd_mean_doc)
    rows = []
    todo = [c for c in cases(args.plan_seq_lens, args.plan_cp_sizes, args.comm_types, args.formats)
            if c.pattern != "whole"]
    for case in each_case(todo, "launches", PlanCase.describe):
        # a kernel that builds a plan per block shape does not run packed documents (select_kernel refuses it)
        names = [name for name in args.launch_kernels
                 if not KERNELS[name].cannot_plan(rank_plan(case, shape).varying_shapes)]
        rank, counts = _busiest(case, shape, names)
        plan = rank_plan(case, shape, rank=rank)
        rows.append({**asdict(case), "rank": rank, "blocks": sum(len(s) for s in plan.steps),
                     "tile_ratio": case.cp_size * plan_tiles(plan) / whole_tiles(case, shape),
                     "ops": {name: sum(counts[name].ops.values()) if name in counts else None
                             for name in args.launch_kernels},
                     "bytes_outside": {name: sum(counts[name].bytes_outside.values()) if name in counts else None
                                       for name in args.launch_kernels},
                     "by_operator": {name: dict(c.ops.most_common()) for name, c in counts.items()},
                     "bytes_by_operator": {name: dict(c.bytes_outside.most_common()) for name, c in counts.items()}})
    return {"shape": asdict(shape), "kernels": list(args.launch_kernels), "rows": rows}
