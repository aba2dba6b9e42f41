"""One attention call as every algorithm runs it (:class:`AttnSpec`), and the one autograd wrapper of the
algorithms (:class:`AttentionFunction`).

A spec is resolved and checked **once per call**: by a handler's pre-flight
(:mod:`cp_handler.handlers.preflight`), or by :func:`attn_spec` for a direct caller of an algorithm
(``ring_attn``, ``all_gather_attn``, ``a2a_attn``). The algorithms, the block plans and the kernels trust it
and check nothing again: the mask and sinks are resolved, the layout fits, and the kernel is chosen (not per
ring step).

An algorithm gives ``forward(q, k, v, spec, *extra, sinks) -> (out, lse)`` (sinks folded in, :mod:`.sinks`)
and ``backward(dout, q, k, v, out, lse, spec, *extra) -> (dq, dk, dv)`` given the forward's (folded)
``out`` / ``lse``; :class:`AttentionFunction` saves what the backward needs and adds the sinks' gradient (unless the
backward returns it fourth: the deterministic mode's canonical tiles sum it in tile order).
``lse`` is returned but not differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask, resolve_mask
from .kernels import AttnKernel, check_masked_override, select_kernel
from .packed_blocks import PackedCallCache
from .sinks import check_sinks, sinks_grad


@dataclass(frozen=True, eq=False)
class KernelChoice:
    """What a handler asked for once, at construction: a kernel name (``None``: ``CP_HANDLER_ATTN_KERNEL``, else
    automatic), whether its plans come from packed documents (``varying_shapes``: thd, see
    :func:`~.kernels.select_kernel`) and the packed-call cache its calls share."""

    kernel: str | AttnKernel | None = None
    varying_shapes: bool = False
    packed_calls: PackedCallCache = field(default_factory=PackedCallCache)
    chosen: dict = field(default_factory=dict)
    """The kernels chosen so far, by device, dtype and head dims (a handler's layers choose once)."""

    def select(self, q: torch.Tensor, v_head_dim: int | None = None) -> AttnKernel:
        """The kernel for this call's ``q (B, H, S, D)`` and values of head dim ``v_head_dim``
        (:func:`~.kernels.select_kernel`, once per device, dtype and head dims; raises its ValueError)."""
        key = (q.device, q.dtype, q.shape[-1], v_head_dim)
        kernel = self.chosen.get(key)
        if kernel is None:
            kernel = self.chosen[key] = select_kernel(q, self.kernel, varying_shapes=self.varying_shapes,
                                                      v_head_dim=v_head_dim)
        return kernel


@dataclass(frozen=True, eq=False)
class AttnSpec:
    """Everything but the tensors of one attention call, resolved and checked (see the module doc).

    Attributes:
        mask: what a query sees (:class:`~cp_handler.core.masks.AttentionMask`).
        scale: the softmax scale.
        layout: the documents of the local sequence over the group (:class:`~cp_handler.core.layout.ZigzagDocs`).
        kernel: the block kernel of every block of the call.
        packed_calls: the cache of a packed kernel's calls (shared by a handler's calls).
        group: the pattern's group: the ring's, the all-gather's, or the all-to-all's (a2a, the a2a level of
            a2a+p2p); ``None``: this rank alone.
        p2p_group: a2a+p2p's ring level (``None`` otherwise).
        sinks: ``(H,)`` learnable sink logits, or ``None``.
        kv_heads_per_chunk: ``all_gather``: KV heads gathered at once (``None``: ``ceil(Hkv / 2)``, or all
            of them below :data:`~.all_gather.PIPELINE_MIN_BYTES` of gathered K/V).
        halves: the ring runs over its rows reordered (:mod:`.halves`: packed documents without per-step gathers);
            set by the ring itself.
        canonical: the deterministic mode: ``a2a`` (and ``a2a+p2p``'s ring) computes its heads on canonical tiles
            where they apply (:func:`~.canonical.canonical_applies`), as one process and the other patterns do.
    """

    mask: AttentionMask
    scale: float
    layout: ZigzagDocs
    kernel: AttnKernel
    packed_calls: PackedCallCache = field(default_factory=PackedCallCache)
    group: dist.ProcessGroup | None = None
    p2p_group: dist.ProcessGroup | None = None
    sinks: torch.Tensor | None = None
    kv_heads_per_chunk: int | None = None
    halves: bool = False
    canonical: bool = False


def attn_spec(q: torch.Tensor, *, causal: bool, scale: float, layout: ZigzagDocs, attn_kernel=None,
              mask: AttentionMask | None = None, sinks: torch.Tensor | None = None, v_head_dim: int | None = None,
              **groups) -> AttnSpec:
    """The spec of a direct call into an algorithm with ``q (B, H, S, D)``: the entry checks a handler's
    pre-flight does for its own calls.

    Args:
        attn_kernel: a kernel name, an :class:`~.kernels.AttnKernel`, a :class:`KernelChoice`, or ``None``.
        groups: :class:`AttnSpec`'s ``group``, ``p2p_group``, ``kv_heads_per_chunk``.

    Raises:
        TypeError / ValueError: a mask that disagrees with ``causal`` (:func:`~cp_handler.core.masks.resolve_mask`),
            sinks of the wrong type or shape (:func:`~.sinks.check_sinks`), a kernel that cannot run ``q``, a
            masked kernel forced by ``CP_HANDLER_MASKED_KERNEL`` that cannot run the mask's blocks.
    """
    mask = resolve_mask(causal, mask)
    check_sinks(sinks, q.shape[1], q)
    choice = attn_kernel if isinstance(attn_kernel, KernelChoice) else KernelChoice(attn_kernel)
    kernel = choice.select(q, v_head_dim)
    if not mask.plain:
        check_masked_override(mask, q, kernel, v_head_dim)
    return AttnSpec(mask, scale, layout, kernel, choice.packed_calls, sinks=sinks, **groups)


class AttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, sinks, forward, backward, spec, *extra) -> (out, lse)`` (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, forward, backward, spec, *extra):
        out, lse = forward(q, k, v, spec, *extra, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.backward_fn, ctx.spec, ctx.extra = backward, spec, extra
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = ctx.backward_fn(dout, q, k, v, out, lse, ctx.spec, *ctx.extra)
        dq, dk, dv = grads[:3]
        if len(grads) == 4:  # an algorithm that reduces the sinks' gradient its own way (the deterministic mode)
            dsinks = grads[3]
        else:
            dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, *(None for _ in ctx.extra)
