"""Context parallelism inside Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

A script changes two lines::

    from cp_handler.integrations.hf_trainer import CPTrainer, ContextParallelArguments
    trainer = CPTrainer(model=model, args=training_args, train_dataset=ds,
                        cp_args=ContextParallelArguments(context_parallel_size=2))

and ``torchrun --nproc-per-node N script.py`` trains with ``dp = N / cp`` (DDP over every rank, as Trainer's own).
:class:`ContextParallelMixin` goes before any ``transformers.Trainer`` subclass; :class:`CPTrainer` and
``CPSFTTrainer`` (TRL, the ``trl`` extra) are ready-made. What it does, by Trainer's public hooks:

* ``__init__``: the dp x cp groups (CP ranks adjacent), ``register(model)`` (the guard runs before step 1), the
  settings that would make the result wrong refused by name (accelerate's own CP / SP, label smoothing,
  ``compute_loss_func``, a loss without ``num_items_in_batch``, ``average_tokens_across_devices=False``,
  ``batch_rebalance``); the data loaders are split over the dp ranks only, so every rank of a CP group reads the
  same batch (the accelerator's ``prepare_data_loader``, replaced on this trainer's accelerator instance);
* ``training_step`` / ``prediction_step``: each batch sharded by :func:`~.hf_batch.shard_batch` (a handler per
  batch; packed documents as thd) and run under it; the loss is Trainer's own (``num_items_in_batch``, the global
  token count: :meth:`get_cp_size` makes Trainer divide its count over CP duplicates), so the loss and every
  gradient are those of one process on the same global batches; ``prediction_step`` returns the logits combined
  in the original token order and the batch's loss summed over the CP group;
* ``evaluation_loop``: results gathered over the dp ranks only (CP ranks hold the same batch), so ``evaluate()``
  and ``predict()`` return each example once;
* **vision-language models** (:mod:`.hf_vlm`): the batch goes in whole with its vision inputs (TRL's vision
  collator: ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ...), only the labels sharded; a model
  whose class sets ``accepts_loss_kwargs = False`` (Qwen2.5-VL, Qwen3-VL, Qwen3.5) is accepted when a probe shows
  its loss takes ``shift_labels`` and ``num_items_in_batch`` (:func:`.hf_vlm.check_loss_kwargs`; TRL's SFT loss
  divides by the count itself), and Trainer then counts and passes the global token count.

TRL's RL and preference trainers (GRPO, RLOO, DPO) build on the same base (:class:`ContextParallelTrainerBase`):
:mod:`.hf_rl_trainer`.

Trainer's private ``_prepare_context_parallel_inputs`` is not used (accelerate's CP path); no private method is
overridden. Releases: transformers 5.23 and newer, TRL 1.16 and newer (:data:`OLDEST_TRL`); not refused by number:
the behaviour the mixin relies on is probed when a trainer is built (:func:`check_token_count`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ContextParallelConfig
from ..groups import build_dp_cp_groups, destroy_process_groups
from ..handlers.registry import get_cp_handler_cls
from ..install_hint import extra_hint
from ..launch import rank_env
from ..parallel_layout import ParallelLayout, default_hierarchical_sizes
from ..tiling import tile_mlps
from .hf_batch import shard_batch
from .hf_causal import check_causal, check_decoder_only
from .hf_dp import gather_over_dp, prepare_data_loader_over_dp
from .hf_inputs import text_config
from .hf_router_loss import RouterLossScope, active_scope, router_loss_scope
from .hf_vlm import check_loss_kwargs, is_vision_language
from .transformers import cp_attention, register

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


@dataclass
class ContextParallelArguments:
    """CP settings of a Trainer run (:class:`~cp_handler.config.ContextParallelConfig`'s field names; usable with
    ``HfArgumentParser``). ``cp_comm_type`` may list one type per layer, comma-separated; ``"auto"`` picks the
    pattern per batch from ``cp_comm_profile`` (docs/auto_plan.md). ``mlp_chunk_tokens``: the model's MLPs tiled
    over chunks of that many tokens (:func:`~cp_handler.tiling.tile_mlps`; ``None``: whole)."""

    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    hierarchical_context_parallel_sizes: list[int] | None = None
    backend: str = "local"
    mlp_chunk_tokens: int | None = None
    cp_comm_profile: str | None = None

    def config(self) -> ContextParallelConfig:
        """The validated config; under torchrun, ``hierarchical_context_parallel_sizes`` default to the node boundary
        (:func:`~cp_handler.parallel_layout.default_hierarchical_sizes`). Raises ValueError / TypeError naming the
        field."""
        types = self.cp_comm_type.split(",") if isinstance(self.cp_comm_type, str) else self.cp_comm_type
        comm_type = types[0] if len(types) == 1 else types
        sizes, env = self.hierarchical_context_parallel_sizes, rank_env()
        if sizes is None and env is not None and self.context_parallel_size >= 1 and \
                env.world_size % self.context_parallel_size == 0:
            layout = ParallelLayout(env.world_size, context_parallel_size=self.context_parallel_size)
            sizes = default_hierarchical_sizes(comm_type, layout, env.local_world_size)
        return ContextParallelConfig(context_parallel_size=self.context_parallel_size, cp_comm_type=comm_type,
                                     hierarchical_context_parallel_sizes=sizes, backend=self.backend,
                                     cp_comm_profile=self.cp_comm_profile)


@functools.cache
def _release_groups_at_exit() -> None:
    """Once per process: :func:`~cp_handler.groups.destroy_process_groups` when the script ends (the DeviceMesh
    groups of the dp x cp layout are freed while the interpreter is alive; left to its shutdown, a gloo worker
    thread can abort the process: "terminate called without an active exception", docs/testing.md)."""
    atexit.register(lambda: dist.is_initialized() and destroy_process_groups())


@dataclass
class _Groups:
    cp_group: dist.ProcessGroup | None
    hierarchical_cp_groups: list
    dp_size: int
    dp_rank: int


class ContextParallelTrainerBase:
    """What every Trainer under context parallelism shares: the dp x cp groups, ``register(model)``, the settings
    refused by name (:meth:`_refused_settings`), data loaders over the dp ranks, evaluation gathered over dp.
    :class:`ContextParallelMixin` (Trainer, SFT) and :mod:`.hf_rl_trainer` (GRPO, RLOO, DPO) build on it.

    Raises:
        ValueError: a setting refused by name, a world size not a multiple of the CP size, the model's guard
            (``register``), a model that is not a causal language model; before any training step.
    """

    def __init__(self, *args, cp_args: ContextParallelArguments, **kwargs):
        self.cp_config = cp_args.config()
        get_cp_handler_cls(self.cp_config.backend, self.cp_config.cp_comm_type).check_available()
        super().__init__(*args, **kwargs)
        refused = self._refused_settings()
        if refused:
            raise ValueError(f"{type(self).__name__}: refused under context parallelism: " + "; ".join(refused))
        self.cp_groups = self._build_groups()
        model = self.accelerator.unwrap_model(self.model)
        check_decoder_only(model)
        self.own_attn_implementation = text_config(model)._attn_implementation
        """The model's attention implementation before ``register`` (what generation outside CP runs)."""
        register(model)
        check_causal(model)
        self._prepare_registered(model)
        if cp_args.mlp_chunk_tokens is not None:
            tile_mlps(model, cp_args.mlp_chunk_tokens)
        self.accelerator.prepare_data_loader = self._prepare_data_loader_over_dp
        self._check_releases()

    def _check_releases(self) -> None:
        """The behaviour of the installed transformers (and TRL) the trainer relies on, probed once it is built
        (default: nothing)."""

    def _prepare_registered(self, model) -> None:
        """What a subclass adds once the model is registered (default: nothing)."""

    def _build_groups(self) -> _Groups:
        """The dp x cp groups (one process: cp must be 1)."""
        cp = self.cp_config.context_parallel_size
        if dist.is_initialized():
            built = build_dp_cp_groups(cp, self.args.device.type, self.cp_config.hierarchical_context_parallel_sizes)
            _release_groups_at_exit()
            return _Groups(built.cp_group, built.hierarchical_cp_groups, built.dp_size, built.dp_rank)
        if cp > 1:
            raise ValueError(f"context_parallel_size={cp}: no process group; run under torchrun (TrainingArguments "
                             "starts it)")
        return _Groups(None, [], 1, 0)

    def _refused_settings(self) -> list[str]:
        """The settings that would make the result wrong, each ``"name=value (why)"`` (empty: none)."""
        refused = []
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        for name in ("cp_size", "sp_size"):
            if getattr(parallelism, name, 1) > 1:
                refused.append(f"parallelism_config.{name}={getattr(parallelism, name)} (accelerate's own context / "
                               "sequence parallelism: two CP layers at once)")
        if getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance":
            refused.append("train_sampling_strategy='batch_rebalance' (it splits batches over every rank)")
        if self.accelerator.dispatch_batches:
            refused.append("accelerator_config dispatch_batches=True (rank 0 would split each batch over every rank)")
        return refused

    def get_cp_size(self) -> int:
        """The CP size (Trainer divides its global token count and its dp world size by it)."""
        return self.cp_config.context_parallel_size

    def evaluation_loop(self, *args, **kwargs):
        """Trainer's loop with its gather over the dp ranks only (:func:`.hf_dp.gather_over_dp`)."""
        if self.args.eval_use_gather_object:
            raise ValueError("eval_use_gather_object=True is not implemented under context parallelism")
        self.gather_function = self._gather_over_dp  # the loop resets it to gather_for_metrics when done
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_dp(self, tensors):
        return gather_over_dp(self.accelerator, self.get_cp_size(), tensors)

    def _prepare_data_loader_over_dp(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        return prepare_data_loader_over_dp(self.accelerator, self.cp_groups.dp_size, self.cp_groups.dp_rank,
                                           data_loader, device_placement, slice_fn_for_dispatch)


class ContextParallelMixin(ContextParallelTrainerBase):
    """Context parallelism for a ``transformers.Trainer`` subclass (module doc): ``class MyTrainer(
    ContextParallelMixin, Trainer)``, built with ``cp_args=ContextParallelArguments(...)``.

    Raises:
        ValueError: a setting refused by name (module doc), a world size not a multiple of the CP size, the model's
            guard (``register``), a model that is not a causal language model; before any training step.
    """

    router_loss_convention = "share"
    """How a MoE model's load-balancing loss reaches the loss (:mod:`.hf_router_loss`): Trainer takes the model's
    own loss, a sum of shares."""

    def _prepare_registered(self, model) -> None:
        self.vision_language = is_vision_language(model)
        if self.vision_language and not self.model_accepts_loss_kwargs:
            check_loss_kwargs(model)  # its loss takes the global token count: Trainer passes it
            self.model_accepts_loss_kwargs = True

    def _check_releases(self) -> None:
        check_token_count(self)

    def _refused_settings(self) -> list[str]:
        args, refused = self.args, super()._refused_settings()
        if args.label_smoothing_factor:
            refused.append(f"label_smoothing_factor={args.label_smoothing_factor} (its smoother shifts the labels "
                           "of each rank's shard)")
        if not args.average_tokens_across_devices:
            refused.append("average_tokens_across_devices=False (the loss is normalised by the global token count)")
        if self.compute_loss_func is not None:
            refused.append("compute_loss_func (it would receive this rank's shard of the labels, already shifted in "
                           "global order, and the shard's logits)")
        elif not self.model_accepts_loss_kwargs and not is_vision_language(self.accelerator.unwrap_model(self.model)):
            refused.append(f"a model whose forward takes no num_items_in_batch ({type(self.model).__name__}: its loss "
                           "would be each rank's own mean)")
        return refused

    def _shard(self, inputs: dict):
        return shard_batch(inputs, self.cp_config, self.cp_groups.cp_group, self.cp_groups.hierarchical_cp_groups,
                           vision_language=self.vision_language)

    @contextlib.contextmanager
    def _under(self, sharded):
        """The batch's handler active, its real tokens known to the router loss (over the CP group:
        :mod:`.hf_router_loss`) and to :meth:`compute_loss`."""
        scope = RouterLossScope(self.cp_groups.cp_group, sharded.token_mask, self.router_loss_convention)
        with cp_attention(sharded.handler), router_loss_scope(scope):
            yield

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step on this rank's shard of the batch, under its handler."""
        sharded = self._shard(self._prepare_inputs(inputs))
        with self._under(sharded):
            return super().training_step(model, sharded.inputs, num_items_in_batch)

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
        with torch.no_grad(), self._under(sharded), self.compute_loss_context_manager():
            if has_labels:
                loss, outputs = self.compute_loss(model, dict(sharded.inputs), return_outputs=True,
                                                  num_items_in_batch=count)
                loss = loss.detach().mean()
                if self.cp_groups.cp_group is not None:
                    dist.all_reduce(loss, group=self.cp_groups.cp_group)
                loss = loss / self.get_cp_size()
            else:
                loss, outputs = None, model(**{k: v for k, v in sharded.inputs.items() if k != "labels"})
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

    return CPSFTTrainer


_LAZY = {"CPTrainer": _trainer_class, "CPSFTTrainer": _sft_trainer_class}


def __getattr__(name: str):
    """``CPTrainer`` and ``CPSFTTrainer``, built on first use (transformers / TRL imported then)."""
    if name in _LAZY:
        cls = _LAZY[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


