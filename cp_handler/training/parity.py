"""``cp-train --check-parity``: every CP step against one single-process step from the same parameters.

Before each optimizer step, rank 0 loads the CP model's current parameters into a full model (MoE:
the expert shards gathered from every rank) and runs one step of the same global batch on its own,
through code that shares nothing with the CP path (:mod:`.reference`: plain PyTorch attention for the
reference GPT, the unmodified model's own attention for Hugging Face models). The CP step's loss and
its whole (reduced) gradient are
compared with that reference step's: ``|loss - ref| / |ref|`` and ``|g - g_ref| / |g_ref|`` over
every parameter rank 0 holds. Both steps start from the same parameters, so the two runs cannot drift
apart the way two independent training runs do (two fp32 Adam runs separate by ~1e-2 in loss after
~120 steps at cp=4), and the check holds at any ``--steps``; a real bug (a wrong position, a lost
token, a missing gradient) shows at the first step it touches.

Tolerances (max relative difference over all steps, loss and gradient alike):

* float32: 1e-5. Only the order of float32 sums differs (attention merges, the cross-rank
  reductions): measured ~1e-7 relative per step;
* bfloat16: 2e-2 (8 mantissa bits, ~4e-3 per op, a few ops deep).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .fsdp import full_gradients, full_tensor, is_sharded
from .fsdp import full_state as fsdp_full_state

PARITY_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}
"""Max relative difference of the loss and of the gradient, CP step vs reference step."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def full_state(model: torch.nn.Module, sharded_experts: bool) -> dict | None:
    """The whole model's state on rank 0 (``None`` elsewhere). With sharded experts every rank sends
    its experts' tensors, with FSDP every rank its shards (a collective: every rank calls this)."""
    if is_sharded(model):
        return fsdp_full_state(model)
    state = {k: full_tensor(v) for k, v in unwrap(model).state_dict().items()}  # TP's split weights: gathered
    if sharded_experts:
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, {k: v.cpu() for k, v in state.items() if ".experts." in k})
        device = next(iter(state.values())).device
        for shard in shards:
            state.update({k: v.to(device) for k, v in shard.items()})
    return state if dist.get_rank() == 0 else None


class StepReference:
    """Per step: the reference loss and gradient norm from the CP model's current parameters.

    Args:
        model: a full (unsharded) model built like the CP one, on rank 0; ``None`` elsewhere.
        run: ``run(step) -> (loss, tokens)``: one forward/backward of the whole global batch on ``model``.
        grad_norm: the global gradient norm of ``model``.
        sharded_experts: the CP model holds only its experts (gather them each step).
        twin: the deterministic mode's bitwise check: ``(model, run)``, ``run(step) -> loss`` the same step at cp 1
            through the mode (:func:`~.steps.twin_step`), or ``None``.
    """

    def __init__(self, model, run, grad_norm, sharded_experts: bool, twin=None):
        self.model, self.run, self.grad_norm, self.sharded_experts = model, run, grad_norm, sharded_experts
        self.twin = twin

    def __call__(self, step: int, cp_model: torch.nn.Module) -> dict:
        state = full_state(cp_model, self.sharded_experts)
        ours = full_gradients(unwrap(cp_model))  # FSDP: gathered (a collective, before rank 0 goes on alone)
        if state is None:
            return {}
        self.model.load_state_dict(state)
        self.model.zero_grad(set_to_none=True)
        loss, _ = self.run(step)
        checked = {"reference_loss": loss.item(), "reference_grad_norm": self.grad_norm(self.model),
                   "grad_rel_diff": gradient_difference(ours, self.model)}
        if self.twin is not None:
            model, run = self.twin
            model.load_state_dict(state)
            model.zero_grad(set_to_none=True)
            checked["twin_loss"] = run(step).item()
            grads = dict(model.named_parameters())
            checked["twin_grads_differing"] = [name for name, grad in ours.items()
                                               if not torch.equal(grad, grads[name].grad.to(grad.device))]
        return checked


def gradient_difference(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    """``|g_cp - g_ref| / |g_ref|`` over the gradients ``ours`` of the CP model on this rank (by parameter name;
    its experts only, when they are sharded): the whole gradient, not only its norm."""
    pairs = [(ours[name], p.grad.to(ours[name].device)) for name, p in reference.named_parameters()
             if name in ours and p.grad is not None]
    diff = torch.sqrt(sum(((a.double() - b.double()) ** 2).sum() for a, b in pairs))
    norm = torch.sqrt(sum((b.double() ** 2).sum() for _, b in pairs))
    return (diff / norm).item()


def _worst(value: float) -> float:
    """A difference for comparisons: NaN counts as infinitely bad (Python's ``max`` would skip it)."""
    return math.inf if math.isnan(value) else value


def _relative(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    return _worst(abs(value - reference) / abs(reference)) if reference else math.inf


def parity_result(records: list[dict], dtype: str) -> dict:
    """Compare every step's loss, gradient (rank 0's parameters) and global gradient norm (every rank's
    parameters: what ``--clip-grad`` divides by) with its reference; prints the verdict. Any non-finite
    value (loss, reference, difference) fails the check."""
    rel = [_relative(r["loss"], r["reference_loss"]) for r in records]
    grad = [_worst(r["grad_rel_diff"]) for r in records]
    norm = [_relative(r["grad_norm"], r["reference_grad_norm"]) for r in records]
    rtol = PARITY_RTOL[dtype]
    worst = max(range(len(records)), key=lambda i: max(rel[i], grad[i], norm[i]))
    worst_step = records[worst]["step"]  # counted from 1, as the progress lines and the records count
    finite = all(math.isfinite(x) for r in records for x in (r["loss"], r["reference_loss"], r["grad_rel_diff"],
                                                             r["grad_norm"], r["reference_grad_norm"]))
    result = {"rtol": rtol, "max_rel_diff": max(rel), "max_grad_rel_diff": max(grad),
              "max_grad_norm_rel_diff": max(norm), "worst_step": worst_step,
              "reference_loss": [r["reference_loss"] for r in records],
              "reference_grad_norm": [r["reference_grad_norm"] for r in records],
              "passed": finite and max(rel) <= rtol and max(grad) <= rtol and max(norm) <= rtol}
    verdict = "passed" if result["passed"] else "FAILED"
    print(f"cp-train: parity {verdict}: each of {len(records)} steps vs one process from the same parameters: max "
          f"relative difference loss {max(rel):.2e}, gradient {max(grad):.2e}, gradient norm {max(norm):.2e} "
          f"(tolerance {rtol:.0e}; worst at step {worst_step})", file=sys.stderr)
    if "twin_loss" in records[0]:
        result["bitwise"] = _bitwise(records)
        result["passed"] = result["passed"] and result["bitwise"]["passed"]
    return result


def _bitwise(records: list[dict]) -> dict:
    """The deterministic mode's bitwise check (:class:`StepReference`'s ``twin``): every step's loss ``==`` and
    every gradient ``torch.equal`` to the same step at cp 1 in the mode; prints the verdict."""
    losses = [r["step"] for r in records if r["loss"] != r["twin_loss"]]
    grads = {r["step"]: r["twin_grads_differing"] for r in records if r["twin_grads_differing"]}
    passed = not losses and not grads
    detail = "" if passed else f" (steps whose loss differs: {losses}; gradients differing: {grads})"
    print(f"cp-train: bitwise parity {'passed' if passed else 'FAILED'}: each of {len(records)} steps' loss == and "
          f"every parameter gradient torch.equal to the same step at cp 1 in the deterministic mode{detail}",
          file=sys.stderr)
    return {"passed": passed, "loss_steps_differing": losses, "gradients_differing": grads}
