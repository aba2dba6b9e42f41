"""Context parallelism inside Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

A script changes two lines::

    from cp_handler.integrations.hf_trainer import CPTrainer, ContextParallelArguments
    trainer = CPTrainer(model=model, args=training_args, train_dataset=ds,
                        cp_args=ContextParallelArguments(context_parallel_size=2))

and ``torchrun --nproc-per-node N script.py`` trains with ``dp = N / cp`` (DDP over every rank, as Trainer's own).
:class:`ContextParallelMixin` goes before any ``transformers.Trainer`` subclass; :class:`CPTrainer` and
``CPSFTTrainer`` (TRL, the ``trl`` extra) are ready-made; what every CP trainer shares (the settings, the groups, the
refusals, the loaders over dp) is :mod:`.hf_trainer_base`. What it does, by Trainer's public hooks:

* ``__init__``: the settings that would make the result wrong refused by name from the constructor's arguments,
  before the wrapped trainer's ``__init__`` acts on them (accelerate's own CP / SP, label smoothing,
  ``compute_loss_func``, ``average_tokens_across_devices=False``, ``batch_rebalance``, a loss without
  ``num_items_in_batch``), and the model's guard on a copy (:meth:`.hf_trainer_base.ContextParallelTrainerBase.
  _check_model`); after it, what only the built trainer shows; the dp x cp groups (CP ranks adjacent),
  ``register(model)``; the data loaders are split over the dp ranks only, so every rank of a CP group
  reads the same batch (the accelerator's ``prepare_data_loader``, replaced on this trainer's accelerator instance);
* ``training_step`` / ``prediction_step``: each batch sharded by :func:`~.hf_batch.shard_batch` (a handler per
  batch; packed documents as thd) and run under it; the loss is normalised as the plain trainer would for the model
  (:data:`LOSS_NORMALIZATIONS`): Trainer's own global token count (``num_items_in_batch``: :meth:`get_cp_size` makes
  Trainer divide its count over CP duplicates), or each micro-batch's mean for a model that takes no loss arguments
  (the micro-batch's count passed by the mixin), so the loss and every gradient are those of the plain trainer on the
  same global batches; ``prediction_step`` returns the logits combined in the original token order and the batch's
  loss summed over the CP group;
* ``evaluation_loop``: results gathered over the dp ranks only (CP ranks hold the same batch), so ``evaluate()``
  and ``predict()`` return each example once;
* **vision-language models** (:mod:`.hf_vlm`): the batch goes in whole with its vision inputs (TRL's vision
  collator: ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ...), only the labels sharded; a model
  whose class sets ``accepts_loss_kwargs = False`` (Qwen2.5-VL, Qwen3-VL, Qwen3.5) is accepted when the loss probe
  shows its loss takes ``shift_labels`` and ``num_items_in_batch``, and the mixin then passes each micro-batch's
  count (the plain trainers' mean);
* **every model's own loss** is probed in the constructor (:mod:`.hf_loss_probe`): it must be the token
  cross-entropy of the logits against ``shift_labels`` over ``num_items_in_batch`` (TRL's SFT loss divides by the
  count itself), else the model is refused by name (Bamba with ``z_loss_coefficient > 0``: each rank's share of its
  z-loss would be a mean over its shard).

TRL's RL and preference trainers (GRPO, RLOO, DPO) build on the same base (:class:`ContextParallelTrainerBase`):
:mod:`.hf_rl_trainer`.

Trainer's private ``_prepare_context_parallel_inputs`` is not used (accelerate's CP path); no private method is
overridden here; the private names read (SFTTrainer's token count, Trainer's ``_get_num_items_in_batch``) are listed
with every other the integration relies on in :mod:`.hf_upstream`.
Releases: transformers 5.23 and newer, TRL 1.16 and newer (:data:`OLDEST_TRL`); not refused by number: the behaviour
the mixin relies on is probed when a trainer is built (:func:`check_token_count`).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from ..auto.hold import hold_for
from ..core.install_hint import extra_hint
from .hf_batch import shard_batch
from .hf_loss_probe import check_model_loss
from .hf_router_loss import RouterLossScope, active_scope, router_loss_scope
from .hf_trainer_base import LOSS_NORMALIZATIONS, ContextParallelArguments, ContextParallelTrainerBase
from .hf_vlm import is_vision_language

__all__ = ["LOSS_NORMALIZATIONS", "OLDEST_TRL", "ContextParallelArguments", "ContextParallelMixin",
           "ContextParallelTrainerBase", "check_token_count"]

OLDEST_TRL = ">=1.16"
"""The oldest TRL release the trainers support and test (pyproject's ``hf`` extra); newer ones are not refused by
their number (what the trainers rely on is probed: :func:`check_token_count`)."""
PROBE_LABELS = (5, 1, 2, -100, 3, 4)
"""A probe row of labels: 5 labels, 4 after the next-token shift (the count cp_handler's loss normalises by)."""


def check_token_count(trainer) -> None:
    """The behaviour the mixin's loss rests on, probed on ``trainer`` (a collective over its ranks, which all build
    it): Trainer's ``num_items_in_batch`` of a global batch is the number of next-token labels (shifted) summed over
    the data-parallel ranks, divided by the CP size (``get_cp_size``): the count of one process's loss. How Trainer
    counts changed across releases (4.57 counted unshifted labels and had no ``get_cp_size``).

    Raises:
        ValueError: Trainer counts otherwise (the loss would be scaled wrong under CP), naming both counts.
    """
    labels = torch.tensor([PROBE_LABELS], device=trainer.args.device)
    try:
        count = trainer._get_num_items_in_batch([{"labels": labels}], trainer.args.device)
    except AttributeError as err:
        raise ValueError(f"{type(trainer).__name__}: this Trainer has no _get_num_items_in_batch ({err}): how it "
                         "counts the tokens its loss is normalised by cannot be checked; refused") from None
    shifted = sum(label != -100 for label in PROBE_LABELS[1:])
    want = shifted * trainer.args.world_size / trainer.get_cp_size()
    got = None if count is None else float(count)
    if got is None or abs(got - want) > 1e-6 * want:
        raise ValueError(f"{type(trainer).__name__}: Trainer counts {got} tokens for a probe batch whose next-token "
                         f"labels number {shifted} per rank ({want:g} over the world of {trainer.args.world_size} "
                         f"divided by cp={trainer.get_cp_size()} is what the loss under context parallelism needs); "
                         "this transformers release normalises the loss otherwise: refused")


_NO_COUNT = "a model whose forward takes no num_items_in_batch ({}: its loss would be each rank's own mean)"


def _accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether Trainer will pass ``model`` the loss arguments (``num_items_in_batch``): transformers' own rule
    (``Trainer.__init__``: the model's ``accepts_loss_kwargs``, else a ``**kwargs`` in its ``forward``), read before
    the wrapped trainer is built; the built trainer's ``model_accepts_loss_kwargs`` is checked again after."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


class ContextParallelMixin(ContextParallelTrainerBase):
    """Context parallelism for a ``transformers.Trainer`` subclass (module doc): ``class MyTrainer(
    ContextParallelMixin, Trainer)``, built with ``cp_args=ContextParallelArguments(...)``.

    Raises:
        ValueError: a setting refused by name (module doc), a world size not a multiple of the CP size, the model's
            guard (``register``), a model that is not a causal language model; before any training step.
    """

    loss_normalization = "global_token_count"
    """This trainer's :data:`LOSS_NORMALIZATIONS` entry (``ContextParallelArguments.loss_normalization``, by default
    the plain trainer's: ``"micro_batch_mean"`` when the model takes no loss arguments, as Qwen-VL's classes)."""

    @property
    def router_loss_convention(self) -> str:
        """How a MoE model's load-balancing loss reaches the loss (:mod:`.hf_router_loss`). Trainer takes the model's
        own loss: with the global token count it scales it by the process count (DDP's mean then sums the ranks:
        ``"share"``); a micro-batch mean is averaged by DDP over every rank, so each rank holds the batch's value with
        ``cp`` times its share as gradient (``"replicated"``)."""
        return "share" if self.loss_normalization == "global_token_count" else "replicated"

    def _prepare_registered(self, model) -> None:
        self.vision_language = is_vision_language(model)
        plain = "global_token_count" if self.model_accepts_loss_kwargs else "micro_batch_mean"
        check_model_loss(model, f"{type(self).__name__} takes the model's loss")  # the mixin passes the counts
        self.loss_normalization = self.cp_args.loss_normalization or plain
        self.model_accepts_loss_kwargs = self.loss_normalization == "global_token_count"  # Trainer counts then

    def _check_model_copy(self, model) -> None:
        check_model_loss(model, f"{type(self).__name__} takes the model's loss")

    def _check_releases(self) -> None:
        if self.loss_normalization == "global_token_count":
            check_token_count(self)

    def _micro_batch_count(self, inputs: dict, count: torch.Tensor, training: bool):
        """``(inputs, num_items_in_batch)`` of a step whose loss is its micro-batch's mean (``count``: the
        micro-batch's next-token labels, on every rank of the CP group). Trainer: the model is given ``count / cp``
        (each rank's token sum over it is ``cp`` times its share of the mean; DDP averages over the dp x cp ranks,
        Trainer divides by the accumulation steps, as without CP)."""
        return {**inputs, "num_items_in_batch": count / self.get_cp_size()}, None

    def _counted(self, sharded, num_items_in_batch, training: bool):
        """The inputs and ``num_items_in_batch`` of Trainer's step under :attr:`loss_normalization`; the inputs
        carry the batch's handler as ``cp_handler`` (Trainer's and TRL's ``compute_loss`` call ``model(**inputs)``:
        the keyword is the handler's one channel to the model)."""
        inputs = {**sharded.inputs, "cp_handler": sharded.handler}
        if self.loss_normalization == "global_token_count" or sharded.shift_labels is None:
            return inputs, num_items_in_batch
        count = (sharded.shift_labels != -100).sum().to(self.args.device)
        return self._micro_batch_count(inputs, count, training)

    def _refused_arguments(self, args, arguments: dict) -> list[str]:
        refused = super()._refused_arguments(args, arguments)
        if getattr(args, "label_smoothing_factor", 0):
            refused.append(f"label_smoothing_factor={args.label_smoothing_factor} (its smoother shifts the labels "
                           "of each rank's shard)")
        if args is not None and not args.average_tokens_across_devices:
            refused.append("average_tokens_across_devices=False (the loss is normalised by the global token count)")
        if arguments.get("compute_loss_func") is not None:
            refused.append("compute_loss_func (it would receive this rank's shard of the labels, already shifted in "
                           "global order, and the shard's logits)")
        model = arguments.get("model")
        if isinstance(model, torch.nn.Module) and not is_vision_language(model) and not _accepts_loss_kwargs(model):
            refused.append(_NO_COUNT.format(type(model).__name__))
        normalization = self.cp_args.loss_normalization
        if normalization is not None and normalization not in LOSS_NORMALIZATIONS:
            refused.append(f"ContextParallelArguments.loss_normalization={normalization!r} (one of "
                           f"{LOSS_NORMALIZATIONS}, or None: the plain trainer's)")
        return refused

    def _refused_settings(self) -> list[str]:
        refused = super()._refused_settings()
        if self.compute_loss_func is None and not self.model_accepts_loss_kwargs and \
                not is_vision_language(self.accelerator.unwrap_model(self.model)):
            refused.append(_NO_COUNT.format(type(self.model).__name__))
        return refused

    def _shard(self, inputs: dict):
        return shard_batch(inputs, self.cp_config, self.cp_groups.cp_group, self.cp_groups.hierarchical_cp_groups,
                           vision_language=self.vision_language, **self._cp_hold)

    @functools.cached_property
    def _cp_hold(self) -> dict:
        """``"auto"``'s pattern hold for the whole run (:func:`~cp_handler.auto.hold.hold_for`)."""
        return hold_for(self.cp_config)

    def _under(self, sharded):
        """The batch's real tokens known to the router loss (over the CP group: :mod:`.hf_router_loss`) and to
        :meth:`compute_loss` inside the block (the handler rides in the inputs: :meth:`_counted`)."""
        return router_loss_scope(RouterLossScope(self.cp_groups.cp_group, sharded.token_mask,
                                                 self.router_loss_convention))

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step on this rank's shard of the batch, under its handler."""
        sharded = self._shard(self._prepare_inputs(inputs))
        if self.exact_grads is not None:
            self.exact_grads.set_units(sharded.handler, sharded.inputs["input_ids"].shape[1])
        inputs, num_items_in_batch = self._counted(sharded, num_items_in_batch, training=True)
        with self._under(sharded):
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The trainer's ``compute_loss``; TRL's token count (``num_tokens``, which counts the sharded inputs'
        all-ones mask: the handler's padding too) recounted from the real tokens of every rank, so the logged
        figure is one process's."""
        before = getattr(self, "_total_train_tokens", None)
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        scope = active_scope()
        if before is not None and self.model.training and scope is not None:
            real = scope.token_mask.sum().to(self.args.device)
            if dist.is_initialized():
                dist.all_reduce(real)
            self._total_train_tokens = before + int(real) // getattr(self, "_tp_size", 1)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """``(loss, logits, labels)`` of a global batch: the loss of Trainer's ``compute_loss`` summed over the CP
        group (divided by cp: every CP rank's ``compute_loss`` scales by the world size, as DDP's mean expects),
        the logits ``(B, S, V)`` combined in the original order, the batch's labels."""
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        has_labels = labels is not None or inputs.get("shift_labels") is not None
        count = self._get_num_items_in_batch([inputs], self.args.device) if has_labels else None
        sharded = self._shard(inputs)
        local, count = self._counted(sharded, count, training=False)
        with torch.no_grad(), self._under(sharded), self.compute_loss_context_manager():
            if has_labels:
                loss, outputs = self.compute_loss(model, dict(local), return_outputs=True, num_items_in_batch=count)
                loss = loss.detach().mean()
                if self.cp_groups.cp_group is not None:
                    dist.all_reduce(loss, group=self.cp_groups.cp_group)
                loss = loss / self.get_cp_size()
            else:
                loss, outputs = None, model(**{k: v for k, v in local.items() if k != "labels"})
        if prediction_loss_only:
            return loss, None, None
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1 if has_labels else 0]
        logits = sharded.handler.combine(logits.detach(), 1)[:, :sharded.seq_len]
        return loss, logits, labels


def _trainer_class():
    from transformers import Trainer

    class CPTrainer(ContextParallelMixin, Trainer):
        """``transformers.Trainer`` with context parallelism (:class:`ContextParallelMixin`)."""

    return CPTrainer


def _sft_trainer_class():
    from transformers.utils.versions import require_version

    require_version("trl" + OLDEST_TRL, f"CPSFTTrainer: {extra_hint('hf')}")
    from trl import SFTTrainer

    class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
        """TRL's ``SFTTrainer`` with context parallelism (:class:`ContextParallelMixin`)."""

        router_loss_convention = "replicated"
        """TRL adds ``router_aux_loss_coef * outputs.aux_loss`` after scaling the token loss by the process count
        and logs its mean over every process: each rank holds the batch's value, its gradient cp times its share."""

        def _prepare_registered(self, model) -> None:
            super()._prepare_registered(model)
            if self.loss_normalization == "micro_batch_mean":
                self.loss_is_scaled_for_ga = True  # the count passed folds the accumulation steps in

        def _micro_batch_count(self, inputs: dict, count: torch.Tensor, training: bool):
            """TRL's loss is its token sum over the ``num_items_in_batch`` it is given, times the process count
            (``dp x cp``), plus the router loss over the accumulation steps: given ``count x dp x steps`` (steps: the
            accumulation steps in training, 1 in evaluation, where TRL without a count adds the router loss once),
            each rank's loss is ``cp`` times its share of the micro-batch's mean over the steps, as TRL's own
            without CP averaged by DDP (:attr:`loss_is_scaled_for_ga`: Trainer divides no further)."""
            steps = self.current_gradient_accumulation_steps if training else 1
            return inputs, count * self.cp_groups.dp_size * steps

        def prediction_step(self, *args, **kwargs):
            if self.loss_normalization != "micro_batch_mean":
                return super().prediction_step(*args, **kwargs)
            steps = getattr(self, "current_gradient_accumulation_steps", 1)
            self.current_gradient_accumulation_steps = 1
            try:  # TRL divides the router loss by these steps whenever it is given a count
                return super().prediction_step(*args, **kwargs)
            finally:
                self.current_gradient_accumulation_steps = steps

    return CPSFTTrainer


_LAZY = {"CPTrainer": _trainer_class, "CPSFTTrainer": _sft_trainer_class}


def __getattr__(name: str):
    """``CPTrainer`` and ``CPSFTTrainer``, built on first use (transformers / TRL imported then)."""
    if name in _LAZY:
        cls = _LAZY[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


