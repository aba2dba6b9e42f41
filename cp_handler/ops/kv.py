"""K and V as one tensor while they travel (the ring, the all-gather, the halo exchange) and while their
gradients accumulate: one message per transfer instead of two.

With one head dim for q, k and v the pair is stacked, ``(2, B, Hkv, S, D)`` (k and v each contiguous, as the
kernels read them best). With multi-head latent attention (MLA: the value head dim ``Dv`` differs from the
query / key head dim ``Dqk``, DeepSeek-V2/V3) they are concatenated along the head dim, ``(B, Hkv, S, Dqk +
Dv)``: each travels with its own width, and :func:`unpack_kv` gives views of both. The sequence and head dims
of a packed pair are :func:`kv_seq_dim` and :func:`kv_head_dim`.
"""

from __future__ import annotations

import torch


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k (B, Hkv, S, Dqk)`` and ``v (B, Hkv, S, Dv)`` as one tensor (see the module doc)."""
    return torch.stack([k, v]) if k.shape == v.shape else torch.cat([k, v], dim=-1)


def unpack_kv(kv: torch.Tensor, qk_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(k, v)`` of a packed pair; ``qk_head_dim``: the keys' head dim."""
    if kv.dim() == 5:
        return kv[0], kv[1]
    return kv[..., :qk_head_dim], kv[..., qk_head_dim:]


def kv_seq_dim(kv: torch.Tensor) -> int:
    """The sequence dim of a packed pair (3 stacked, 2 concatenated)."""
    return 3 if kv.dim() == 5 else 2


def kv_head_dim(kv: torch.Tensor) -> int:
    """The KV-heads dim of a packed pair (2 stacked, 1 concatenated)."""
    return 2 if kv.dim() == 5 else 1


def kv_heads(kv: torch.Tensor, heads: slice) -> torch.Tensor:
    """The KV heads ``heads`` of a packed pair (a view)."""
    return kv[:, :, heads] if kv.dim() == 5 else kv[:, heads]
