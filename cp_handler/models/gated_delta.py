"""The linear-attention layer of the reference hybrid model: Gated DeltaNet, as Qwen3-Next's (simplified: one
projection for q, k, v, their short causal convolution, the gated delta rule, a gated RMSNorm), written for one
device. Context parallelism enters only through the handler's mixer methods (``causal_conv1d``,
``gated_delta_rule``), as attention enters through ``core_attn``.

Shapes: key heads ``Hk = num_query_groups`` of ``Dk = kv_channels``, value heads ``Hv = num_attention_heads`` of
``Dv = v_head_dim`` (each key head serves ``Hv / Hk`` value heads, Qwen3-Next's grouped value heads); decay
``g = -exp(A_log) * softplus(a + dt_bias)`` per value head and token, write strength ``beta = sigmoid(b)``
(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", 2024).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..handlers.base import ContextParallelHandler


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: ``forward(x (B, S_local, hidden), freqs, cp_handler) -> (B, S_local, hidden)``
    (``freqs`` unused: no RoPE in linear attention)."""

    _cp_mixer = True  # a token mixer other than attention (generation refuses models with one)

    def __init__(self, config, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.k_heads, self.v_heads = config.num_query_groups, config.num_attention_heads
        self.k_dim, self.v_dim = config.kv_channels, config.v_head_dim
        conv_dim = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        self.in_proj_qkv = nn.Linear(config.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.v_heads * self.v_dim, bias=False)
        self.in_proj_ab = nn.Linear(config.hidden_size, 2 * self.v_heads, bias=False)
        bound = 1 / math.sqrt(config.linear_conv_kernel_dim)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, config.linear_conv_kernel_dim).uniform_(-bound, bound))
        self.A_log = nn.Parameter(torch.empty(self.v_heads).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.norm = nn.RMSNorm(self.v_dim, eps=config.norm_epsilon)
        self.out_proj = nn.Linear(self.v_heads * self.v_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cp_handler: ContextParallelHandler) -> torch.Tensor:
        b, s, _ = x.shape
        mixed = cp_handler.causal_conv1d(self.in_proj_qkv(x).transpose(1, 2), self.conv_weight, None, "silu")
        q, k, v = mixed.transpose(1, 2).split([self.k_heads * self.k_dim] * 2 + [self.v_heads * self.v_dim], dim=-1)
        q, k = (t.reshape(b, s, self.k_heads, self.k_dim) for t in (q, k))  # (B, S, Hk, Dk)
        v = v.reshape(b, s, self.v_heads, self.v_dim)  # (B, S, Hv, Dv)
        a, beta = self.in_proj_ab(x).chunk(2, dim=-1)  # (B, S, Hv) each
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = cp_handler.gated_delta_rule(q, k, v, g, beta.sigmoid(), use_qk_l2norm_in_kernel=True)  # (B, S, Hv, Dv)
        z = self.in_proj_z(x).reshape(b, s, self.v_heads, self.v_dim)
        out = self.norm(out) * F.silu(z)
        return self.out_proj(out.reshape(b, s, self.v_heads * self.v_dim))
