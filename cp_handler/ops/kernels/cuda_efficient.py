"""CUDA memory-efficient attention: ``aten._scaled_dot_product_efficient_attention`` and its backward
(fp32, fp16, bf16). Its lse is padded to a multiple of 32 rows: cut after the forward, padded again
for the backward. No attention bias; dropout 0, so the philox arguments are never read (empty int64
tensors stand for them). GQA by expanding K/V.

``out`` layout (a correctness rule, not a speed one): for fp16/bf16 the backward computes Delta = rowsum(dO *
O) inside the kernel and reads ``out`` with a fixed row stride of ``head_dim * num_heads`` (``o_strideM()`` in
torch's ``mem_eff_attention/kernel_backward.h``), taking only its batch and head strides from the tensor:
``out`` must be a ``(B, H, S, D)`` view of ``(B, S, H, D)``-contiguous memory of exactly its own heads. The
backward passes :func:`~.base.seq_major` of ``out``: no copy for the sequence-major accumulators of a plan,
one copy for a head slice (all_gather's KV-head chunks). GPU runs: :attr:`~.base.AttnKernel.verified_on`. Head
dims: multiples of 8 (fp16/bf16) or 4 (fp32), the rule torch's SDPA dispatcher applies to this kernel
(``check_head_dim_size_mem_efficient``, alignment of the tensor-core GEMMs)."""

from __future__ import annotations

import torch

from .base import H100_RUN, AttnKernel, expand_kv, reduce_kv_grad, seq_major

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
        dout, q, k, v, None, seq_major(out), lse_padded, no_dropout, no_dropout, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)


KERNEL = AttnKernel(
    "efficient", "cuda", (torch.float32, torch.float16, torch.bfloat16), forward, backward,
    verified_on="H100, torch 2.11.0+cu130, 2026-11-22: fp32 within 5e-7 of a float64 reference; "
                f"{H100_RUN}: fp16/bf16 with H > 1 and every out layout a plan passes vs float64",
    head_dim_multiple=((torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8)), distinct_v_head_dim=True,
)
