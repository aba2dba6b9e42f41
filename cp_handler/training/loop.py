"""The optimizer loop of a training run: steps, gradient norm, the parity reference, evaluation,
progress (each step's loss and, beside it, the mean of the last :data:`LOSS_WINDOW`: a batch of two sequences
makes single steps' losses bounce), the launcher's heartbeat, and a stop at the first non-finite loss."""

from __future__ import annotations

import collections
import functools
import math
import sys
import time

import torch
import torch.distributed as dist

from ..core.progress import Progress
from ..runtime.launch import heartbeat
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


def train_steps(model, steps: int, run_step, optim: torch.optim.Optimizer, count_group, progress: bool,
                log_every: int | None = None, after_step=None, grad_norm_fn=None, reference=None, start: int = 0,
                checkpoint=None, scheduler=None, clip_grad: float = 0.0) -> list[dict]:
    """Run optimizer steps ``start .. steps - 1``.

    Args:
        model: the (possibly DDP-wrapped) model.
        run_step: ``run_step(step) -> (this rank's share of the loss, global tokens)``: the forward and
            backward, gradients reduced when it returns (:mod:`.steps`).
        optim: the optimizer of ``model``'s parameters (built by ``optimizer(params)``, e.g.
            :func:`default_optimizer`; state already loaded when resuming).
        count_group: ranks whose loss shares sum to the global loss.
        progress: show progress (rank 0); ``log_every``: plain lines every N steps in a log.
        after_step: ``after_step(step) -> dict | None`` merged into the step's record (evaluation).
        grad_norm_fn: replaces the local gradient norm (sharded experts).
        reference: ``reference(step, model) -> dict`` (``--check-parity``), before the optimizer step.
        start: steps already done (a resumed run: the data position).
        checkpoint: ``checkpoint(steps_done)`` after each optimizer step (it decides whether to save).
        scheduler: a learning-rate scheduler stepped after each optimizer step (e.g.
            :meth:`.schedule.LRSchedule.scheduler`; positioned at ``start`` when resuming).
        clip_grad: scale the gradients so that their global norm (``grad_norm_fn``'s with sharded experts)
            is at most this, after the parity reference saw them (0: no clipping).

    Returns:
        Per step: loss (token-weighted over the global batch), global gradient norm (before clipping),
        learning rate, time, tokens/s and what the callbacks added.

    Raises:
        NonFiniteLoss: a step's loss is not finite (on every rank: the reduced loss is the same).
    """
    records, recent = [], collections.deque(maxlen=LOSS_WINDOW)
    mean_key = f"mean{LOSS_WINDOW}"
    if progress:
        print(f"cp-train: each step's loss, and {mean_key}: the mean loss of the last {LOSS_WINDOW} steps (fewer "
              "before the run has made that many)", file=sys.stderr, flush=True)
    bar = Progress(steps, "cp-train: step", enabled=progress, every=log_every, initial=start)
    for step in range(start, steps):
        began = time.perf_counter()
        loss, tokens = run_step(step)
        reported = loss.double()
        if count_group is not None:
            dist.all_reduce(reported, group=count_group)
        if not math.isfinite(reported.item()):
            bar.close()
            raise NonFiniteLoss(f"step {step + 1}: the loss is {reported.item()}; the run stops before the optimizer "
                                "step (lower --lr, check the data or the model)")
        grad_norm = (grad_norm_fn or local_grad_norm)(model)
        checked = reference(step, model) if reference else {}
        if clip_grad:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, torch.tensor(grad_norm))
        lr = optim.param_groups[0]["lr"]
        optim.step()
        optim.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        elapsed = time.perf_counter() - began
        records.append({"step": step, "loss": reported.item(), "grad_norm": grad_norm, "lr": lr, "step_time_s": elapsed,
                        "tokens_per_s": tokens / elapsed, **checked, **((after_step and after_step(step)) or {})})
        heartbeat()
        recent.append(reported.item())
        bar.update(loss=f"{reported.item():.4f}", **{mean_key: f"{sum(recent) / len(recent):.4f}"}, lr=f"{lr:.3g}",
                   tok_s=f"{records[-1]['tokens_per_s']:.0f}",
                   **({"eval": f"{records[-1]['eval_loss']:.4f}"} if "eval_loss" in records[-1] else {}))
        if checkpoint is not None:
            checkpoint(step + 1)
            heartbeat()
    bar.close()
    return records
