"""MoE pieces of a training run: expert groups, the per-step handler, gradient reduction and norm.

Without DDP (each rank holds different experts): after backward, dense gradients are summed over
every rank and expert gradients over the ranks holding the same experts (expert data parallel),
each as one flat all-reduce (the same reduction a tensor-parallel run makes: :mod:`.tensor_parallel`).
The loss is a share of the global loss on every rank, so sums (not means) give the single-process
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.moe import MoEFeedForward
from ..runtime.moe import ExpertParallelHandler
from ..runtime.parallel_layout import ParallelGroups
from .tensor_parallel import all_reduce_local_grads, grad_norm


def expert_parameters(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter that belongs to an expert."""
    return {id(p) for m in model.modules() if isinstance(m, MoEFeedForward) for p in m.experts.parameters()}


@dataclass
class ExpertGroups:
    """The run's expert layout: ``num_experts`` per layer over ``groups`` (a :class:`ParallelGroups`)."""

    num_experts: int
    groups: ParallelGroups | None
    """``None``: one process holding every expert (the parity reference)."""

    @classmethod
    def local(cls, num_experts: int) -> ExpertGroups:
        return cls(num_experts, None)

    def handler(self, cp_handler=None, exact=None) -> ExpertParallelHandler:
        """A fresh per-step handler: tokens over the ep group, router statistics over dp x cp, the batch's tokens
        and mode from its ``cp_handler``, the deterministic mode's ``exact`` sums
        (:class:`~cp_handler.runtime.moe.ExpertParallelHandler`)."""
        if self.groups is None:
            return ExpertParallelHandler(num_experts=self.num_experts, cp_handler=cp_handler, exact=exact)
        return ExpertParallelHandler(num_experts=self.num_experts, ep_group=self.groups.groups["ep"],
                                     stats_group=self.groups.groups["dp_cp"], cp_handler=cp_handler, exact=exact)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum dense gradients over dp x cp and expert gradients over expert data parallel ranks (a missing gradient
        counts as zero; :func:`~.tensor_parallel.all_reduce_local_grads`, which a TP run calls the same way)."""
        if self.groups is not None:
            all_reduce_local_grads(model, self.groups.groups["dp_cp"], experts=expert_parameters(model),
                                   expert_group=self.groups.groups["edp"])

    def grad_norm(self, model: torch.nn.Module) -> float:
        """Global gradient norm: dense gradients once, every expert shard once (summed over ep;
        :func:`~.tensor_parallel.grad_norm`)."""
        return grad_norm(model, expert_parameters(model), self.groups.groups["ep"])
