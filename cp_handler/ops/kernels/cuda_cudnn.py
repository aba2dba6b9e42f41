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
import os

import torch

from .base import AttnKernel, expand_kv, reduce_kv_grad, seq_major

aten = torch.ops.aten


@functools.cache
def lse_is_4d() -> bool:
    """Whether the cuDNN forward returns lse with a trailing unit dim (from its meta kernel)."""
    q = torch.empty(1, 1, 1, 8, device="meta", dtype=torch.bfloat16)
    return aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)[1].dim() == 4


RAGGED_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
"""torch's flag (read once per process, before the first cuDNN call; experimental, global to the process): dense
cuDNN attention on BSHD memory builds one graph per power-of-two bucket of lengths instead of one per shape."""


def _bshd_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """K or V with q's head count as a ``(B, H, S, D)`` view of BSHD memory (the memory the ragged path needs;
    ``expand_kv`` gives BHSD memory, which silently takes the per-shape path)."""
    groups = q.shape[1] // kv.shape[1]
    bshd = kv.transpose(1, 2)
    return (bshd.repeat_interleave(groups, dim=2) if groups > 1 else bshd.contiguous()).transpose(1, 2)


def _stats(lse: torch.Tensor, ragged: bool) -> torch.Tensor:
    """The backward's ``logsumexp`` ``(B, H, S[, 1])``: contiguous for the per-shape graphs (as verified), a view
    of ``(B, S, H)`` memory for the ragged path, the layout its forward returns. The backward graph takes its
    stride from this tensor while the cache key does not: a graph built for one length and reused for another
    of its bucket would read rows of the wrong stride from a contiguous lse (head stride S)."""
    stats = lse.transpose(1, 2).contiguous().transpose(1, 2) if ragged else lse.contiguous()
    return stats.unsqueeze(-1) if lse_is_4d() else stats


def _forward(q, k, v, causal: bool, scale: float, expand):
    out, lse = aten._scaled_dot_product_cudnn_attention(q, expand(q, k), expand(q, v), None, True, 0.0, causal,
                                                        False, scale=scale)[:2]
    return out, lse.reshape(lse.shape[:3])


def _backward(dout, q, k, v, out, lse, causal: bool, scale: float, expand, layout, ragged: bool):
    kv_heads = k.shape[1]
    k, v = expand(q, k), expand(q, v)
    no_dropout = torch.zeros((), device=q.device, dtype=torch.int64)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        grad_out=layout(dout), query=layout(q), key=layout(k), value=layout(v), out=layout(out),
        logsumexp=_stats(lse, ragged), philox_seed=no_dropout, philox_offset=no_dropout, attn_bias=None,
        cum_seq_q=None, cum_seq_k=None,
        max_q=q.shape[-2], max_k=k.shape[-2], dropout_p=0.0, is_causal=causal, scale=scale,
    )
    return dq, reduce_kv_grad(dk, kv_heads), reduce_kv_grad(dv, kv_heads)


def forward(q, k, v, *, causal: bool, scale: float):
    return _forward(q, k, v, causal, scale, expand_kv)


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    return _backward(dout, q, k, v, out, lse, causal, scale, expand_kv, torch.Tensor.contiguous, False)


def ragged_forward(q, k, v, *, causal: bool, scale: float):
    return _forward(seq_major(q), k, v, causal, scale, _bshd_kv)


def ragged_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    return _backward(dout, q, k, v, out, lse, causal, scale, _bshd_kv, seq_major, True)


def ragged_needs(q: torch.Tensor) -> str | None:
    """The ragged path needs torch's flag set before the first cuDNN call of the process, and torch >= 2.11."""
    if os.environ.get(RAGGED_ENV) != "1":
        return f"it needs {RAGGED_ENV}=1 in the environment before the first cuDNN call of the process"
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 11):
        return f"{RAGGED_ENV} needs torch >= 2.11, this is {torch.__version__}"
    return None


KERNEL = AttnKernel("cudnn", "cuda", (torch.float16, torch.bfloat16), forward, backward, verified_on=None,
                    shape_specialized=True, max_head_dim=128,
                    head_dim_multiple=((torch.float16, 8), (torch.bfloat16, 8)))
RAGGED_KERNEL = AttnKernel("cudnn_ragged", "cuda", (torch.float16, torch.bfloat16), ragged_forward, ragged_backward,
                           verified_on=None, requirement=ragged_needs, max_head_dim=128,
                           head_dim_multiple=((torch.float16, 8), (torch.bfloat16, 8)))
"""cuDNN with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``: q, k, v, out and dout passed in BSHD memory (the ragged
path's condition), a graph per power-of-two bucket of lengths, so it is not ``shape_specialized``. Opt-in until
a GPU run shows two lengths of one bucket exact in one process (scripts/gpu_check.py)."""
