"""Log-sum-exp merge of partial attention outputs.

Two attentions of the same queries over disjoint key sets, ``(o1, lse1)`` and ``(o2, lse2)``,
combine into the attention over the union:

    out = o1 + sigmoid(lse2 - lse1) * (o2 - o1)     (torch.lerp: one kernel)
    lse = logaddexp(lse1, lse2) = lse1 - logsigmoid(lse1 - lse2)

Neither form exponentiates a large number, so both are stable for any lse gap (the forms of
ring-flash-attn and Transformer Engine). ``logaddexp`` also takes an empty accumulator
(``lse1 = -inf``, ``o1 = 0``), which the first merge replaces exactly. Accumulators are float32
(float64 for float64 inputs): merging in bf16 would lose digits at every step.
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_attn_out_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge ``(block_out (B,H,S,D), block_lse (B,H,S))`` into the accumulators, in place.

    ``out`` (B,H,S,D) and ``lse`` (B,H,S) are in :func:`acc_dtype` and may be views (row slices)
    of larger accumulators. Not differentiable: called inside autograd.Function forwards. Four
    elementwise kernels (subtract, sigmoid, lerp, logaddexp), five when ``block_out`` needs a cast
    to the accumulator dtype: small shards on CUDA are bound by kernel launches.
    """
    weight = torch.sub(block_lse, lse).sigmoid_().unsqueeze(-1)
    out.lerp_(block_out.to(out.dtype), weight)  # out + weight * (block_out - out), one kernel
    torch.logaddexp(lse, block_lse, out=lse)
