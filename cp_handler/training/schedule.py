"""The learning-rate schedule of ``cp-train``: linear warm-up, then a constant, linear or cosine decay to a
minimum, as Megatron-LM's ``OptimizerParamScheduler`` computes it (megatron/core/optimizer_param_scheduler.py,
``get_lr``), applied through ``torch.optim.lr_scheduler.LambdaLR``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of optimizer step ``step`` (0-based) as a factor of the peak ``lr``.

    With ``n = step + 1`` steps taken (Megatron's ``num_steps``): ``n <= warmup_steps``: ``lr * n /
    warmup_steps``; then ``constant``: ``lr``; ``linear`` / ``cosine``: from ``lr`` at the end of the warm-up
    to ``min_lr`` at ``n = decay_steps``, and ``min_lr`` after it. Cosine: ``min_lr + (lr - min_lr) * (1 +
    cos(pi * r)) / 2`` with ``r = (n - warmup_steps) / (decay_steps - warmup_steps)``.

    Args (checked by ``cp-train`` before any rank starts):
        lr: the peak learning rate (> 0).
        min_lr: the learning rate at the end of the decay (0 <= min_lr <= lr).
        warmup_steps: steps of the linear warm-up (>= 0).
        decay_style: one of :data:`DECAY_STYLES`.
        decay_steps: the step count at which the decay ends, counted from the run's start (warm-up
            included; > warmup_steps); ``None`` only with ``constant``.
    """

    lr: float = 3e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "constant"
    decay_steps: int | None = None

    def __call__(self, step: int) -> float:
        """The factor of the optimizer's learning rate at 0-based ``step`` (``LambdaLR``'s ``lr_lambda``)."""
        n = step + 1
        if n <= self.warmup_steps:
            return n / self.warmup_steps
        if self.decay_style == "constant":
            return 1.0
        floor = self.min_lr / self.lr
        ratio = min(1.0, (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        coefficient = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return floor + coefficient * (1.0 - floor)

    def scheduler(self, optim: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A ``LambdaLR`` over ``optim`` (built before a checkpoint's state is loaded into either); step it
        after every optimizer step. Its ``state_dict()`` is JSON-serialisable (the checkpoint keeps it)."""
        return torch.optim.lr_scheduler.LambdaLR(optim, self)
