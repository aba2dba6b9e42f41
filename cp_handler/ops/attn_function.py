"""The one autograd wrapper of every attention algorithm: ``(q, k, v, sinks) -> (out, lse)``.

An algorithm gives a forward ``forward(q, k, v, *args, sinks=...) -> (out, lse)`` (sinks folded in,
:mod:`.sinks`) and a backward ``backward(dout, q, k, v, out, lse, *args) -> (dq, dk, dv)`` given the
forward's (folded) ``out`` / ``lse``; this Function saves what the backward needs and adds the sinks'
gradient. ``lse`` is returned but not differentiable.
"""

from __future__ import annotations

import torch

from ..masks import AttentionMask, resolve_mask
from .sinks import check_sinks, sinks_grad


def check_variant(q: torch.Tensor, causal: bool, mask: AttentionMask | None, sinks) -> AttentionMask:
    """The mask an algorithm runs (:func:`~cp_handler.masks.resolve_mask`), with the sinks' shape checked
    (:func:`~.sinks.check_sinks`): the entry checks of every algorithm, before any collective."""
    mask = resolve_mask(causal, mask)
    check_sinks(sinks, q.shape[1], q)
    return mask


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, forward, backward, args):
        out, lse = forward(q, k, v, *args, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.backward_fn, ctx.args = backward, args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(dout, q, k, v, out, lse, *ctx.args)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None


def attention_function(forward, backward, q, k, v, sinks, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(out, lse)`` of the algorithm ``forward`` / ``backward`` (see the module doc)."""
    return _Attention.apply(q, k, v, sinks, forward, backward, args)
