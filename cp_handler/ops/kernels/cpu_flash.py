"""CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA native: k/v keep
their head count, dk/dv come back with it). Any float dtype.

Multi-head latent attention (a value head dim ``Dv`` other than the query / key head dim ``Dqk``): the op takes
one head dim, so the narrower side is padded with zero columns to the wider one (V and the output's
gradient, or q and k), which is exact: the scale is passed explicitly, zero q / k columns add nothing to a
score, zero V columns give zero output columns (sliced off) and zero gradients. A kernel of its own would
avoid the padded work; the CPU path is the reference, so exactness is what counts here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttnKernel

aten = torch.ops.aten


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def forward(q, k, v, *, causal: bool, scale: float):
    if q.shape[-1] == v.shape[-1]:  # the common case, without padding calls (the hot path)
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    width = max(q.shape[-1], v.shape[-1])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(_widen(q, width), _widen(k, width), _widen(v, width),
                                                              0.0, causal, scale=scale)[:2]
    return out[..., :v.shape[-1]], lse


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    if q.shape[-1] == v.shape[-1]:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                        scale=scale)
    width = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _widen(dout, width), _widen(q, width), _widen(k, width), _widen(v, width), _widen(out, width), lse, 0.0,
        causal, scale=scale)
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


KERNEL = AttnKernel("cpu_flash", "cpu", (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                    forward, backward, verified_on="CPU (the whole test suite)", distinct_v_head_dim=True)
