"""CUDA memory-efficient attention: ``aten._scaled_dot_product_efficient_attention`` and its backward
(fp32 here; also fp16/bf16). Its lse is padded to a multiple of 32 rows: cut after the forward,
padded again for the backward. No attention bias; dropout 0, so the philox arguments are never
read (empty int64 tensors stand for them). GQA by expanding K/V."""

from __future__ import annotations

import torch

from .base import AttnKernel, expand_kv, reduce_kv_grad

aten = torch.ops.aten


def forward(q, k, v, *, causal: bool, scale: float):
    k, v = expand_kv(q, k), expand_kv(q, v)
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[-2]]


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    kv_heads = k.shape[1]
    k, v = expand_kv(q, k), expand_kv(q, v)
    lse_padded = torch.nn.functional.pad(lse, (0, (-lse.shape[-1]) % 32)).contiguous()
    no_dropout = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse_padded, no_dropout, no_dropout, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)


KERNEL = AttnKernel(
    "efficient", "cuda", (torch.float32, torch.float16, torch.bfloat16), forward, backward,
    verified_on="H100, torch 2.11.0+cu130, 2026-11-22 (issue 13): fp32 within 5e-7 of a float64 reference",
)
