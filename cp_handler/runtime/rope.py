"""Rotary position embedding (RoPE; Su et al., 2021), "rotate half" form as in Llama / HF transformers.

The rotary table holds angles ``theta_i * position`` as ``(S, D)`` float32 rows (the ``D/2``
frequencies written twice, ``cat(f, f)``), so a row can be picked per token: a CP handler picks
the rows of the global positions of its local tokens (``get_emb_on_this_cp_rank``).
"""

from __future__ import annotations

import torch

from .config import QKV_FORMATS


def rotary_freqs(seq_len: int, dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """Angles for positions ``0..seq_len-1``: float32 ``(seq_len, dim)``; ``dim`` must be even.

    Raises:
        ValueError: odd ``dim``.
    """
    if dim % 2:
        raise ValueError(f"rotary dim={dim} must be even")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Rotate ``t`` by per-token angles.

    Args:
        t: ``(B, S, H, D)`` for bshd, ``(S, B, H, D)`` for sbhd, ``(T, H, D)`` or ``(1, T, H, D)`` for thd
            (the angles broadcast over the leading 1).
        freqs: float32 ``(S, D)`` (``(T, D)`` for thd), one row per token of ``t``.
        qkv_format: ``"bshd"``, ``"sbhd"`` or ``"thd"``.

    Returns:
        Tensor like ``t`` (same dtype); the math runs in float32.
    """
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r} is not one of {QKV_FORMATS}")
    angles = {"bshd": freqs[None, :, None, :], "sbhd": freqs[:, None, None, :], "thd": freqs[:, None, :]}[qkv_format]
    t32 = t.float()
    x1, x2 = t32.chunk(2, dim=-1)  # rotate half, inline (called twice per layer)
    return (t32 * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()).to(t.dtype)


class PositionTablesChanged(RuntimeError):
    """A decode step's position tables (RoPE) differ from the prefill's at the same position: the model's
    rotary frequencies depend on the sequence length (dynamic NTK, LongRoPE past its original length), so
    the cached keys, rotated at the prefill's length, are no longer what the whole sequence would give.
    Raised on every rank alike, before the step's first collective; :func:`~cp_handler.inference.generate` catches
    it and prefills the whole sequence so far again."""
