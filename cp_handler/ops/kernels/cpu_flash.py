"""CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA native: k/v keep
their head count, dk/dv come back with it). Any float dtype.

Multi-head latent attention (a value head dim ``Dv`` other than the query / key head dim ``Dqk``): the op takes
one head dim, so the narrower side is padded with zero columns to the wider one (V and the output's
gradient, or q and k), which is exact: the scale is passed explicitly, zero q / k columns add nothing to a
score, zero V columns give zero output columns (sliced off) and zero gradients. A kernel of its own would
avoid the padded work; the CPU path is the reference, so exactness is what counts here.

Masked blocks (windows, two-sided windows, the causal edge at any offset, chunk boundaries): the same op with an
additive ``attn_mask`` of ``0`` / ``-inf`` from the block's visibility
(:meth:`~cp_handler.core.masks.BlockMask.visible`, ``(Sq, Sk)`` in q's dtype, cached per block geometry), so they
run in the flash kernel instead of explicit float32 scores. A row that sees no key of the block comes back from the op
with ``out = 0`` and ``lse = 0``; its lse is set to the lowest finite value (the contract of :mod:`.base`).
Soft-capped scores are not an additive mask: they stay on the explicit
scores of :mod:`.masked` (torch 2.13's FlexAttention has no CPU backward).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...core.masks import BlockMask
from .base import AttnKernel

aten = torch.ops.aten


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def forward(q, k, v, *, causal: bool, scale: float, attn_mask: torch.Tensor | None = None):
    if q.shape[-1] == v.shape[-1]:  # the common case, without padding calls (the hot path)
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=attn_mask,
                                                              scale=scale)[:2]
    width = max(q.shape[-1], v.shape[-1])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(_widen(q, width), _widen(k, width), _widen(v, width),
                                                              0.0, causal, attn_mask=attn_mask, scale=scale)[:2]
    return out[..., :v.shape[-1]], lse


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, attn_mask: torch.Tensor | None = None):
    if q.shape[-1] == v.shape[-1]:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                        attn_mask=attn_mask, scale=scale)
    width = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _widen(dout, width), _widen(q, width), _widen(k, width), _widen(v, width), _widen(out, width), lse, 0.0,
        causal, attn_mask=attn_mask, scale=scale)
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


@functools.lru_cache(maxsize=64)
def _bias(mask, q_pos: int, k_pos: int, nq: int, nk: int, dtype: torch.dtype, device: torch.device):
    visible = BlockMask(mask, q_pos, k_pos).visible(nq, nk)
    bias = torch.zeros(nq, nk, dtype=dtype).masked_fill_(~visible, float("-inf")).to(device)
    empty = ~visible.any(-1)
    return bias, empty.to(device) if bool(empty.any()) else None


def block_bias(block: BlockMask, nq: int, nk: int, dtype: torch.dtype, device: torch.device):
    """``(bias (nq, nk) of 0 / -inf in dtype, rows that see no key (nq,) bool or None)`` of a masked block; cached
    per geometry (without chunks the visibility depends on the positions' difference only)."""
    mask = block.mask
    if mask.chunk is None:
        return _bias(mask, block.q_pos - block.k_pos, 0, nq, nk, dtype, device)
    return _bias(mask, block.q_pos, block.k_pos, nq, nk, dtype, device)


def masked_forward(q, k, v, block: BlockMask, *, scale: float):
    bias, empty = block_bias(block, q.shape[-2], k.shape[-2], q.dtype, q.device)
    out, lse = forward(q, k, v, causal=False, scale=scale, attn_mask=bias)
    return out, lse if empty is None else lse.masked_fill(empty, torch.finfo(lse.dtype).min)


def masked_backward(dout, q, k, v, out, lse, block: BlockMask, *, scale: float):
    bias, _ = block_bias(block, q.shape[-2], k.shape[-2], q.dtype, q.device)
    return backward(dout, q, k, v, out, lse, causal=False, scale=scale, attn_mask=bias)


MASKS = frozenset({"causal", "window", "window_right", "chunk"})
"""What an additive mask computes exactly: any visibility, no soft-cap."""

KERNEL = AttnKernel("cpu_flash", "cpu", (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                    forward, backward, verified_on="CPU (the whole test suite)", distinct_v_head_dim=True,
                    masks=MASKS, masked_forward=masked_forward, masked_backward=masked_backward, verified_masks=MASKS)
