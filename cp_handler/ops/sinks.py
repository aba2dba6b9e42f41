"""Learnable attention sinks (GPT-OSS): one logit per query head added to the softmax denominator.

``softmax([s_1..s_n, sink])`` restricted to the real keys, i.e. attention to an extra key whose score is
the head's ``sink`` and whose value is zero. Under CP the sink is folded in once, after the merge of
all blocks (it is not a key of any block): with the merged ``(O, lse)`` of a row,

    L = logaddexp(lse, sink),    O_sink = O * exp(lse - L).

The backward of every block then runs unchanged with ``(O_sink, L)`` in place of ``(O, lse)`` (the
probabilities ``exp(s - L)`` are the true ones, and ``rowsum(dO * O_sink)`` is the softmax's
correction term since the sink's value is zero), and the sink's gradient is
``d sink = -sum_rows exp(sink - L) * rowsum(dO * O_sink)``, summed over this rank's rows: like every
parameter gradient under CP it is completed by the gradient all-reduce over the CP (and data) group.
Padding rows (``lse = -inf``, ``O = 0``) contribute nothing.
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, heads: int, q: torch.Tensor) -> None:
    """Raises TypeError / ValueError unless ``sinks`` is ``None`` or a floating tensor of shape
    ``(heads,)`` on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating tensor of shape ({heads},) (one logit per query head), got "
                        f"{type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; it must be ({heads},): one logit per query head")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}")


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O_sink, L)`` from the merged ``out (B,H,S,D)``, ``lse (B,H,S)`` and ``sinks (H,)`` (not differentiable)."""
    sink = sinks.detach().to(lse.dtype)[None, :, None]
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype), total


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sinks (H,)`` in the sinks' dtype, given ``dout`` and the folded ``out (B,H,S,D)``, ``lse (B,H,S)``."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    weight = torch.exp(sinks.detach().to(lse.dtype)[None, :, None] - lse)
    return -(weight * delta).sum(dim=(0, 2)).to(sinks.dtype)
