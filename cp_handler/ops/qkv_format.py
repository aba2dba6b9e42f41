"""Views between a handler's ``qkv_format`` and the ``(B, H, S, D)`` layout the block algorithms
and kernels take (heads before sequence, as the aten attention ops)."""

from __future__ import annotations

import torch


def to_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View ``t`` as ``(B, H, S, D)``: bshd, sbhd, or thd ``(T, H, D)`` / ``(1, T, H, D)`` as B=1."""
    if qkv_format == "bshd" or (qkv_format == "thd" and t.dim() == 4):
        return t.transpose(1, 2)
    if qkv_format == "sbhd":
        return t.permute(1, 2, 0, 3)
    return t.transpose(0, 1).unsqueeze(0)


def from_bhsd(t: torch.Tensor, qkv_format: str, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_bhsd` (``like``: the tensor given to it)."""
    if qkv_format == "bshd" or (qkv_format == "thd" and like.dim() == 4):
        return t.transpose(1, 2)
    if qkv_format == "sbhd":
        return t.permute(2, 0, 1, 3)
    return t.squeeze(0).transpose(0, 1)
