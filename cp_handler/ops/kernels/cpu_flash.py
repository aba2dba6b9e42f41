"""CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA native: k/v keep
their head count, dk/dv come back with it). Any float dtype."""

from __future__ import annotations

import torch

from .base import AttnKernel

aten = torch.ops.aten


def forward(q, k, v, *, causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     scale=scale)


KERNEL = AttnKernel("cpu_flash", "cpu", (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                    forward, backward, verified_on="CPU (the whole test suite)")
