"""Block attention that returns the log-sum-exp, and its backward, per device.

All tensors are ``(B, H, S, D)`` (heads before sequence, as the aten ops take them).
``lse`` is ``(B, H, Sq)`` in float32 (float64 for float64 inputs), natural log.

Backends:
  * CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); GQA native
    (k/v may have fewer heads than q; dk/dv come back with the KV head count).
  * CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 and
    ``aten._scaled_dot_product_efficient_attention`` otherwise; GQA by expanding k/v locally
    (after communication, so nothing extra goes over the wire) and summing dk/dv back.

The backward takes the *merged* (whole-sequence) ``out`` and ``lse``: with them, the flash
backward of one block gives exactly that block's share of dq, dk, dv (FlashAttention-2, Dao 2023).
Zero-length blocks are never passed to the ops (the CPU op crashes on them): callers skip them.

:func:`count_attn_work` counts the (query, key) score pairs the forward blocks compute on this
rank (the benchmark's load-balance figure), as :func:`~.collectives.count_comms` counts bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

aten = torch.ops.aten


@dataclass
class WorkCounter:
    """Attention score pairs computed by forward blocks on this rank (causal blocks count the
    lower triangle with its diagonal), summed over batch and query heads."""

    pairs: int = 0
    blocks: int = 0


_work_counters: list[WorkCounter] = []


@contextlib.contextmanager
def count_attn_work():
    """Count the attention work of the forward blocks run inside the block (this rank only)."""
    counter = WorkCounter()
    _work_counters.append(counter)
    try:
        yield counter
    finally:
        _work_counters.remove(counter)


def record_attn_work(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """Record one forward block of ``q (B, H, Sq, D)`` against ``k (B, Hkv, Sk, D)``."""
    if not _work_counters:
        return
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    pairs = b * h * (sq * (sq + 1) // 2 if causal else sq * sk)
    for counter in _work_counters:
        counter.pairs += pairs
        counter.blocks += 1


def _check_nonempty(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"block attention got a zero-length block: q {tuple(q.shape)}, k {tuple(k.shape)}")


def _expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    if grad.shape[1] == kv_heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _cuda_uses_flash(q: torch.Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


def block_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one (q block, kv block) pair: returns ``(out (B,H,Sq,D), lse (B,H,Sq))``.

    ``causal`` is top-left aligned and only used with ``Sq == Sk``.
    """
    _check_nonempty(q, k)
    record_attn_work(q, k, causal)
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    if _cuda_uses_flash(q):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[-2]]


def block_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block, given the merged ``out`` and ``lse`` of q's rows."""
    _check_nonempty(q, k)
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    kv_heads = k.shape[1]
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    if _cuda_uses_flash(q):
        sq, sk = q.shape[-2], k.shape[-2]
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), empty, empty, sq, sk, 0.0, causal, empty, empty, scale=scale
        )
    else:
        pad = (-lse.shape[-1]) % 32
        lse_padded = torch.nn.functional.pad(lse, (0, pad)).contiguous()
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse_padded, empty, empty, 0.0, [True, True, True, False], causal, scale=scale
        )
    return dq, _reduce_kv_grad(dk, kv_heads), _reduce_kv_grad(dv, kv_heads)
