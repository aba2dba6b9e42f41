"""Mixture-of-experts feed-forward (top-k router, load-balancing loss), written for one device.

Expert parallelism enters only through the ``moe_handler`` argument (an
:class:`~cp_handler.runtime.moe.ExpertParallelHandler`): it moves tokens to the ranks holding their experts
and back, and sums router statistics over the ranks sharing the batch. This file never imports
``torch.distributed``. Experts are kept in a ``ModuleDict`` keyed by their global id, so a rank
holding a shard (:meth:`MoEFeedForward.shard_experts`) has the same parameter names as a single
process holding all of them.

Router: softmax over the experts' logits (float32), top-k, gates renormalised over the chosen k
(Mixtral). Load-balancing loss (Switch Transformer, Fedus et al. 2021, as Megatron-LM's
``switch_load_balancing_loss_func``): ``E * sum_i f_i * P_i`` with ``f_i`` the fraction of routed
(token, expert) pairs that went to expert ``i`` and ``P_i`` the mean router probability of ``i``,
both over the whole batch, times ``moe_aux_loss_coeff``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.moe import ExpertParallelHandler


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """``forward(x (B, S_local, h), moe_handler) -> (B, S_local, h)``; experts are SwiGLU MLPs."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, aux_loss_coeff: float):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_router_topk={top_k} must lie in [1, num_moe_experts={num_experts}]")
        self.num_experts, self.top_k, self.aux_loss_coeff = num_experts, top_k, aux_loss_coeff
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(i): SwiGLU(hidden_size, ffn_hidden_size) for i in range(num_experts)})

    def shard_experts(self, expert_ids: range) -> None:
        """Keep only the experts ``expert_ids`` (this rank's shard); the others are dropped."""
        for key in [k for k in self.experts if int(k) not in expert_ids]:
            del self.experts[key]

    def route(self, x: torch.Tensor, moe_handler: ExpertParallelHandler):
        """``x (B, S_local, h)`` -> ``gates (N, k)`` float32, ``expert_ids (N, k)`` int64 (``N = B S_local``);
        records the aux loss over the batch's tokens (a CP layout's padding is routed, not counted)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # (B, S_local, E)
        gates, expert_ids = probs.flatten(0, 1).topk(self.top_k, dim=-1)
        counted = moe_handler.real_rows(expert_ids.view(*x.shape[:2], self.top_k))
        counts = torch.bincount(counted.flatten(), minlength=self.num_experts)
        global_counts, global_tokens = moe_handler.router_stats(counts, counted.shape[0])
        fraction = global_counts / (global_tokens * self.top_k)  # f_i over the whole batch
        mean_prob_share = moe_handler.probs_sum(probs) / global_tokens  # this rank's (its CP group's) share of P_i
        moe_handler.add_aux_loss(self.aux_loss_coeff * self.num_experts * (fraction * mean_prob_share).sum())
        return gates / gates.sum(-1, keepdim=True), expert_ids

    def forward(self, x: torch.Tensor, moe_handler: ExpertParallelHandler) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        gates, expert_ids = self.route(x, moe_handler)
        pairs = tokens.repeat_interleave(self.top_k, dim=0)  # (N*k, h): one row per (token, expert)
        expert_in, counts, state = moe_handler.token_dispatch(pairs, expert_ids)
        outputs = []
        for index, (e, rows) in enumerate(zip(moe_handler.local_expert_ids, expert_in.split(counts), strict=True)):
            with moe_handler.expert_rows(state, index):
                outputs.append(self.experts[str(e)](rows))
        expert_out = torch.cat(outputs)
        out = moe_handler.token_combine(expert_out, state).view(b * s, self.top_k, h)
        return (out * gates.unsqueeze(-1).to(out.dtype)).sum(1).view(b, s, h)
