"""Packed (varlen) kernels: many blocks in one call, as FlashAttention-2's varlen API takes them.

A packed kernel attends segment ``i`` of the packed queries (rows ``cu_q[i]:cu_q[i+1]``) to segment
``i`` of the packed keys, all with one mask flag, in one launch: a ring step of a pack of hundreds
of documents is one or two calls instead of hundreds (measured on an H100: docs/performance.md).
Causal segments are square here (top-left and bottom-right alignment coincide).

Shapes: ``q (Tq, H, D)``, ``k, v (Tk, Hkv, D)`` (GQA native), ``cu_q, cu_k`` int32
``[segments + 1]`` on q's device, ``lse (H, Tq)`` float32.

* ``flash_varlen`` (CUDA, fp16/bf16): ``aten._flash_attention_forward`` / ``_backward`` with
  ``cum_seq_q/k``, the backward given the merged out/lse; the rng tensors are the forward's
  outputs for dropout 0, rebuilt with the shapes and dtypes of the op's meta kernel. Automatic in the
  dtypes a GPU run verified (:attr:`~.base.AttnKernel.verified_dtypes`), opt-in in the others.
* ``cpu_varlen`` (CPU): the same packed interface computed segment by segment with the CPU flash
  kernel. It is the CPU reference of the batching (gathers, segment offsets, merges, scatters) that
  the CUDA kernel relies on; never chosen automatically (``cpu_flash`` is faster on CPU).
"""

from __future__ import annotations

import torch

from ..qkv_format import to_bhsd
from . import cpu_flash
from .base import H100_RUN, AttnKernel
from .cuda_flash import HEAD_DIMS
from .flash_window import rng_inputs

aten = torch.ops.aten


def flash_varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float):
    out, lse = aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool,
                          scale: float):
    rng_state, unused = rng_inputs(q.device)
    return aten._flash_attention_backward(
        grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse.contiguous(), cum_seq_q=cu_q, cum_seq_k=cu_k,
        max_q=max_q, max_k=max_k, dropout_p=0.0, is_causal=causal, rng_state=rng_state, unused=unused, scale=scale,
    )


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[slice, slice]]:
    """The ``(query rows, key rows)`` of every segment with queries (an empty one computes nothing, as in the
    CUDA varlen kernels)."""
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    return [(slice(qa, qb), slice(ka, kb)) for qa, qb, ka, kb in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1],
                                                                     k_bounds[1:], strict=True) if qb > qa]


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return to_bhsd(t, "thd")  # (T, H, D) -> (1, H, T, D)


def cpu_varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float):
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64 if q.dtype == torch.float64 else
                     torch.float32)
    for qs, ks in _segments(cu_q, cu_k):
        seg_out, seg_lse = cpu_flash.forward(_bhsd(q[qs]), _bhsd(k[ks]), _bhsd(v[ks]), causal=causal, scale=scale)
        out[qs], lse[:, qs] = seg_out[0].transpose(0, 1), seg_lse[0]
    return out, lse


def cpu_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool,
                        scale: float):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks in _segments(cu_q, cu_k):
        grads = cpu_flash.backward(_bhsd(dout[qs]), _bhsd(q[qs]), _bhsd(k[ks]), _bhsd(v[ks]), _bhsd(out[qs]),
                                   lse[:, qs].unsqueeze(0).contiguous(), causal=causal, scale=scale)
        for acc, rows, grad in ((dq, qs, grads[0]), (dk, ks, grads[1]), (dv, ks, grads[2])):
            acc[rows] += grad[0].transpose(0, 1)
    return dq, dk, dv


FLASH_VARLEN = AttnKernel("flash_varlen", "cuda", (torch.float16, torch.bfloat16), flash_varlen_forward,
                          flash_varlen_backward, packed=True, **HEAD_DIMS,
                          verified_on=f"{H100_RUN}: rank plans vs the flash blocks, every pattern bshd and thd in bf16",
                          verified_dtypes=(torch.bfloat16,))
CPU_VARLEN = AttnKernel("cpu_varlen", "cpu", (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                        cpu_varlen_forward, cpu_varlen_backward, verified_on="CPU (tests/test_varlen.py)",
                        packed=True, distinct_v_head_dim=True)
