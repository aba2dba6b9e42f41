"""MagiAttention's handler at cp=1: what it runs without MagiAttention (one rank needs no dispatch plan): per-document
attention with the local blockwise kernels, positions restarting per document, and the roll inside each
document (a bshd batch ``(B, S, ...)`` is ``B`` documents of ``S`` tokens)."""

from __future__ import annotations

import torch

from ..core.layout import ZigzagDocs
from ..ops.qkv_format import from_bhsd, to_bhsd
from ..ops.ring import ring_attn
from ..ops.roll import zigzag_roll


def _layout(handler) -> ZigzagDocs:
    return ZigzagDocs.from_cu_seqlens(handler.cu_seqlens, 1)


def alone_positions(handler) -> torch.Tensor:
    return _layout(handler).positions(0)


def alone_attn(handler, q, k, v, scale, shape) -> torch.Tensor:
    """cp=1: per-document attention with the local blockwise kernels (no MagiAttention needed);
    a bshd batch ``(B, S, H, D)`` is ``B`` documents of ``S`` tokens."""
    if handler.qkv_format == "thd":
        layout = _layout(handler)
    else:
        layout = ZigzagDocs.from_lengths([shape[1]] * shape[0], 1)
    bhsd = [to_bhsd(x, "thd") for x in (q, k, v)]
    out = ring_attn(*bhsd, group=None, causal=handler.causal, scale=scale, layout=layout)[0]
    return from_bhsd(out, "thd", q)


def alone_roll(handler, tensor, shifts, dims):
    layout = _layout(handler) if handler.qkv_format == "thd" else ZigzagDocs.uniform(tensor.shape[dims], 1)
    rolled = zigzag_roll(tensor, shifts, dims, None, layout)
    return rolled, rolled.sum()
