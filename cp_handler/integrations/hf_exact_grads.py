"""Exact parameter gradients in the Hugging Face trainers' deterministic mode (``ContextParallelArguments(
deterministic=True)``): every trainer step's parameter gradients the same bits at every CP degree, so whole runs
(SFT, GRPO, RLOO, DPO: every step's scores, losses and parameters) are bitwise one process's, not only the first step.

:class:`~cp_handler.runtime.exact_grads.ExactGradients` computes each gradient in pieces that are the same at every
degree (a weight GEMM per unit of a sequence, a piece per token for biases, norm weights and embedding rows) and adds
them exactly (fixed point, int64): :class:`TrainerExactGradients` puts it inside Trainer's step:

* the model's hub kernels are reset to the torch layers (:func:`~.hf_kernels.reset_hub_kernels`: transformers'
  ``kernelize`` would replace the forwards the exact sums take at every ``train()`` / ``eval()``), and its parameters
  moved to aligned memory (:func:`align_parameters`: a one-row matmul's bits follow its weight's alignment);
* each ``training_step`` runs inside the exact scope and under the model's ``no_sync`` (DDP's float32 all-reduce is
  replaced); the batch's units are told where its handler is built (the trainers' ``training_step``, TRL's fused
  head: :meth:`TrainerExactGradients.set_units`);
* TRL's fused LM head (the log-probabilities of its SFT, GRPO, RLOO and DPO trainers) reads ``lm_head.weight`` itself
  and sums its gradient over tiles of the rank's tokens: inside the step (:meth:`TrainerExactGradients.fused_head`)
  each unit's tokens are one call of TRL's function, whose weight (and bias) gradient is that unit's piece;
* after the last micro-batch of a step (``accelerator.sync_gradients``) the limbs are all-reduced over every rank as
  int64 and divided as DDP's mean would. Trainer and TRL's SFTTrainer scale each rank's loss by the world size
  (``exact_divides_world``): the sums are divided by it, exact for a world of a power of two ranks (the per-token
  gradients are then the one-process ones times a power of two, and so are the pieces; a piece below ``2**-33`` in
  magnitude is rounded onto the grid, where that scale can move it by one step of ``2**-56``: the float32 result
  changes only for a sum that close to a rounding boundary), so those trainers sum exactly only there. The RL
  trainers' fused head leaves each rank's gradient unscaled by cp in the mode (:mod:`.hf_fused_head`), so their
  pieces are one process's at any degree and the sums are divided by the dp size, the same at every CP degree: any
  world.

Where the trainer cannot (:func:`refusal`: a world that is not a power of two for Trainer / SFTTrainer, FSDP /
DeepSpeed, ``torch_compile``,
modules the pieces do not cover, such as a vision tower's convolutions, a MoE's fused experts, Gemma's ``1 + weight``
norm), the gradients are all-reduced in float32 as without the mode (within float32 reordering, ~1e-7 relative per
step) and the trainer says why (``trainer.exact_gradients_refusal``, logged once).
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
import torch.distributed as dist

from ..runtime.exact_grads import ExactGradients, uncovered, unit_lengths, unit_slices
from .hf_kernels import reset_hub_kernels

logger = logging.getLogger(__name__)


def refusal(trainer, model: torch.nn.Module) -> str | None:
    """Why ``trainer`` (in the deterministic mode) cannot sum ``model``'s gradients exactly (``None``: it can)."""
    world = trainer.accelerator.num_processes
    if trainer.exact_divides_world and world & (world - 1):
        return (f"a world of {world} ranks: Trainer scales each rank's loss for DDP's mean over the world, exact only "
                "for a power of two")
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        return "FSDP / DeepSpeed reduce the gradients their own way"
    if trainer.args.torch_compile:
        return "torch_compile=True (the exact pieces are taken outside compiled graphs)"
    if trainer.cp_args.mlp_chunk_tokens:
        return (f"mlp_chunk_tokens={trainer.cp_args.mlp_chunk_tokens} (the MLPs run on chunks of tokens, which need "
                "not be whole units)")
    if missing := uncovered(model):
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"{missing[:3]}{more} hold parameters that the exact sums do not cover"
    return None


class TrainerExactGradients:
    """The exact sums of one trainer's model (module doc).

    Args:
        model: the unwrapped model (every parameter-holding module covered: :func:`refusal` is ``None``).
        world: the number of processes (the sums are taken over all of them).
        divisor: what the sums are divided by (DDP's mean: the world, or the dp size where the gradients are left
            unscaled by cp).
    """

    def __init__(self, model: torch.nn.Module, world: int, divisor: int):
        self.sums, self.world, self.divisor = ExactGradients(model), world, divisor

    def set_units(self, handler, local_len: int) -> None:
        """The units of the batch about to run its forward (:func:`~cp_handler.runtime.exact_grads.unit_lengths`)."""
        self.sums.units = unit_lengths(handler, local_len)

    def training_step(self, accelerator, model, run):
        """``run()`` (Trainer's step: forward and backward of a micro-batch) inside the exact scope, DDP not syncing,
        TRL's fused LM head one call per unit (:meth:`fused_head`); after the step's last micro-batch, the exact sums
        all-reduced and written to ``.grad``."""
        with self.sums, accelerator.no_sync(model), self.fused_head():
            loss = run()
        if accelerator.sync_gradients:
            group = dist.group.WORLD if self.world > 1 else None
            self.sums.all_reduce_(group)
            for param in self.sums.params:
                param.grad.div_(self.divisor)  # DDP's mean: the same division at every CP degree
        return loss

    @contextlib.contextmanager
    def fused_head(self):
        """A block in which TRL's fused LM head (if TRL is in use) runs one call per unit of the batch told last
        (module doc): TRL's SFT, GRPO, RLOO and DPO trainers all compute their log-probabilities with it."""
        trl_utils = sys.modules.get("trl.trainer.utils")
        if trl_utils is None:
            yield
            return
        original = trl_utils._ChunkedLogProbFunction
        trl_utils._ChunkedLogProbFunction = _PerUnit(original, self.sums)
        try:
            yield
        finally:
            trl_utils._ChunkedLogProbFunction = original


class _PerUnit:
    """TRL's ``ChunkedLogProbFunction`` called once per unit of the rows it is given (flattened ``(N, H)`` hidden
    states, ``N`` a whole number of the batch's rows), the weight and bias passed through :class:`_Piece`; the
    per-token outputs concatenated (each token's the same bits: TRL's tiles compute a token's row alone). Calls
    without gradients, or on another model's head (a reference model's), go to TRL's function whole."""

    def __init__(self, function, sums: ExactGradients):
        self.function, self.sums = function, sums

    def apply(self, hidden, weight, bias, labels, *rest):
        if not (torch.is_grad_enabled() and weight in self.sums.limbs):
            return self.function.apply(hidden, weight, bias, labels, *rest)
        outputs = []
        for rows in unit_slices(self.sums.units, hidden.shape[0]):
            unit_weight = _Piece.apply(weight, [weight], self.sums)
            unit_bias = None if bias is None else _Piece.apply(bias, [bias], self.sums)
            outputs.append(self.function.apply(hidden[rows], unit_weight, unit_bias, labels[rows], *rest))
        return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*outputs, strict=True))


class _Piece(torch.autograd.Function):
    """Identity on a parameter (``[param]``: the parameter itself, the key of its sums); backward: the gradient (one
    unit's, from one call of TRL's function) into the exact sums of ``param``, none to autograd."""

    @staticmethod
    def forward(ctx, tensor, param, sums):
        (ctx.param,), ctx.sums = param, sums
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.sums.add_(ctx.param, grad)
        return None, None, None


ALIGNMENT = 64
"""Bytes: the CPU allocator's alignment, which :func:`align_parameters` gives every parameter."""


def align_parameters(model: torch.nn.Module) -> list[str]:
    """Move every parameter of ``model`` whose data does not start on :data:`ALIGNMENT` bytes to fresh memory (the same
    values, the same parameter objects); returns their names. Weights loaded from a memory-mapped file
    (``from_pretrained``'s safetensors) start where the file puts them, 4-byte aligned at worst, and a one-row matmul
    on this CPU follows its weight's alignment: TRL's fused head on a unit of one token gave other bits with a weight
    4 bytes off 16 than with an aligned one (measured 2026-12-06: a cp-3 run and the one-process run differed by
    4.8e-7 in 12 of 96 rows), so the bits followed the process's file layout."""
    moved = []
    for name, param in model.named_parameters():
        if param.data_ptr() % ALIGNMENT:
            param.data = param.data.clone()
            moved.append(name)
    return moved


def build(trainer, model: torch.nn.Module) -> TrainerExactGradients | None:
    """The trainer's exact sums in the deterministic mode where :func:`refusal` allows them (else ``None``, the
    reason kept as ``trainer.exact_gradients_refusal`` and logged once; ``None`` outside the mode)."""
    trainer.exact_gradients_refusal = None
    if not trainer.cp_config.deterministic:
        return None
    trainer.exact_gradients_refusal = refusal(trainer, model)
    if trainer.exact_gradients_refusal is not None:
        logger.warning("deterministic mode: parameter gradients all-reduced in float32, not summed exactly: %s",
                       trainer.exact_gradients_refusal)
        return None
    reset_hub_kernels(model, "the deterministic mode's exact sums take the layers' forwards, which kernelize would "
                             "replace at every train() / eval()")
    align_parameters(model)
    world = trainer.accelerator.num_processes
    return TrainerExactGradients(model, world, world if trainer.exact_divides_world else trainer.cp_groups.dp_size)
