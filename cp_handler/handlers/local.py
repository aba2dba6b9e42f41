"""Pure-torch context-parallel handler (CPU and CUDA): zigzag layout, attention algorithms in ops/."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.ring import ring_attn
from .base import ATTN_MASK_TYPES
from .zigzag import ZigzagContextParallelHandler

ATTN_ALGORITHMS = {"p2p": ring_attn}
"""``cp_comm_type`` -> differentiable attention ``f(q, k, v, *, group, causal, scale) -> (out, lse)``
on ``(B, H, S_local, D)`` tensors."""


def to_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View ``t`` (bshd or sbhd) as ``(B, H, S, D)``."""
    if qkv_format == "bshd":
        return t.transpose(1, 2)
    if qkv_format == "sbhd":
        return t.permute(1, 2, 0, 3)
    raise ValueError(f"qkv_format={qkv_format!r} is not supported by this attention path (bshd, sbhd)")


def from_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Inverse of :func:`to_bhsd`."""
    return t.transpose(1, 2) if qkv_format == "bshd" else t.permute(2, 0, 1, 3)


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """GQA rule: ``k`` and ``v`` share a shape and the query heads are a multiple of the KV heads.

    Raises:
        ValueError: naming the shapes.
    """
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]} (GQA)")


class LocalContextParallelHandler(ZigzagContextParallelHandler):
    """Pure-torch CP handler.

    ``core_attn`` takes q ``(B, S_local, H, D)`` (bshd) or ``(S_local, B, H, D)`` (sbhd) and k, v
    with ``Hkv`` heads (``H % Hkv == 0``), in any float dtype, and returns the attention output
    shaped like q. At cp=1 it is ``F.scaled_dot_product_attention``.
    """

    supported_comm_types = tuple(ATTN_ALGORITHMS)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        types = [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else self.cp_comm_type
        for comm_type in types:
            if comm_type not in self.supported_comm_types:
                raise ValueError(
                    f"{type(self).__name__} does not implement cp_comm_type={comm_type!r}; "
                    f"it supports {self.supported_comm_types}"
                )

    def core_attn(self, attn_mod, q, k, v, *, attn_mask_type: str = "causal") -> torch.Tensor:
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {ATTN_MASK_TYPES}")
        scale = getattr(attn_mod, "softmax_scale", None) or q.shape[-1] ** -0.5
        causal = attn_mask_type == "causal"
        q_, k_, v_ = (to_bhsd(t, self.qkv_format) for t in (q, k, v))
        check_heads(q_, k_, v_)
        if self.cp_size == 1:
            out = F.scaled_dot_product_attention(
                q_, k_, v_, is_causal=causal, scale=scale, enable_gqa=q_.shape[1] != k_.shape[1]
            )
        else:
            algorithm = ATTN_ALGORITHMS[self.comm_type_for(attn_mod)]
            out = algorithm(q_, k_, v_, group=self.cp_group, causal=causal, scale=scale)[0]
        return from_bhsd(out, self.qkv_format)
