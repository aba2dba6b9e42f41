"""Every private name of transformers, TRL and accelerate the integration relies on, and every upstream name it
replaces or rebinds, in one place.

The trainers work through public hooks wherever one exists (Trainer's overridable methods ``compute_loss``,
``training_step``, ``prediction_step``, ``evaluation_loop``, ``get_cp_size``; accelerate's ``Accelerator`` as the
trainer's attribute and its public ``prepare_data_loader``). What is left reaches a private name: a method TRL has
no public hook for, an attribute a count lives in, a module global TRL calls directly. Each is listed here with
what cp_handler does with it (:data:`PRIVATE_NAMES`; a method with its parameter names). Beside them, the public
module globals of transformers that the integration replaces or rebinds (:data:`REPLACED_NAMES`): the
load-balancing loss (routed for the process's life, the original itself outside a handler) and the hybrid mixers'
kernels (rebound in a copy of one instance's forward; transformers' modules untouched). :func:`missing` says which
of them a release no longer has or has changed (a method's parameters), and tests/test_hf_upstream.py fails naming
them (and fails too when a trainer overrides a private method that is not listed here).

Where the adaptations live: :class:`~.hf_dp.DataParallelView` (one per trainer) holds those of the data-parallel
view (the loaders, the metrics' gather, TRL's module-level gathers); two more are scoped by what they serve and
not by the data-parallel view, so they stay beside it: SFT's token recount (``_total_train_tokens``, ``_metrics``:
SFTTrainer's logged figure, :mod:`.hf_trainer`) and the deterministic mode's per-unit fused head
(``_ChunkedLogProbFunction`` for a ``with`` block, :mod:`.hf_exact_grads`). The loaders are made over the dp ranks
at accelerate's ``prepare_data_loader`` of the trainer's accelerator rather than in Trainer's
``get_train_dataloader`` / ``get_eval_dataloader`` / ``get_test_dataloader``: every loader of Trainer and of TRL's
trainers (GRPO's, DPO's reference pass) goes through it, where overriding the three getters would miss TRL's own.

Checked against: :data:`CHECKED_AGAINST`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

CHECKED_AGAINST = "transformers 5.25.0, TRL 1.16.0, accelerate 1.16.0"
"""The releases tests/test_hf_upstream.py and the trainer tests ran on when this list was last changed (CI
installs the newest the index has: the test runs on every release CI meets)."""


@dataclass(frozen=True)
class PrivateName:
    """A private name of an upstream library that cp_handler uses.

    Attributes:
        owner: the dotted path of its class or module (``"trl.GRPOTrainer"``, ``"accelerate.data_loader"``).
        name: the private name.
        use: ``"overridden"`` (a method of the class cp_handler's trainers replace, calling it via ``super()``),
            ``"called"``, ``"attribute"`` (an instance attribute read or written: the owner's source must set it),
            ``"module global"`` (a module-level name of the owner replaced for a block), ``"routed"`` (a module-level
            function replaced for the process's life by one that is the original outside a handler) or
            ``"rebound"`` (a module-level name a copy of an instance's forward binds to a route).
        by: where and why (the cp_handler module).
        parameters: a method's parameter names in the releases checked (``None``: not a method); a release that
            renames, adds or drops one is reported, as a missing name is.
    """

    owner: str
    name: str
    use: str
    by: str
    parameters: tuple[str, ...] | None = None

    def problem(self) -> str | None:
        """What the installed release changed (``None``: nothing): the name gone (an attribute: its owner's source
        no longer names it), or a method's parameters other than :attr:`parameters`."""
        module_name, _, attribute = self.owner.rpartition(".")
        try:
            owner = importlib.import_module(self.owner)
        except ImportError:
            owner = getattr(importlib.import_module(module_name), attribute, None)
        if owner is None:
            return "its owner is gone"
        if self.use == "attribute":
            return None if f".{self.name}" in inspect.getsource(owner) else "no longer set"
        if not hasattr(owner, self.name):
            return "gone"
        if self.parameters is not None:
            now = tuple(inspect.signature(getattr(owner, self.name)).parameters)
            if now != self.parameters:
                return f"parameters now {now}, checked with {self.parameters}"
        return None


_RL = "hf_rl_trainer: the rollout and its loss on the CP shards, log-probs over the group"
_TURN = ("self", "prompt_ids", "images", "multimodal_fields")

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("trl.GRPOTrainer", "_generate_single_turn", "overridden", _RL, (*_TURN, "num_generations",
                                                                                "has_tool_images")),
    PrivateName("trl.RLOOTrainer", "_generate_single_turn", "overridden", _RL, _TURN),
    *(PrivateName(f"trl.{trainer}", name, "overridden", _RL, parameters)
      for trainer in ("GRPOTrainer", "RLOOTrainer")
      for name, parameters in (("_generate_and_score_completions", ("self", "inputs")),
                               ("_compute_loss", ("self", "model", "inputs")))),
    PrivateName("trl.DPOTrainer", "_compute_loss", "overridden", _RL, ("self", "model", "inputs", "return_outputs")),
    PrivateName("trl.DPOTrainer", "_precompute_ref_logps", "overridden",
                "hf_rl_trainer: the reference log-probs precomputed over the dp ranks (TRL does it in __init__)",
                ("self", "dataset", "name", "batch_size")),
    PrivateName("transformers.Trainer", "_get_num_items_in_batch", "called",
                "hf_trainer.check_token_count: the probe that Trainer counts a global batch's tokens as CP expects",
                ("self", "batch_samples", "device")),
    PrivateName("trl.trainer.sft_trainer", "_total_train_tokens", "attribute",
                "hf_trainer: SFTTrainer's logged token count recounted from the real tokens of every rank"),
    PrivateName("trl.trainer.sft_trainer", "_metrics", "attribute", "hf_trainer: the recounted num_tokens logged"),
    PrivateName("accelerate.accelerator", "_dataloaders", "attribute",
                "hf_dp.prepare_data_loader_over_dp: a loader over the dp ranks kept as the accelerator's own"),
    PrivateName("accelerate.accelerator", "_is_accelerate_prepared", "attribute",
                "hf_dp.prepare_data_loader_over_dp: a loader accelerate prepared already is kept"),
    PrivateName("transformers.PreTrainedConfig", "_attn_implementation", "attribute",
                "transformers.register: written on a config (its sub-configs' too) without set_attn_implementation"),
    *(PrivateName(f"trl.trainer.{module}", name, "module global",
                  "hf_dp.DataParallelView.scope: TRL calls accelerate's gather / gather_object directly; inside the "
                  "RL trainers' steps they keep one rank per CP group")
      for module in ("grpo_trainer", "rloo_trainer") for name in ("gather", "gather_object")),
    PrivateName("trl.trainer.utils", "_ChunkedLogProbFunction", "module global",
                "hf_exact_grads.TrainerExactGradients.fused_head: in the deterministic mode's exact gradients, TRL's "
                "fused LM head runs one call per unit (its weight gradient is summed over tiles of a rank's tokens)"),
)
"""The private names (module doc)."""

REPLACED_NAMES: tuple[PrivateName, ...] = (
    *(PrivateName(f"transformers.models.{m}", "load_balancing_loss_func", "routed",
                  "hf_router_loss.prepare_router_loss: the load-balancing loss from the whole batch's statistics under "
                  "a handler (at register, in the model's modeling module and Mixtral's, which TRL's fused head calls)")
      for m in ("mixtral.modeling_mixtral", "qwen3_moe.modeling_qwen3_moe")),
    *(PrivateName(f"transformers.models.{m}", name, "rebound",
                  "hf_mixers.instrument_model: a routed mixer's forward (and the helpers it calls) rebuilt with the "
                  "kernel names bound to the handler's mixer methods, per instance; a kernel no longer reached so "
                  "leaves the mixer unrouted, which the documents probe then refuses by name")
      for m, names in (("qwen3_next.modeling_qwen3_next", ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")),
                       ("bamba.modeling_bamba", ("causal_conv1d_fn", "mamba2_chunk_scan")),
                       ("mamba.modeling_mamba", ("causal_conv1d_fn", "mamba_selective_scan")))
      for name in names),
)
"""The public upstream names replaced or rebound (module doc); each model family named is one the tests run."""


def missing(names: tuple[PrivateName, ...] = PRIVATE_NAMES + REPLACED_NAMES) -> list[str]:
    """The listed names the installed releases do not have, each said with its use (empty: all present)."""
    return [f"{n.owner}.{n.name}: {problem} ({n.use}; {n.by}), checked against {CHECKED_AGAINST}"
            for n in names if (problem := n.problem())]
