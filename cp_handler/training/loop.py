"""What the optimizer loop of a training run (:class:`~.trainer.Trainer`) is made of: the default optimizer, the
gradient norm, the window of the progress's running mean (a batch of two sequences makes single steps' losses
bounce), and the stop at the first non-finite loss."""

from __future__ import annotations

import collections
import functools
import sys

import torch

from ..core.progress import Progress
from .fsdp import full_tensor

LOSS_WINDOW = 10
"""Steps whose losses the progress's running mean (``mean10``) averages: the last 10 of this run (fewer at its
start; a resumed run starts a new window, the losses before it are not in the checkpoint)."""


class NonFiniteLoss(RuntimeError):
    """The loss of a step is NaN or infinite: the run stops instead of training on it."""


def adamw(params, lr: float) -> torch.optim.Optimizer:
    """The default optimizer of ``cp-train``: AdamW without weight decay."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def default_optimizer(lr: float):
    """A picklable optimizer factory ``params -> Optimizer`` (AdamW at ``lr``)."""
    return functools.partial(adamw, lr=lr)


def local_grad_norm(model) -> float:
    """The gradient norm over ``model``'s parameters (FSDP: over every rank's shards)."""
    return full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))).item()


class StepProgress:
    """The progress lines of a run (shown on rank 0 only: ``enabled``): each step's loss and, beside it, the mean of
    the last :data:`LOSS_WINDOW` steps (``mean10``), the learning rate, tokens/s and the held-out loss when a step
    has one; every step on a terminal, every ``log_every`` steps in a log; ``start``: the steps a resumed run
    already made."""

    def __init__(self, steps: int, enabled: bool, log_every: int | None = None, start: int = 0):
        self.recent = collections.deque(maxlen=LOSS_WINDOW)
        if enabled:
            print(f"cp-train: each step's loss, and mean{LOSS_WINDOW}: the mean loss of the last {LOSS_WINDOW} steps "
                  "(fewer before the run has made that many)", file=sys.stderr, flush=True)
        self.bar = Progress(steps, "cp-train: step", enabled=enabled, every=log_every, initial=start)

    def update(self, record: dict) -> None:
        """One step's record (:meth:`~.trainer.Trainer.step`, with ``eval_loss`` where it was evaluated)."""
        self.recent.append(record["loss"])
        mean = sum(self.recent) / len(self.recent)
        self.bar.update(loss=f"{record['loss']:.4f}", **{f"mean{LOSS_WINDOW}": f"{mean:.4f}"},
                        lr=f"{record['lr']:.3g}", tok_s=f"{record['tokens_per_s']:.0f}",
                        **({"eval": f"{record['eval_loss']:.4f}"} if "eval_loss" in record else {}))

    def close(self) -> None:
        self.bar.close()
