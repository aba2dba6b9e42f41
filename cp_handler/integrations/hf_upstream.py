"""Every private name of transformers, TRL and accelerate the integration relies on, in one place.

The trainers work through public hooks wherever one exists (Trainer's overridable methods ``compute_loss``,
``training_step``, ``prediction_step``, ``evaluation_loop``, ``get_cp_size``; accelerate's ``Accelerator`` as the
trainer's attribute and its public ``prepare_data_loader``). What is left reaches a private name: a method TRL has
no public hook for, an attribute a count lives in, a module global TRL calls directly. Each is listed here with
what cp_handler does with it; :func:`missing` says which of them a release no longer has, and
tests/test_hf_upstream.py fails naming them (and fails too when a trainer overrides a private method that is not
listed here).

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
            ``"called"``, ``"attribute"`` (an instance attribute read or written: the owner's source must set it), or
            ``"module global"`` (a module-level name of the owner replaced for a block).
        by: where and why (the cp_handler module).
    """

    owner: str
    name: str
    use: str
    by: str

    def found(self) -> bool:
        """Whether the installed release still has it (an attribute: its owner's source still names it)."""
        module_name, _, attribute = self.owner.rpartition(".")
        try:
            owner = importlib.import_module(self.owner)
        except ImportError:
            owner = getattr(importlib.import_module(module_name), attribute, None)
        if owner is None:
            return False
        if self.use == "attribute":
            return f".{self.name}" in inspect.getsource(owner)
        return hasattr(owner, self.name)


_RL = "hf_rl_trainer: the rollout and its loss on the CP shards, log-probs over the group"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    *(PrivateName(f"trl.{trainer}", name, "overridden", _RL) for trainer in ("GRPOTrainer", "RLOOTrainer")
      for name in ("_generate_single_turn", "_generate_and_score_completions", "_compute_loss")),
    PrivateName("trl.DPOTrainer", "_compute_loss", "overridden", _RL),
    PrivateName("trl.DPOTrainer", "_precompute_ref_logps", "overridden",
                "hf_rl_trainer: the reference log-probs precomputed over the dp ranks (TRL does it in __init__)"),
    PrivateName("transformers.Trainer", "_get_num_items_in_batch", "called",
                "hf_trainer.check_token_count: the probe that Trainer counts a global batch's tokens as CP expects"),
    PrivateName("trl.trainer.sft_trainer", "_total_train_tokens", "attribute",
                "hf_trainer: SFTTrainer's logged token count recounted from the real tokens of every rank"),
    PrivateName("trl.trainer.sft_trainer", "_metrics", "attribute", "hf_trainer: the recounted num_tokens logged"),
    PrivateName("accelerate.accelerator", "_dataloaders", "attribute",
                "hf_dp.prepare_data_loader_over_dp: a loader over the dp ranks kept as the accelerator's own"),
    PrivateName("accelerate.accelerator", "_is_accelerate_prepared", "attribute",
                "hf_dp.prepare_data_loader_over_dp: a loader accelerate prepared already is kept"),
    PrivateName("transformers.PreTrainedConfig", "_attn_implementation", "called",
                "transformers.register: set on a config without set_attn_implementation"),
    *(PrivateName(f"trl.trainer.{module}", name, "module global",
                  "hf_dp.DataParallelView.scope: TRL calls accelerate's gather / gather_object directly; inside the "
                  "RL trainers' steps they keep one rank per CP group")
      for module in ("grpo_trainer", "rloo_trainer") for name in ("gather", "gather_object")),
    PrivateName("trl.trainer.utils", "_ChunkedLogProbFunction", "module global",
                "hf_exact_grads.TrainerExactGradients.fused_head: in the deterministic mode's exact gradients, TRL's "
                "fused LM head runs one call per unit (its weight gradient is summed over tiles of a rank's tokens)"),
)
"""The private names (module doc)."""


def missing(names: tuple[PrivateName, ...] = PRIVATE_NAMES) -> list[str]:
    """The listed names the installed releases do not have, each said with its use (empty: all present)."""
    return [f"{n.owner}.{n.name} ({n.use}; {n.by}), checked against {CHECKED_AGAINST}" for n in names if not n.found()]
