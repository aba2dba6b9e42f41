"""Context parallelism in TRL's RL and preference trainers: ``CPGRPOTrainer``, ``CPRLOOTrainer``, ``CPDPOTrainer``.

A script changes two lines::

    from cp_handler.integrations.hf_rl_trainer import CPGRPOTrainer
    trainer = CPGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                            cp_args=ContextParallelArguments(context_parallel_size=2))

and ``torchrun --nproc-per-node N`` trains with ``dp = N / cp``: the result is TRL's with ``dp`` processes, each
sequence's forward and backward split over its CP group. What :class:`ContextParallelRLMixin` does:

* **data over dp** (:class:`~.hf_trainer_base.ContextParallelTrainerBase`): the ranks of a CP group read the same
  prompts (GRPO, RLOO) or preference pairs (DPO); GRPO's and RLOO's generation batch, which TRL sizes with the
  world size, is sized with the dp size (``per_device_train_batch_size x dp x steps_per_generation``); the random
  state is seeded per dp rank (TRL seeds per process), so a group shuffles its completions alike;
* **generation outside CP, once per group**: the group's first rank generates (HF ``generate`` with the model's own
  attention, :func:`~.transformers.own_attention`) and broadcasts the completions to the group, with the random state
  sampling left (the group shuffles its completions alike);
* **scoring on shards**: every fused-head call of the trainer (policy, reference and old-policy log-probabilities and
  entropies; DPO's chosen and rejected rows) runs on this rank's shard with labels shifted in global order and
  returns TRL's whole-row outputs (:mod:`.hf_fused_head`): TRL's loss code then runs unchanged, with its
  temperature, its loss types and its per-sequence terms, on every rank of the group;
* **TRL's bookkeeping over dp**: inside the trainer's generation-and-scoring, loss and reference-precompute methods,
  TRL's collectives see the dp ranks (:meth:`.hf_dp.DataParallelView.scope`): rewards grouped by ``num_generations``
  over the distinct completions, each rank's slice by its dp index, the loss denominators (``num_items_in_batch``, the
  process count) and every logged metric as with ``dp`` processes.

Refused by name before TRL's ``__init__`` runs (from the constructor's arguments: TRL would act on some, set up vLLM,
demand a chat template for tools): vLLM (its server and colocate modes gather over every process), continuous
batching, tools and environments (a tool run on every rank of a group could return different results), a custom
``rollout_func``, a PEFT model or ``peft_config``, Liger kernels, FSDP / DeepSpeed (sharded weights: generation on one
rank would wait for the others; set by the arguments or by ``accelerate launch``'s environment), a vision-language
model, a model switched to cp_handler's attention already, a generation batch split across groups of
``num_generations``, the model's guard (on a copy); after it, what only the built trainer shows (a model loaded from
its name) and a model whose left-padded forward is not its real tokens' alone
(:func:`.hf_fused_head.left_padding_positions`). Tested with TRL 1.16 (:data:`~.hf_trainer.OLDEST_TRL` and newer).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core.install_hint import extra_hint
from .hf_fused_head import install_cp_fused_head, left_padding_positions
from .hf_inputs import text_config
from .hf_trainer import OLDEST_TRL
from .hf_trainer_base import ContextParallelTrainerBase
from .hf_vlm import is_vision_language
from .transformers import ATTN_IMPLEMENTATION, own_attention, register


class ContextParallelRLMixin(ContextParallelTrainerBase):
    """Context parallelism for TRL's GRPO, RLOO and DPO trainers (module doc): ``class MyTrainer(
    ContextParallelRLMixin, GRPOTrainer)``, built with ``cp_args=ContextParallelArguments(...)``.

    Raises:
        ValueError: a setting refused by name (module doc), a generation batch that does not hold whole groups of
            ``num_generations`` at the dp size, the model's guard; before any training step.
    """

    exact_divides_world = False
    """The fused head leaves each rank's gradient unscaled by cp under exact sums, which are divided by dp: exact at
    any world (:mod:`.hf_exact_grads`)."""

    def _refused_arguments(self, args, arguments: dict) -> list[str]:
        refused = super()._refused_arguments(args, arguments)
        if getattr(args, "use_vllm", False):
            refused.append("use_vllm=True (vLLM's generation gathers prompts over every process, not per CP group)")
        if getattr(args, "use_transformers_continuous_batching", False):
            refused.append("use_transformers_continuous_batching=True (not tested under context parallelism)")
        if arguments.get("tools") or arguments.get("environment_factory"):
            refused.append("tools / environment_factory (each rank of a CP group would run the tools: their results "
                           "could differ)")
        if arguments.get("rollout_func") is not None:
            refused.append("rollout_func (a custom generation on every rank of a CP group: not implemented)")
        if getattr(args, "use_liger_kernel", False):
            refused.append("use_liger_kernel=True (Liger replaces modules cp_handler routes)")
        model = arguments.get("model")
        implementation = text_config(model)._attn_implementation if isinstance(model, torch.nn.Module) else "name"
        if implementation in (None, ATTN_IMPLEMENTATION):  # a model loaded from its name: checked once loaded
            refused.append(_ATTENTION_SET.format(implementation))
        refused += _generation_batch_refusals(args, self.cp_config.context_parallel_size)
        launcher = any(os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"
                       for name in ("FSDP", "DEEPSPEED"))  # what `accelerate launch` sets, read by accelerate's state
        refused += _model_refusals(bool(getattr(args, "fsdp", None) or getattr(args, "deepspeed", None) or launcher),
                                   model,
                                   arguments.get("peft_config") is not None)
        if self.cp_args.loss_normalization is not None:
            refused.append(f"ContextParallelArguments.loss_normalization={self.cp_args.loss_normalization!r} (the RL "
                           "trainers keep TRL's own loss normalisation)")
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        if getattr(args, "precompute_ref_log_probs", False) and world > 1:
            refused += [f"precompute_ref_log_probs=True with {name} held in memory (TRL caches the log-probs in a file "
                        "that only the main process writes, in a temporary folder of its own for a dataset without "
                        "cache files: the other ranks cannot read it, as with TRL alone at dp > 1); save it with "
                        "save_to_disk and pass load_from_disk's dataset"
                        for name in ("train_dataset", "eval_dataset") if _in_memory(arguments.get(name))]
        return refused

    def _refused_settings(self) -> list[str]:
        """What only the built trainer shows: FSDP / DeepSpeed set by the launcher's environment, a model TRL loaded
        from its name or wrapped (:meth:`_refused_arguments` refused what the arguments say)."""
        return super()._refused_settings() + _model_refusals(
            self.is_fsdp_enabled or self.is_deepspeed_enabled, self.accelerator.unwrap_model(self.model))

    def _prepare_registered(self, model) -> None:
        self._prepare_generation()
        implementation = self.own_attn_implementation
        if implementation in (None, ATTN_IMPLEMENTATION):  # a model TRL loaded from its name
            self._refuse([_ATTENTION_SET.format(implementation)])
        plan = (self.cp_config, self.cp_groups.cp_group, self.cp_groups.hierarchical_cp_groups,
                left_padding_positions(model, implementation))
        install_cp_fused_head(model, *plan, exact=self.exact_grads)
        ref_model = getattr(self, "ref_model", None)
        if ref_model is not None:
            ref_model = self.accelerator.unwrap_model(ref_model)
            register(ref_model)
            install_cp_fused_head(ref_model, *plan)

    def _prepare_generation(self) -> None:
        """GRPO / RLOO: the generation batch sized with the dp size (TRL sized it with the world size), and the
        random state seeded per dp rank (TRL seeds ``seed + process_index``: the ranks of a CP group would shuffle
        their shared completions differently)."""
        from accelerate.utils import set_seed

        args, dp = self.args, self.cp_groups.dp_size
        if getattr(args, "generation_batch_size", None) is None:
            return
        set_seed(args.seed + self.cp_groups.dp_rank)
        args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's generation on the CP group's first rank, with the model's own attention; the completions, and the
        random state sampling left on that rank, broadcast to the group (the group then shuffles its completions
        alike)."""
        group = self.cp_groups.cp_group
        model = self.accelerator.unwrap_model(self.model)
        if group is None or dist.get_world_size(group) == 1:
            with own_attention(model, self.own_attn_implementation):
                return super()._generate_single_turn(*args, **kwargs)
        shared = [None]
        if dist.get_rank(group) == 0:
            with own_attention(model, self.own_attn_implementation):
                shared = [(super()._generate_single_turn(*args, **kwargs), _rng_state())]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        result, state = shared[0]
        _set_rng_state(state)
        return result

    def _generate_and_score_completions(self, *args, **kwargs):
        with self.dp_view.scope():
            return super()._generate_and_score_completions(*args, **kwargs)

    def _compute_loss(self, *args, **kwargs):
        with self.dp_view.scope():
            return super()._compute_loss(*args, **kwargs)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """DPO's reference log-probs of ``dataset`` under CP, TRL's bookkeeping over dp. TRL precomputes inside its
        ``__init__`` (``precompute_ref_log_probs=True``), before this mixin has split the data loaders over the dp
        ranks and put the model under CP: such a call returns the dataset as it is and is run again, as TRL would
        have, once the trainer is ready (:meth:`_when_ready`)."""
        if not self.cp_ready:
            self.__dict__.setdefault("_deferred_precompute", []).append((name, batch_size))
            return dataset
        with self.dp_view.scope():
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def _when_ready(self) -> None:
        """TRL's deferred precomputation (:meth:`_precompute_ref_logps`) in TRL's order: the train dataset's first,
        then the eval dataset's (or each of a dict's, by its name), assigned where TRL assigns them."""
        for index, (name, batch_size) in enumerate(self.__dict__.pop("_deferred_precompute", [])):
            if index == 0:
                self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
            elif isinstance(self.eval_dataset, dict):
                self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)
            else:
                self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)


def _in_memory(dataset) -> bool:
    """Whether ``dataset`` (a ``datasets.Dataset``, or a dict of them) has a dataset without cache files (held in
    memory: ``Dataset.from_list``, ``from_dict``)."""
    if isinstance(dataset, dict):
        return any(_in_memory(d) for d in dataset.values())
    return hasattr(dataset, "cache_files") and not dataset.cache_files


_ATTENTION_SET = ("a model whose attn_implementation is {!r} already (pass it with its own attention, e.g. 'sdpa': "
                  "generation runs outside context parallelism with it)")


def _generation_batch_refusals(args, cp: int) -> list[str]:
    """GRPO / RLOO: the generation batch at the dp size (what :meth:`ContextParallelRLMixin._prepare_generation` sets)
    must hold whole groups of ``num_generations`` (the world size from the launcher's environment: the groups are
    not built yet)."""
    if getattr(args, "generation_batch_size", None) is None or not getattr(args, "num_generations", None):
        return []
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world % cp:
        return []  # the world size's own refusal comes when the groups are built
    batch = args.per_device_train_batch_size * (world // cp) * args.steps_per_generation
    if batch % args.num_generations == 0:
        return []
    return [f"generation_batch_size = per_device_train_batch_size ({args.per_device_train_batch_size}) x dp "
            f"({world // cp}) x steps_per_generation ({args.steps_per_generation}) = {batch}, not a multiple of "
            f"num_generations ({args.num_generations}): the groups would be split"]


def _model_refusals(sharded: bool, model, peft_config: bool = False) -> list[str]:
    """FSDP / DeepSpeed, a PEFT model (or ``peft_config``) and a vision-language model, refused (``model``: a module,
    or the name TRL would load it from: checked once loaded)."""
    refused = []
    if sharded:
        refused.append("FSDP / DeepSpeed (sharded weights: one rank of a CP group generates alone)")
    if peft_config or hasattr(model, "peft_config"):
        refused.append(f"a PEFT model ({type(model).__name__}: not tested under context parallelism)")
    if isinstance(model, torch.nn.Module) and is_vision_language(model):
        refused.append(f"a vision-language model ({type(model).__name__}: its RL inputs are not sharded)")
    return refused


def _rng_state() -> dict:
    """torch's random state (CPU, and the current CUDA device's when there is one)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _trl_class(name: str):
    from transformers.utils.versions import require_version

    require_version("trl" + OLDEST_TRL, f"CP{name}: {extra_hint('hf')}")
    import trl

    base = getattr(trl, name)
    return type(f"CP{name}", (ContextParallelRLMixin, base),
                {"__doc__": f"TRL's ``{name}`` with context parallelism (:class:`ContextParallelRLMixin`).",
                 "__module__": __name__})


_LAZY = {"CPGRPOTrainer": "GRPOTrainer", "CPRLOOTrainer": "RLOOTrainer", "CPDPOTrainer": "DPOTrainer"}


def __getattr__(name: str):
    """``CPGRPOTrainer``, ``CPRLOOTrainer`` and ``CPDPOTrainer``, built on first use (TRL imported then)."""
    if name in _LAZY:
        cls = _trl_class(_LAZY[name])
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
