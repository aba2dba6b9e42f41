"""CUDA FlashAttention-2: ``aten._scaled_dot_product_flash_attention`` and its backward (fp16/bf16).

Every argument of the backward is named as in the op's schema and takes the value the forward op
returns for a dense (non-varlen) call: ``cum_seq_q`` / ``cum_seq_k`` undefined (``None``; a defined
tensor there selects the varlen path, which wants int32 offsets, and crashes in bf16),
``max_q`` / ``max_k`` the block lengths. The philox state is read only when ``dropout_p > 0``;
dropout is always 0 here, so an empty int64 tensor stands for it. The op transposes ``grad_out``
and ``out`` to ``(B, S, H, D)`` and makes them contiguous: they are passed sequence-major
(:func:`~.base.seq_major`), so that is no copy for a plan's accumulators (batch 1) and an explicit,
counted one otherwise.

GQA, two kernels:

* ``flash``: K/V expanded to q's heads after communication (nothing extra on the wire), dk/dv
  summed back: two copies in forward, two copies and two sums in backward per block.
* ``flash_gqa``: K/V passed with their own ``Hkv`` heads. FlashAttention-2 handles ``H % Hkv == 0``
  itself and returns dk/dv with ``Hkv`` heads; this is the path PyTorch's SDPA takes for
  ``enable_gqa=True`` (its docs: GQA "works only for Flash_attention and math kernel on CUDA"), and
  the op's meta kernel gives these shapes. No K/V copies and fewer kernel launches per rank-step
  (``cp-bench --modes launches``; figures in docs/performance.md). GPU runs: :attr:`~.base.AttnKernel.verified_on`.
"""

from __future__ import annotations

import functools

import torch

from . import flash_window
from .base import H100_RUN, AttnKernel, expand_kv, reduce_kv_grad, seq_major

aten = torch.ops.aten


def forward(q, k, v, *, causal: bool, scale: float, native_gqa: bool = False):
    if not native_gqa:
        k, v = expand_kv(q, k), expand_kv(q, v)
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, native_gqa: bool = False):
    kv_heads = k.shape[1]
    if not native_gqa:
        k, v = expand_kv(q, k), expand_kv(q, v)
    no_dropout = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        grad_out=seq_major(dout), query=q, key=k, value=v, out=seq_major(out), logsumexp=lse.contiguous(),
        cum_seq_q=None, cum_seq_k=None, max_q=q.shape[-2], max_k=k.shape[-2], dropout_p=0.0,
        is_causal=causal, philox_seed=no_dropout, philox_offset=no_dropout, scale=scale,
    )
    return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)


HEAD_DIMS = {"max_head_dim": 256, "head_dim_multiple": ((torch.float16, 8), (torch.bfloat16, 8))}
"""FlashAttention-2's head dims: at most 256, multiples of 8 (``head_size_og % 8 == 0`` in flash_api.cpp)."""
WINDOWS = {"masks": flash_window.MASKS, "masked_forward": flash_window.masked_forward,
           "masked_backward": flash_window.masked_backward}
"""Masked blocks as FlashAttention-2's windows (:mod:`.flash_window`): declared, not yet verified on a GPU."""

KERNEL = AttnKernel(
    "flash", "cuda", (torch.float16, torch.bfloat16), forward, backward, **HEAD_DIMS, **WINDOWS,
    verified_on="H100, torch 2.11.0+cu130, 2026-11-22: this call (undefined cum_seq_q/k) within "
                "2-3e-3 (bf16) / 3e-4 (fp16) relative error of a float64 reference; "
                f"{H100_RUN}: every pattern, thd, layout ops, the GPT step and the masks in fp16/bf16",
)
GQA_KERNEL = AttnKernel(
    "flash_gqa", "cuda", (torch.float16, torch.bfloat16), functools.partial(forward, native_gqa=True),
    functools.partial(backward, native_gqa=True), **HEAD_DIMS, **WINDOWS,
    verified_on=f"{H100_RUN}: fp16/bf16 vs float64, every pattern bshd and thd in bf16",
)
