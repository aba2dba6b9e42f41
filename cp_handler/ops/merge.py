"""Log-sum-exp merge of partial attention outputs.

Two attentions of the same queries over disjoint key sets, ``(o1, lse1)`` and ``(o2, lse2)``,
combine into the attention over the union:

    out = o1 + sigmoid(lse2 - lse1) * (o2 - o1)     (torch.lerp: one kernel)
    lse = logaddexp(lse1, lse2) = lse1 - logsigmoid(lse1 - lse2)

Neither form exponentiates a large number, so both are stable for any lse gap (the forms of
ring-flash-attn and Transformer Engine). ``logaddexp`` also takes an empty accumulator
(``lse1 = -inf``, ``o1 = 0``), which the first merge replaces exactly. Accumulators are float32
(float64 for float64 inputs): merging in bf16 would lose digits at every step.

An element's bits do not depend on how many heads the call holds (the deterministic mode relies on it: a rank holds
``H / cp`` heads): the sigmoid's weights are written with each head's rows a run of their own (a row stride rounded
up to 64), so a CPU vector loop never runs across heads, where the number of heads would decide which elements fall
in its scalar tail (the tail computes ``exp`` otherwise than the vector body: 1 ulp apart, measured on a block of 36
rows at 8 and 4 heads). For the same reason ``block_lse`` is made contiguous first: the CPU flash kernel returns it
head-innermost, ``(B, S, H)`` in memory, which a loop over rows reads with a stride and so runs scalar, except with
one head, where it is contiguous and runs vectorised (1 ulp apart at 1 and 8 heads, measured).
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
    block_lse = block_lse.contiguous()  # the CPU flash kernel's lse is head-innermost: a loop over it runs scalar
    rows = block_lse.shape[-1]
    padded = -(-rows // 64) * 64  # each head's weights a row of their own: not one run across heads (module doc)
    weight = torch.sub(block_lse, lse, out=block_lse.new_empty((*block_lse.shape[:-1], padded))[..., :rows])
    weight = weight.sigmoid_().unsqueeze(-1)
    out.lerp_(block_out.to(out.dtype), weight)  # out + weight * (block_out - out), one kernel
    torch.logaddexp(lse, block_lse, out=lse)
