"""The single-process references the conformance kit compares a handler with: float64, one document at a time.

Global tensors are packed ``(T, ...)`` rows, documents ``lengths`` one after another (bshd / sbhd: one document per
batch row, handled by the caller). Sources: attention is the softmax definition (Vaswani et al. 2017) with the
variants of :class:`~cp_handler.core.masks.AttentionMask` (sliding window, chunked attention, tanh soft-capping as
Gemma 2,
an extra per-head sink logit as gpt-oss); rotary embeddings as RoFormer (Su et al. 2021) at each token's position
inside its document; ``roll`` as Megatron-LM's ``roll_tensor`` (global token order, wrapped-around positions zero),
restarted per document for packed sequences.
"""

from __future__ import annotations

import functools

import torch

from ..core.masks import AttentionMask
from ..runtime.rope import apply_rotary


def positions(lengths: list[int]) -> torch.Tensor:
    """int64 ``(T,)``: each token's position inside its document."""
    return torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)


def attention(q, k, v, mask: AttentionMask, scale: float, sinks, lengths: list[int]) -> torch.Tensor:
    """Packed ``q (T, H, D)``, ``k (T, Hkv, D)``, ``v (T, Hkv, Dv)`` -> ``(T, H, Dv)``, each document alone;
    differentiable (call it on float64 leaves and backward for the reference gradients). A query row that sees no
    key (and no sink) attends to nothing: zero."""
    heads, kv_heads = q.shape[1], k.shape[1]
    outs, start = [], 0
    for n in lengths:
        if n == 0:
            continue
        qd, kd, vd = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        kd, vd = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (kd, vd))
        scores = (qd * scale) @ kd.transpose(-1, -2)
        if mask.softcap is not None:
            scores = mask.softcap * torch.tanh(scores / mask.softcap)
        hidden, blind_rows = _hidden(mask, n)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            probs = torch.cat([scores, sinks[:, None, None].expand(-1, n, 1)], dim=-1).softmax(-1)[..., :n]
        else:
            probs = scores.softmax(-1)
            if blind_rows:  # softmax over no key: NaN -> zero
                probs = probs.nan_to_num(0.0)
        outs.append((probs @ vd).transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, heads, v.shape[-1])


@functools.lru_cache(maxsize=64)
def _hidden(mask: AttentionMask, n: int) -> tuple[torch.Tensor, bool]:
    """The ``(n, n)`` pairs a document of ``n`` tokens hides under ``mask``, and whether some query row sees no key
    (kept across calls: the kit's references ask for a few masks and lengths many times)."""
    pos = torch.arange(n)
    hidden = ~mask.visible(pos[:, None], pos[None, :])
    return hidden, bool(hidden.all(-1).any())


def roll(x: torch.Tensor, shift: int, lengths: list[int]) -> torch.Tensor:
    """Packed ``x (T, ...)`` rolled by ``shift`` inside each document; positions that leave it are zero."""
    rows, start = [], 0
    for n in lengths:
        doc = x[start:start + n]
        rolled = torch.roll(doc, shift, 0) if n else doc
        keep = torch.arange(n) - shift
        valid = (keep >= 0) & (keep < n)
        rows.append(rolled * valid.view(-1, *([1] * (x.dim() - 1))).to(x.dtype))
        start += n
    return torch.cat(rows)


def rope(x: torch.Tensor, freqs: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Packed ``x (T, H, D)`` rotated at each token's position inside its document (``freqs (S, D)``)."""
    return apply_rotary(x, freqs[positions(lengths)], "thd")
