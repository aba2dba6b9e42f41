"""Block attention kernels, one module per family, chosen per device and dtype, overridable.

Automatic choice, fastest first, among kernels that a GPU run has verified (:attr:`AttnKernel.verified_on`):

* CPU: ``cpu_flash`` (any float dtype, GQA native); ``cpu_varlen`` (the packed interface on CPU,
  the reference of the batching: never automatic);
* CUDA: ``fa4_varlen`` and ``fa4`` (FlashAttention-4 packed calls and blocks, :mod:`.fa4`: sm90+, fp16/bf16,
  GQA native; the optional ``fa4`` extra; ``fa4`` verified for bshd / sbhd at head dims 64 and 128, the rest
  opt-in until a GPU run verifies it), ``cudnn`` (fp16/bf16, head
  dim <= 128; opt-in: a graph per block shape, never for packed documents), ``cudnn_ragged`` (the same with
  ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``: a graph per power-of-two bucket of lengths; opt-in),
  ``flash_varlen`` (FlashAttention-2 varlen: a plan's blocks in few calls; verified in bf16), ``flash_gqa``
  (FlashAttention-2 with K/V at their own head count), ``flash`` (FlashAttention-2, K/V expanded for GQA),
  ``efficient`` (memory-efficient; fp32 too). GPU runs: docs/testing.md.

Each kernel states its limits (dtypes, largest head dim, head-dim multiple by dtype) and
:meth:`AttnKernel.cannot_run` checks them, so the automatic choice moves on to the next kernel and a
forced kernel fails with a ``ValueError`` naming the limit instead of an error inside the op.

A packed kernel (:mod:`.varlen`) runs every block of a plan that shares a mask flag, and has
disjoint query rows, in one call (:mod:`cp_handler.ops.packed_blocks`).

Masked blocks (the edge bands of windows, soft-capped blocks: :func:`cp_handler.core.masks.mask_blocks`) go block by
block to the fastest kernel whose :attr:`AttnKernel.masks` hold what the block needs
(:func:`~cp_handler.core.masks.block_needs`) and which a run verified for it (:attr:`AttnKernel.verified_masks`): the
plan's kernel first, then the others of the device in the order above; else the explicit scores of
:mod:`.masked` (exact in float32 / float64, slow: counted as ``explicit_blocks`` by :func:`count_attn_work`). Today:
``cpu_flash`` takes windows, two-sided windows and chunks (an additive mask); soft-caps stay explicit on CPU;
``flash`` / ``flash_gqa`` declare windows (FlashAttention-2's ``window_size_left/right``) and ``fa4`` windows and
soft-caps, opt-in until a GPU run verifies them. ``CP_HANDLER_MASKED_KERNEL`` forces the kernel of masked blocks by
name, or ``explicit``: a forced kernel that lacks what a mask's blocks may need is a ``ValueError`` naming the
variable, the kernel and what it lacks, raised when the call's spec is made (:func:`check_masked_override`).

Override: the ``attn_kernel`` argument of the local handler and of every algorithm in ``ops``, or
the environment variable ``CP_HANDLER_ATTN_KERNEL`` (the argument wins). A forced kernel that
cannot run raises ``ValueError`` naming the override, the kernel and the reason; an unknown name
lists the known ones. Nothing falls back silently. Kernel contract: :mod:`.base`.
"""

from __future__ import annotations

import os

import torch

from ...core.masks import mask_needs
from . import cpu_flash, cuda_cudnn, cuda_efficient, cuda_flash, fa4, varlen
from .base import AttnKernel, check_causal_square
from .work import WorkCounter, count_attn_work, record_attn_work

ATTN_KERNEL_ENV = "CP_HANDLER_ATTN_KERNEL"
"""Environment variable that forces a kernel by name (a key of :data:`KERNELS`)."""
MASKED_KERNEL_ENV = "CP_HANDLER_MASKED_KERNEL"
"""Environment variable that forces the kernel of masked blocks: a key of :data:`KERNELS`, or :data:`EXPLICIT`."""
EXPLICIT = "explicit"
"""The explicit-scores path of masked blocks (:mod:`.masked`), as a :data:`MASKED_KERNEL_ENV` value."""

KERNELS: dict[str, AttnKernel] = {k.name: k for k in (cpu_flash.KERNEL, varlen.CPU_VARLEN, fa4.VARLEN_KERNEL,
                                                      fa4.KERNEL, cuda_cudnn.KERNEL, cuda_cudnn.RAGGED_KERNEL,
                                                      varlen.FLASH_VARLEN, cuda_flash.GQA_KERNEL, cuda_flash.KERNEL,
                                                      cuda_efficient.KERNEL)}
"""Every kernel by name, in order of preference (fastest first) within a device type."""

__all__ = ["ATTN_KERNEL_ENV", "AUTOMATIC", "AttnKernel", "EXPLICIT", "KERNELS", "MASKED_KERNEL_ENV", "WorkCounter",
           "block_attn_backward", "block_attn_forward", "check_masked_override", "check_plan", "count_attn_work",
           "kernel_override", "masked_kernel", "record_attn_work", "select_kernel"]


AUTOMATIC = "automatic"
"""``attn_kernel`` value of a choice already resolved to "the fastest verified kernel" (handlers pass
it after reading ``CP_HANDLER_ATTN_KERNEL`` once, at construction; the block calls do not read it)."""


def kernel_override(attn_kernel: str | None = None) -> tuple[str | None, str]:
    """``(forced kernel name or None, where it came from)``: the argument, else ``CP_HANDLER_ATTN_KERNEL``
    (read now), ``None`` for the automatic choice."""
    if attn_kernel == AUTOMATIC:
        return None, "attn_kernel"
    if attn_kernel is not None:
        return attn_kernel, "attn_kernel"
    return os.environ.get(ATTN_KERNEL_ENV) or None, ATTN_KERNEL_ENV


def select_kernel(q: torch.Tensor, attn_kernel: str | AttnKernel | None = None, *,
                  varying_shapes: bool = False, v_head_dim: int | None = None) -> AttnKernel:
    """The kernel for blocks shaped like ``q (B, H, S, D)``.

    Args:
        q: a query block (its device, dtype and head dim decide).
        attn_kernel: force a kernel by name (or pass one, e.g. a kernel re-labelled for ``meta``
            tensors by ``cp-bench --modes launches``); :data:`AUTOMATIC`: the fastest verified kernel
            that can run; ``None``: ``CP_HANDLER_ATTN_KERNEL`` if set, else automatic.
        varying_shapes: the blocks come from packed documents (thd), a new shape per document pair:
            kernels that build a plan per shape (:attr:`AttnKernel.shape_specialized`) are skipped.
        v_head_dim: the values' head dim when it differs from q's (multi-head latent attention).

    Raises:
        ValueError: an unknown name, a forced kernel that cannot run ``q`` (with the reason; a
            shape-specialized kernel with ``varying_shapes``), or no verified kernel for this device and dtype.
    """
    if isinstance(attn_kernel, AttnKernel):
        forced, source = attn_kernel, "attn_kernel"
    else:
        name, source = kernel_override(attn_kernel)
        if name is not None and name not in KERNELS:
            raise ValueError(f"{source}={name!r} is not a known attention kernel; known: {list(KERNELS)}")
        forced = KERNELS.get(name) if name is not None else None
    if forced is not None:
        reason = forced.cannot_run(q, varying_shapes, v_head_dim)
        if reason is not None:
            raise ValueError(f"{source}={forced.name!r} cannot run this attention: {reason}")
        return forced
    reasons = []
    for kernel in KERNELS.values():
        dims = f"head dim {q.shape[-1]}" if v_head_dim in (None, q.shape[-1]) else \
            f"head dims {q.shape[-1]} (q, k) / {v_head_dim} (v)"
        unverified = f"not yet verified on a GPU in {q.dtype} at {dims} (opt-in: attn_kernel={kernel.name!r})"
        if varying_shapes and not kernel.verified_thd:
            unverified = f"not yet verified on a GPU for packed documents (thd) (opt-in: attn_kernel={kernel.name!r})"
        reason = kernel.cannot_run(q, varying_shapes, v_head_dim) or \
            (None if kernel.verified_for(q.dtype, q.shape[-1], v_head_dim, varying_shapes) else unverified)
        if reason is None:
            return kernel
        reasons.append(f"{kernel.name}: {reason}")
    raise ValueError(f"no attention kernel runs q {tuple(q.shape)} {q.dtype} on {q.device.type}: {'; '.join(reasons)}")


def masked_kernel(needs: frozenset[str], q: torch.Tensor, plan_kernel: AttnKernel, v_head_dim: int | None = None,
                  forced: str | None = None) -> AttnKernel | None:
    """The kernel of a masked block that needs ``needs`` (:func:`~cp_handler.core.masks.block_needs`) in a plan of
    ``plan_kernel`` with queries like ``q (B, H, S, D)``, or ``None`` for the explicit scores (:mod:`.masked`).

    ``forced`` (the value of :data:`MASKED_KERNEL_ENV`, ``None``: automatic): :data:`EXPLICIT`, or a kernel that
    must take the block. Automatic: the plan's kernel, then every kernel of the device in order, the first that
    can run ``q``, holds ``needs`` among its verified :attr:`~AttnKernel.masks` and is verified in q's dtype.

    Raises:
        ValueError: ``forced`` unknown, packed, unable to run ``q`` or without one of ``needs`` (named).
    """
    if forced == EXPLICIT:
        return None
    if forced is not None:
        kernel = KERNELS.get(forced)
        if kernel is None or kernel.packed or kernel.masked_forward is None:
            takers = [name for name, k in KERNELS.items() if k.masked_forward is not None]
            raise ValueError(f"{MASKED_KERNEL_ENV}={forced!r}: the kernels of masked blocks are {takers} and "
                             f"{EXPLICIT!r}")
        reason = kernel.cannot_run(q, v_head_dim=v_head_dim)
        if reason is None and not needs <= kernel.masks:
            reason = f"it computes {sorted(kernel.masks)}, a block needs {sorted(needs - kernel.masks)}"
        if reason is not None:
            raise ValueError(f"{MASKED_KERNEL_ENV}={forced!r} cannot run this masked block: {reason}")
        return kernel
    for kernel in (plan_kernel, *KERNELS.values()):
        if kernel.masked_forward is not None and needs <= kernel.verified_masks and not kernel.packed and \
                kernel.device_type == q.device.type and kernel.cannot_run(q, v_head_dim=v_head_dim) is None and \
                kernel.verified_for(q.dtype, q.shape[-1], v_head_dim):
            return kernel
    return None


def check_masked_override(mask, q: torch.Tensor, plan_kernel: AttnKernel, v_head_dim: int | None = None) -> None:
    """Where :data:`MASKED_KERNEL_ENV` forces a kernel, raise :func:`masked_kernel`'s ``ValueError`` now if it lacks
    anything a block of ``mask`` may need (:func:`~cp_handler.core.masks.mask_needs`): the same answer on every rank,
    before the attention communicates (a block's own needs are only known inside a ring step)."""
    forced = os.environ.get(MASKED_KERNEL_ENV) or None
    if forced is not None:
        masked_kernel(mask_needs(mask), q, plan_kernel, None if v_head_dim == q.shape[-1] else v_head_dim, forced)


def _check_nonempty(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"block attention got a zero-length block: q {tuple(q.shape)}, k {tuple(k.shape)}")


def check_plan(blocks: list, empty_queries: bool = False) -> list:
    """``blocks`` (``(q rows, kv rows, mask)``), checked once where a planner makes them (its results are
    cached): no empty block (``empty_queries``: blocks without query rows allowed, a packed kernel's empty
    segments), every causal block square (:func:`~.base.check_causal_square`). Returns them.

    Raises:
        ValueError: naming the block (a bug in the planner).
    """
    for q_rows, kv_rows, causal in blocks:
        if (q_rows.stop <= q_rows.start and not empty_queries) or kv_rows.stop <= kv_rows.start:
            raise ValueError(f"the block plan holds an empty block {q_rows} x {kv_rows}: a bug in the planner")
        check_causal_square(q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start, causal is True)
    return blocks


def block_attn_forward(q, k, v, *, causal: bool, scale: float, kernel: AttnKernel | None = None):
    """Attention of one (q block, kv block) pair, checked: ``(out (B,H,Sq,D), lse (B,H,Sq))``; ``kernel``
    (a block kernel, not a packed one) default :func:`select_kernel`. For direct use: the algorithms call the
    kernel of their spec, on blocks their planners checked (:func:`check_plan`)."""
    _check_nonempty(q, k)
    check_causal_square(q.shape[-2], k.shape[-2], causal)
    return (kernel or select_kernel(q)).forward(q, k, v, causal=causal, scale=scale)


def block_attn_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, kernel: AttnKernel | None = None):
    """Gradients ``(dq, dk, dv)`` of one block, given the merged ``out`` and ``lse`` of q's rows."""
    _check_nonempty(q, k)
    check_causal_square(q.shape[-2], k.shape[-2], causal)
    return (kernel or select_kernel(q)).backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
