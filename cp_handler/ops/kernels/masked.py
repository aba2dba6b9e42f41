"""The masked block kernel: one block under an :class:`~cp_handler.core.masks.AttentionMask` (window, chunk,
soft-cap), forward returning the log-sum-exp, backward given the merged out/lse, in plain torch.

The planners (:func:`cp_handler.core.masks.mask_blocks`) give it only what the fast kernels cannot run: the
bands along a window's left edge or a chunk boundary, and soft-capped blocks. It computes the block's
scores explicitly in the accumulation dtype (float32; float64 for float64 inputs), so it is exact to
that dtype on any device. The backward recomputes the scores (nothing is saved between the passes)
and uses the merged ``out``/``lse`` of the block's rows, as every kernel of :mod:`.base` does
(FlashAttention-2's backward): ``dS = P * (dO V^T - rowsum(dO * O))`` with ``P = exp(S - lse)``;
soft-capping multiplies ``dS`` by ``1 - tanh(s / cap)^2``.

Memory per block: a few ``(B, H, Sq, Sk)`` tensors in the accumulation dtype (scores, probabilities,
their gradient), with ``Sq <= 64`` and ``Sk <= 512`` for the tiles the planners make
(:data:`~cp_handler.core.masks.MASK_TILE`, :data:`~cp_handler.core.masks.MASK_KEY_TILE`): ``B * H * 128 KiB``
each in float32. GQA: K/V are expanded to the query heads inside the block, their gradients summed back.

Why ours: torch 2.13's FlexAttention has no CPU backward ("FlexAttention does not support backward on
CPU"), and the CUDA kernels take only causal / full blocks. On CUDA this kernel is plain torch math
(its GPU runs: docs/testing.md).
"""

from __future__ import annotations

import torch

from ...core.masks import BlockMask
from ..merge import acc_dtype
from .base import expand_kv, reduce_kv_grad


def visible_scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None, visible: torch.Tensor):
    """The one scoring function of explicit attention (this kernel, and a decode step: :mod:`cp_handler.inference`):
    ``q (B,H,Sq,D)`` against ``k (B,Hkv,Sk,D)`` (GQA: K expanded to the query heads) in the accumulation dtype,
    scaled, soft-capped (``softcap * tanh(s / softcap)``, Gemma 2) and ``-inf`` where ``visible`` (broadcast to
    ``(B, H, Sq, Sk)``) is False. Returns ``(scores, tanh of the scaled scores / softcap, or None)``."""
    dtype = acc_dtype(q.dtype)
    scores = torch.matmul(q.to(dtype), expand_kv(q, k).to(dtype).transpose(-1, -2)).mul_(scale)
    tanh = None
    if softcap is not None:
        tanh = scores.div_(softcap).tanh_()
        scores = tanh * softcap
    return scores.masked_fill(~visible, float("-inf")), tanh


def softmax_out(scores: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B,H,Sq,D), lse (B,H,Sq))`` of ``scores`` (:func:`visible_scores`) against ``v (B,Hkv,Sk,D)``. A row
    that sees no key gets ``out = 0`` and the dtype's lowest finite lse (so that merging two such rows stays
    finite: :func:`~..merge.merge_attn_out_`)."""
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = torch.matmul(probs, expand_kv(q, v).to(probs.dtype))
    return out, lse.masked_fill_(empty, torch.finfo(lse.dtype).min)


def _block_scores(q: torch.Tensor, k: torch.Tensor, block: BlockMask, scale: float):
    """:func:`visible_scores` of a planned block (its visibility from the positions of its rows and keys)."""
    return visible_scores(q, k, scale, block.mask.softcap, block.visible(q.shape[-2], k.shape[-2], q.device))


def masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: BlockMask, scale: float):
    """``q (B,H,Sq,D)``, ``k, v (B,Hkv,Sk,D)`` -> ``(out (B,H,Sq,D), lse (B,H,Sq))``, both in the
    accumulation dtype (:func:`softmax_out`)."""
    scores, _ = _block_scores(q, k, block, scale)
    return softmax_out(scores, q, v)  # its work is recorded by the plan (cp_handler.ops.blocks)


def masked_backward(dout, q, k, v, out, lse, block: BlockMask, scale: float):
    """Gradients ``(dq (B,H,Sq,D), dk, dv (B,Hkv,Sk,D))`` in the accumulation dtype of one block, given
    the merged ``out (B,H,Sq,D)`` and ``lse (B,H,Sq)`` of its rows (finite: every real query sees a key)."""
    dtype = acc_dtype(q.dtype)
    scores, tanh = _block_scores(q, k, block, scale)
    probs = torch.exp(scores - lse.to(dtype).unsqueeze(-1))
    dout = dout.to(dtype)
    v_full = expand_kv(q, v).to(dtype)
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    delta = (dout * out.to(dtype)).sum(-1, keepdim=True)
    dscores = probs.mul_(torch.matmul(dout, v_full.transpose(-1, -2)).sub_(delta))
    if tanh is not None:
        dscores.mul_(1 - tanh * tanh)
    dscores.mul_(scale)
    dq = torch.matmul(dscores, expand_kv(q, k).to(dtype))
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(dtype))
    return dq, reduce_kv_grad(dk, k.shape[1]), reduce_kv_grad(dv, k.shape[1])
