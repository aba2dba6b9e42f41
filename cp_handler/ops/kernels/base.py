"""What a block-attention kernel is: forward returning the log-sum-exp, backward given the merged out/lse.

All tensors are ``(B, H, S, D)`` (heads before sequence, as the aten SDPA ops take them); k/v may
have ``Hkv`` heads with ``H % Hkv == 0`` (GQA). ``lse`` is ``(B, H, Sq)`` in float32 (float64 for
float64 inputs), natural log. The backward takes the *merged* (whole-sequence) ``out`` and ``lse``
of q's rows: with them, the flash backward of one block gives exactly that block's share of dq,
dk, dv (FlashAttention-2, Dao 2023). dk/dv come back with ``Hkv`` heads. ``causal`` is top-left
aligned and only used with ``Sq == Sk``. Zero-length blocks are never passed (callers skip them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttnKernel:
    """One kernel family.

    Attributes:
        name: the name an override uses (argument ``attn_kernel`` or ``CP_HANDLER_ATTN_KERNEL``).
        device_type: ``"cpu"`` or ``"cuda"``.
        dtypes: input dtypes it runs.
        forward: ``(q, k, v, *, causal, scale) -> (out (B,H,Sq,D) in q's dtype, lse (B,H,Sq))``.
        backward: ``(dout, q, k, v, out, lse, *, causal, scale) -> (dq, dk, dv)``.
        verified_on: where a GPU run checked it against a float64 reference (device, torch,
            result), or ``None``: an unverified CUDA kernel is never chosen automatically.
        max_head_dim: largest head dim it runs (``None``: any).
        packed: forward/backward take packed segments instead of one block (:mod:`.varlen`):
            ``(q (Tq,H,D), k, v (Tk,Hkv,D), cu_q, cu_k, max_q, max_k, *, causal, scale)``, lse ``(H, Tq)``.
    """

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    forward: Forward
    backward: Backward
    verified_on: str | None
    max_head_dim: int | None = None
    packed: bool = False

    def cannot_run(self, q: torch.Tensor) -> str | None:
        """Why this kernel cannot take ``q``, or ``None`` if it can."""
        if q.device.type != self.device_type:
            return f"it runs on {self.device_type}, q is on {q.device.type}"
        if q.dtype not in self.dtypes:
            return f"it takes {[str(d) for d in self.dtypes]}, q is {q.dtype}"
        if self.max_head_dim is not None and q.shape[-1] > self.max_head_dim:
            return f"it takes head dims <= {self.max_head_dim}, q has {q.shape[-1]}"
        return None


def expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """K or V with as many heads as q (GQA groups repeated), for kernels without native GQA."""
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def reduce_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of expanded K or V back to ``kv_heads`` heads (adjoint of :func:`expand_kv`)."""
    if grad.shape[1] == kv_heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)
