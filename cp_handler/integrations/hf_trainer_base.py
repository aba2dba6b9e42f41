"""What every Hugging Face trainer under context parallelism shares (:class:`ContextParallelTrainerBase`): its
settings (:class:`ContextParallelArguments`), the dp x cp groups, ``register(model)``, the settings refused by name
before the wrapped trainer acts, the data loaders over the dp ranks and evaluation gathered over them.
:mod:`.hf_trainer` (Trainer, TRL's SFTTrainer) and :mod:`.hf_rl_trainer` (GRPO, RLOO, DPO) build on it."""

from __future__ import annotations

import atexit
import functools
import inspect
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from ..handlers.registry import get_cp_handler_cls
from ..models.tiling import tile_mlps
from ..runtime.config import ContextParallelConfig
from ..runtime.groups import build_dp_cp_groups, destroy_process_groups
from ..runtime.launch import rank_env
from ..runtime.parallel_layout import ParallelLayout, default_hierarchical_sizes
from . import hf_exact_grads
from .hf_causal import check_causal, check_decoder_only
from .hf_dp import DataParallelView
from .hf_inputs import text_config
from .transformers import check_architecture, register

LOSS_NORMALIZATIONS = ("micro_batch_mean", "global_token_count")
"""How the token loss is normalised (``ContextParallelArguments.loss_normalization``): each micro-batch's mean (what the
plain Trainer does for a model that takes no ``num_items_in_batch``, Qwen-VL's classes among them: averaged over the
accumulation steps and the dp ranks), or the token sum over the step's global token count (what it does for a model
that takes it, every text model of transformers)."""

@dataclass
class ContextParallelArguments:
    """CP settings of a Trainer run (:class:`~cp_handler.runtime.config.ContextParallelConfig`'s field names;
    usable with ``HfArgumentParser``). ``cp_comm_type`` may list one type per layer, comma-separated; ``"auto"``
    picks the pattern per batch from ``cp_comm_profile`` (docs/auto_plan.md). ``mlp_chunk_tokens``: the model's MLPs
    tiled over chunks of that many tokens (:func:`~cp_handler.models.tiling.tile_mlps`; ``None``: whole).
    ``loss_normalization``: :data:`LOSS_NORMALIZATIONS` (CPTrainer / CPSFTTrainer; the RL trainers keep TRL's)."""

    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    hierarchical_context_parallel_sizes: list[int] | None = None
    backend: str = "local"
    mlp_chunk_tokens: int | None = None
    cp_comm_profile: str | None = None
    loss_normalization: str | None = None
    """One of :data:`LOSS_NORMALIZATIONS`; ``None`` (default): the plain trainer's for this model, so a run equals the
    trainer the user would run without CP, gradient accumulation included."""
    deterministic: bool = False
    """The deterministic mode (``ContextParallelConfig.deterministic``, docs/deterministic.md): the logits, and the RL
    trainers' per-token log-probabilities and entropies, bitwise the same at every CP degree; ``cp_comm_type="a2a"``
    runs every case (sinks too), the other patterns rows whose lengths their canonical tiles divide."""

    def config(self) -> ContextParallelConfig:
        """The validated config; under torchrun, ``hierarchical_context_parallel_sizes`` default to the node boundary
        (:func:`~cp_handler.runtime.parallel_layout.default_hierarchical_sizes`). Raises ValueError / TypeError
        naming the field."""
        types = self.cp_comm_type.split(",") if isinstance(self.cp_comm_type, str) else self.cp_comm_type
        comm_type = types[0] if len(types) == 1 else types
        sizes, env = self.hierarchical_context_parallel_sizes, rank_env()
        if sizes is None and env is not None and self.context_parallel_size >= 1 and \
                env.world_size % self.context_parallel_size == 0:
            layout = ParallelLayout(env.world_size, context_parallel_size=self.context_parallel_size)
            sizes = default_hierarchical_sizes(comm_type, layout, env.local_world_size)
        return ContextParallelConfig(context_parallel_size=self.context_parallel_size, cp_comm_type=comm_type,
                                     hierarchical_context_parallel_sizes=sizes, backend=self.backend,
                                     cp_comm_profile=self.cp_comm_profile, deterministic=self.deterministic)


def _accelerate_refusals(parallelism_config, dispatch_batches, model=None) -> list[str]:
    """accelerate's settings that split what a CP group shares: its own CP / SP sizes and ``dispatch_batches``
    (as the arguments give them, or as the built accelerator derived them); and tensor parallelism, accelerate's
    (``tp_size``) or a model loaded split (transformers' ``from_pretrained(tp_plan=...)``: its ``tp_size``): the CP
    groups are built over dp x cp, not beside a TP mesh (``cp-train --tp-size`` runs TP x CP)."""
    refused = []
    tp_size = getattr(parallelism_config, "tp_size", 1) or 1
    if tp_size > 1:
        refused.append(f"parallelism_config.tp_size={tp_size} (accelerate's tensor parallelism: the CP groups are "
                       "built over dp x cp, not beside a TP mesh; cp-train --tp-size runs TP x CP)")
    model_tp = None if isinstance(model, str) else getattr(model, "tp_size", None)
    if isinstance(model_tp, int) and model_tp > 1:
        refused.append(f"a model loaded with tensor parallelism (tp_size={model_tp}: the CP groups are built over dp x "
                       "cp, not beside its TP mesh; cp-train --tp-size runs TP x CP)")
    for name in ("cp_size", "sp_size"):
        size = getattr(parallelism_config, name, 1) or 1
        if size > 1:
            refused.append(f"parallelism_config.{name}={size} (accelerate's own context / sequence parallelism: "
                           "two CP layers at once)")
    if dispatch_batches:
        refused.append("accelerator_config dispatch_batches=True (rank 0 would split each batch over every rank)")
    return refused


@functools.cache
def _release_groups_at_exit() -> None:
    """Once per process: :func:`~cp_handler.runtime.groups.destroy_process_groups` when the script ends (the DeviceMesh
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
        self.cp_args, self.cp_config = cp_args, cp_args.config()
        get_cp_handler_cls(self.cp_config.backend, self.cp_config.cp_comm_type).check_available()
        arguments = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        self._refuse(self._refused_arguments(arguments.get("args"), arguments))  # before the wrapped trainer acts
        if isinstance(arguments.get("model"), nn.Module):
            self._check_model(arguments["model"])
        self.cp_ready = False
        """Whether the groups, the registered model and the data loaders over dp are in place (what the wrapped
        trainer's ``__init__`` runs before them can wait for them: :meth:`_when_ready`)."""
        super().__init__(*args, **kwargs)
        self._refuse(self._refused_settings())
        self.cp_groups = self._build_groups()
        model = self.accelerator.unwrap_model(self.model)
        check_decoder_only(model)
        self.own_attn_implementation = text_config(model)._attn_implementation
        """The model's attention implementation before ``register`` (what generation outside CP runs)."""
        register(model)
        check_causal(model)
        self.exact_grads = hf_exact_grads.build(self, model)
        """The deterministic mode's exact parameter gradients (:mod:`.hf_exact_grads`), or ``None`` (outside the mode,
        or where they cannot be built: ``exact_gradients_refusal`` says why)."""
        self._prepare_registered(model)
        if cp_args.mlp_chunk_tokens is not None:
            tile_mlps(model, cp_args.mlp_chunk_tokens)
        self.dp_view = DataParallelView(self, self.get_cp_size(), self.cp_groups.dp_size, self.cp_groups.dp_rank)
        """The adapter showing accelerate and TRL the dp ranks as their processes (:class:`.hf_dp.DataParallelView`)."""
        self.dp_view.install()
        self._check_releases()
        self.cp_ready = True
        self._when_ready()

    def _check_model(self, model: nn.Module) -> None:
        """The model's guard before the wrapped trainer's ``__init__`` (which would tokenise the dataset, build a
        reference model or set up generation first): decoder-only, and the architecture on a copy built from its
        config (:func:`~.transformers.check_architecture`: every check, forward probes included, for a model of at
        most ``FULL_CHECK_PARAMETERS`` parameters; the static ones above, whose forward probes run on the model
        itself once the trainer is built, as every check does again), then :meth:`_check_model_copy`. The model and
        its config are not changed. A module that is not a transformers model is checked once the trainer is
        built."""
        check_decoder_only(model)
        if getattr(type(model), "_from_config", None) is None or getattr(model, "config", None) is None:
            return
        built = check_architecture(model.config, type(model))
        if built is not None:
            self._check_model_copy(built)

    def _check_model_copy(self, model: nn.Module) -> None:
        """What a subclass checks before the wrapped trainer's ``__init__`` on the registered float32 copy of the
        model (random weights; default: nothing)."""

    def _when_ready(self) -> None:
        """What runs once the trainer is ready for context parallelism (default: nothing)."""

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

    def _refuse(self, refused: list[str]) -> None:
        if refused:
            raise ValueError(f"{type(self).__name__}: refused under context parallelism: " + "; ".join(refused))

    def _refused_arguments(self, args, arguments: dict) -> list[str]:
        """The settings that would make the result wrong, read from the constructor's arguments before the wrapped
        trainer's ``__init__`` runs (it would act on some: set up vLLM, load a PEFT adapter, precompute), each
        ``"name=value (why)"`` (empty: none). ``args``: the ``TrainingArguments`` given (``None``: the trainer's
        defaults, which refuse nothing); ``arguments``: every argument by name."""
        refused = _accelerate_refusals(getattr(args, "parallelism_config", None),
                                       getattr(getattr(args, "accelerator_config", None), "dispatch_batches", None),
                                       arguments.get("model"))
        if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
            refused.append("train_sampling_strategy='batch_rebalance' (it splits batches over every rank)")
        return refused

    def _refused_settings(self) -> list[str]:
        """What only the built trainer shows (a setting accelerate derived, a model loaded from its name), refused
        the same way (:meth:`_refused_arguments` has refused what the arguments say)."""
        return _accelerate_refusals(getattr(self.accelerator, "parallelism_config", None),
                                    self.accelerator.dispatch_batches)

    exact_divides_world = True
    """Whether the trainer scales each rank's loss by the world size for DDP's mean (Trainer's convention), so that its
    exact gradient sums are divided by the world (exact on a power of two only); the RL trainers divide by dp
    (:mod:`.hf_exact_grads`)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The wrapped trainer's step; in the deterministic mode with exact gradients, inside their scope with DDP
        not syncing, the exact sums written to ``.grad`` after the step's last micro-batch (:mod:`.hf_exact_grads`)."""
        if self.exact_grads is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return self.exact_grads.training_step(self.accelerator, model,
                                              lambda: super(ContextParallelTrainerBase, self).training_step(
                                                  model, inputs, num_items_in_batch))

    def get_cp_size(self) -> int:
        """The CP size (Trainer divides its global token count and its dp world size by it)."""
        return self.cp_config.context_parallel_size

    def evaluation_loop(self, *args, **kwargs):
        """Trainer's loop with its gather over the dp ranks only (``DataParallelView.gather_for_metrics``)."""
        if self.args.eval_use_gather_object:
            raise ValueError("eval_use_gather_object=True is not implemented under context parallelism")
        self.gather_function = self.dp_view.gather_for_metrics  # the loop resets it to gather_for_metrics when done
        return super().evaluation_loop(*args, **kwargs)
