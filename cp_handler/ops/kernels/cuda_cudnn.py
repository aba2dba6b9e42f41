"""CUDA cuDNN attention: ``aten._scaled_dot_product_cudnn_attention`` and its backward (fp16/bf16).

The fastest single-GPU kernel on an H100 and the fastest block kernel of the ring plans there
(docs/performance.md has the measured efficiencies). Opt-in (``attn_kernel="cudnn"``), not automatic:
cuDNN builds a graph per ``(Sq, Sk)`` in every process, 0.1-1.5 s each on an H100, so any run with many
block shapes pays seconds per new shape. Never for packed documents (thd), where every document pair
is a new shape (``shape_specialized``: refused there). GPU runs: docs/testing.md.

The forward returns lse as ``(B, H, Sq, 1)`` on some torch versions and ``(B, H, Sq)`` on others;
the backward wants the forward's layout, which is read off the op's meta kernel (same shapes as
the device kernel, no GPU needed). Dense call: ``cum_seq_q`` / ``cum_seq_k`` undefined, no bias,
dropout 0 (the philox tensors are not read). GQA by expanding K/V. Head dims: multiples of 8, at
most 128, torch's rule for cuDNN attention (``check_cudnn_tensor_shapes``; 256 only on sm90 with
cuDNN >= 9.10, not taken here). The backward copies dout/q/k/v/out contiguous per block: kept as it
is until a GPU run shows which layouts cuDNN takes without them (docs/performance.md, pending).
"""

from __future__ import annotations

import functools

import torch

from .base import AttnKernel, expand_kv, reduce_kv_grad

aten = torch.ops.aten


@functools.cache
def lse_is_4d() -> bool:
    """Whether the cuDNN forward returns lse with a trailing unit dim (from its meta kernel)."""
    q = torch.empty(1, 1, 1, 8, device="meta", dtype=torch.bfloat16)
    return aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)[1].dim() == 4


def forward(q, k, v, *, causal: bool, scale: float):
    k, v = expand_kv(q, k), expand_kv(q, v)
    out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(lse.shape[:3])


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    kv_heads = k.shape[1]
    k, v = expand_kv(q, k), expand_kv(q, v)
    lse = lse.contiguous().unsqueeze(-1) if lse_is_4d() else lse.contiguous()
    no_dropout = torch.zeros((), device=q.device, dtype=torch.int64)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        grad_out=dout.contiguous(), query=q.contiguous(), key=k.contiguous(), value=v.contiguous(),
        out=out.contiguous(), logsumexp=lse, philox_seed=no_dropout, philox_offset=no_dropout, attn_bias=None,
        cum_seq_q=None, cum_seq_k=None, max_q=q.shape[-2], max_k=k.shape[-2], dropout_p=0.0, is_causal=causal,
        scale=scale,
    )
    return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)


KERNEL = AttnKernel("cudnn", "cuda", (torch.float16, torch.bfloat16), forward, backward, verified_on=None,
                    shape_specialized=True, max_head_dim=128,
                    head_dim_multiple=((torch.float16, 8), (torch.bfloat16, 8)))
