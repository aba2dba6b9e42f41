"""What a block-attention kernel is: forward returning the log-sum-exp, backward given the merged out/lse.

All tensors are ``(B, H, S, D)`` (heads before sequence, as the aten SDPA ops take them); k/v may
have ``Hkv`` heads with ``H % Hkv == 0`` (GQA). ``lse`` is ``(B, H, Sq)`` in float32 (float64 for
float64 inputs), natural log. The backward takes the *merged* (whole-sequence) ``out`` and ``lse``
of q's rows: with them, the flash backward of one block gives exactly that block's share of dq,
dk, dv (FlashAttention-2, Dao 2023). dk/dv come back with ``Hkv`` heads. Zero-length blocks are
never passed (callers skip them).

Causal blocks are square (``Sq == Sk``), checked at the kernel entry points (:func:`check_causal_square`):
the kernels disagree on where a non-square causal mask sits (FlashAttention and its varlen form align
it bottom-right, cuDNN and the memory-efficient kernel top-left), so a non-square causal block would
give kernel-dependent answers; for square blocks every alignment is the same mask.

Layout: the accumulators (:func:`~cp_handler.ops.blocks.new_accumulators`) are sequence-major, i.e.
``(B, H, S, D)`` views of ``(B, S, H, D)`` memory, the layout the CUDA kernels take without copies
(they transpose to ``(B, S, H, D)`` and make that contiguous); :func:`seq_major` converts other tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

H100_RUN = "H100 80GB HBM3, torch 2.11.0+cu130, cuDNN 9.19, 2026-11-24 (scripts/gpu_check.py)"
"""The GPU run that verified the kernels marked with it (docs/testing.md)."""
H200_RUN_B = "NVIDIA H200, torch 2.11.0+cu130, flash-attn-4 4.0.0b36, 2026-11-27 (run H200-2026-11-27b)"
"""The second GPU pass of 2026-11-27 (docs/testing.md, GPU runs)."""

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttnKernel:
    """One kernel family.

    Attributes:
        name: the name an override uses (argument ``attn_kernel`` or ``CP_HANDLER_ATTN_KERNEL``).
        device_type: ``"cpu"`` or ``"cuda"``.
        dtypes: input dtypes it runs.
        forward: ``(q, k, v, *, causal, scale) -> (out (B,H,Sq,D) in q's dtype, lse (B,H,Sq))``.
        backward: ``(dout, q, k, v, out, lse, *, causal, scale) -> (dq, dk, dv)``.
        verified_on: where a GPU run checked it against a float64 reference (device, torch,
            result), or ``None``: an unverified CUDA kernel is never chosen automatically.
        verified_dtypes: the dtypes that run verified (default: all of ``dtypes`` once ``verified_on``
            is set); in the others the kernel is opt-in only.
        max_head_dim: largest head dim it runs (``None``: any).
        head_dim_multiple: head dims it runs are multiples of this, by dtype (``{dtype: m}``; absent: any).
        packed: forward/backward take packed segments instead of one block (:mod:`.varlen`):
            ``(q (Tq,H,D), k, v (Tk,Hkv,D), cu_q, cu_k, max_q, max_k, *, causal, scale)``, lse ``(H, Tq)``.
        shape_specialized: it builds and caches a plan per block shape (cuDNN's graphs: 0.1-1.5 s per new
            ``(Sq, Sk)`` on an H100, measured), so it runs only plans whose block shapes repeat from step
            to step (bshd / sbhd), not packed documents (thd), whose every document pair is a new shape.
        requirement: ``q -> reason or None``: what it needs of this machine beyond the device type (an optional
            package at its pinned release, a compute capability); ``None``: nothing.
        verified_head_dims: the head dims a GPU run verified (forward and backward); ``None``: every head dim
            within its limits. The automatic choice takes it only for those.
        distinct_v_head_dim: it takes a value head dim other than the query / key head dim (multi-head latent
            attention, ``Dv != Dqk``), exactly (never by padding q / k, which would change the default scale).
            A CUDA kernel's MLA blocks are verified only by a GPU run of them (none yet): the automatic choice
            takes ``Dv != Dqk`` on CUDA only from a kernel a run verified for it; CPU kernels are the suite's.
        verified_thd: the verifying run covered plans of packed documents (thd) too; ``False``: the automatic
            choice takes it for bshd / sbhd plans only (a forced kernel still runs thd).
        masks: what its masked calls compute exactly, of :data:`~cp_handler.core.masks.MASK_FEATURES` (the causal edge
            at any offset, left / right window edges, a chunk boundary, soft-capped scores); empty: only the plain
            causal / full blocks. Sinks need nothing of any kernel: they are folded in after the merge
            (:mod:`~cp_handler.ops.sinks`); a value head dim other than q's is :attr:`distinct_v_head_dim`, packed
            documents :attr:`packed`.
        masked_forward: ``(q, k, v, block: BlockMask, *, scale) -> (out, lse)`` of one masked block (the contract
            of ``forward``; a row that sees no key of the block gets ``out = 0`` and the lowest finite lse).
        masked_backward: ``(dout, q, k, v, out, lse, block: BlockMask, *, scale) -> (dq, dk, dv)``, given the merged
            out / lse.
        verified_masks: the features of :attr:`masks` a run verified against a float64 reference (CPU kernels: the
            suite); the automatic routing of masked blocks takes only these (``CP_HANDLER_MASKED_KERNEL`` opts in).
    """

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    forward: Forward
    backward: Backward
    verified_on: str | None
    max_head_dim: int | None = None
    packed: bool = False
    head_dim_multiple: tuple[tuple[torch.dtype, int], ...] = ()
    verified_dtypes: tuple[torch.dtype, ...] | None = None
    shape_specialized: bool = False
    requirement: Callable[[torch.Tensor], str | None] | None = None
    verified_head_dims: tuple[int, ...] | None = None
    distinct_v_head_dim: bool = False
    verified_distinct_v: bool = False
    verified_thd: bool = True
    masks: frozenset[str] = frozenset()
    masked_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    masked_backward: Backward | None = None
    verified_masks: frozenset[str] = frozenset()

    def verified_for(self, dtype: torch.dtype, head_dim: int | None = None, v_head_dim: int | None = None,
                     varying_shapes: bool = False) -> bool:
        """Whether a GPU run verified this kernel in ``dtype`` (and ``head_dim``, and a value head dim
        ``v_head_dim`` other than it, and plans of packed documents with ``varying_shapes``; CPU kernels:
        verified by the suite)."""
        head_dim_ok = head_dim is None or self.verified_head_dims is None or head_dim in self.verified_head_dims
        mla_ok = v_head_dim in (None, head_dim) or self.verified_distinct_v or self.device_type == "cpu"
        return self.verified_on is not None and dtype in (self.verified_dtypes or self.dtypes) and head_dim_ok and \
            mla_ok and (self.verified_thd or not varying_shapes)

    def cannot_plan(self, varying_shapes: bool) -> str | None:
        """Why this kernel cannot run plans of packed documents (``varying_shapes``), or ``None``."""
        if varying_shapes and self.shape_specialized:
            return ("it builds a plan per block shape (0.1-1.5 s each on an H100), and packed documents (thd) make "
                    "a new shape per document pair: use flash_varlen (or the automatic choice) for thd")
        return None

    def cannot_run(self, q: torch.Tensor, varying_shapes: bool = False, v_head_dim: int | None = None) -> str | None:
        """Why this kernel cannot take ``q`` (in plans of packed documents, with ``varying_shapes``:
        :meth:`cannot_plan`; values of head dim ``v_head_dim``, default q's), or ``None`` if it can."""
        if reason := self.cannot_plan(varying_shapes):
            return reason
        if q.device.type != self.device_type:
            return f"it runs on {self.device_type}, q is on {q.device.type}"
        if q.dtype not in self.dtypes:
            return f"it takes {[str(d) for d in self.dtypes]}, q is {q.dtype}"
        if self.max_head_dim is not None and q.shape[-1] > self.max_head_dim:
            return f"it takes head dims <= {self.max_head_dim}, q has {q.shape[-1]}"
        multiple = dict(self.head_dim_multiple).get(q.dtype, 1)
        if q.shape[-1] % multiple:
            return f"it takes head dims that are multiples of {multiple} in {q.dtype}, q has {q.shape[-1]}"
        if v_head_dim not in (None, q.shape[-1]):
            if not self.distinct_v_head_dim:
                return (f"it takes one head dim for q, k and v; v has {v_head_dim}, q and k {q.shape[-1]} (multi-head "
                        "latent attention)")
            if self.max_head_dim is not None and v_head_dim > self.max_head_dim:
                return f"it takes value head dims <= {self.max_head_dim}; v has {v_head_dim}"
            if v_head_dim % multiple:
                return f"it takes value head dims that are multiples of {multiple} in {q.dtype}; v has {v_head_dim}"
        return self.requirement(q) if self.requirement is not None else None


def check_causal_square(q_len: int, k_len: int, causal: bool) -> None:
    """Raises ValueError for a causal block that is not square (see the module doc: the kernels'
    causal alignments differ; every plan of cp_handler makes square causal blocks)."""
    if causal and q_len != k_len:
        raise ValueError(f"a causal block of {q_len} queries and {k_len} keys: causal blocks must be square (the "
                         "kernels align a non-square causal mask differently); this is a bug in the block plan")


def seq_major(t: torch.Tensor) -> torch.Tensor:
    """``t (B, H, S, D)`` as a view of ``(B, S, H, D)``-contiguous memory: ``t`` itself when it
    already is one (no copy), else one copy."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """K or V with as many heads as q (GQA groups repeated), for kernels without native GQA."""
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def reduce_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of expanded K or V back to ``kv_heads`` heads (adjoint of :func:`expand_kv`)."""
    if grad.shape[1] == kv_heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)
