"""Tensor parallelism of a Hugging Face causal LM under CP, from transformers' own plan: the config class's
``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``, what ``from_pretrained(tp_plan="auto")``
reads), applied with PyTorch's ``parallelize_module`` on the decoder (the model's ``base_model``).

Styles taken: ``"colwise"`` (``ColwiseParallel``), ``"rowwise"`` (``RowwiseParallel``) and
``"replicated_with_grad_allreduce"`` (a weight every TP rank holds whole and applies to its own heads, Qwen3's
``q_norm`` / ``k_norm``: kept replicated, its gradient summed over the TP group by the training step). Any other style
in the plan (MoE routers and experts, MLA's ``mla_kv_a_proj``, packed projections, sequence parallelism) is refused
by name, as is a model without a plan. The output head and the embedding stay replicated (as the reference GPT's,
:mod:`cp_handler.training.tensor_parallel`). transformers' attention layers reshape by ``-1`` heads, so the CP
attention (:mod:`.hf_attention`) sees the TP rank's ``H / tp`` query and ``Hkv / tp`` key-value heads.
"""

from __future__ import annotations

import re

from torch import nn

from .hf_inputs import text_config

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
"""The styles of transformers' plans this module applies (module doc)."""


def hf_tp_plan(model: nn.Module, tp: int) -> tuple[dict, list[str]]:
    """``(plan, summed)`` for ``model`` (a :class:`~.transformers.CPCausalLM`, or the Hugging Face model itself):
    ``plan`` maps module paths of ``model`` to ``ColwiseParallel`` / ``RowwiseParallel``; ``summed`` names the
    parameters whose gradients the TP group sums (``replicated_with_grad_allreduce``).

    Raises:
        ValueError: no ``base_model_tp_plan``; a style not in :data:`STYLES` (named with its module pattern); head
            counts or the MLP width that ``tp`` does not divide; a pattern that matches no module.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    hf = getattr(model, "model", model) if not hasattr(model, "base_model") else model
    config = text_config(hf)
    template = getattr(config, "base_model_tp_plan", None)
    if not template:
        raise ValueError(f"tensor_parallel_size={tp}: {type(config).__name__} has no base_model_tp_plan in "
                         "transformers (no tensor-parallel plan); refused")
    refused = {pattern: style for pattern, style in template.items() if style not in STYLES}
    if refused:
        raise ValueError(f"tensor_parallel_size={tp}: {type(config).__name__}'s tensor-parallel plan has styles "
                         f"cp_handler does not apply: {refused} (it applies {list(STYLES)}); refused")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if value is not None and value % tp:
            raise ValueError(f"tensor_parallel_size={tp}: {type(config).__name__}.{field}={value} is not divisible "
                             "by it; each TP rank holds an equal share")
    base = hf.base_model
    prefix = "" if model is base else next(name + "." for name, m in model.named_modules() if m is base)
    plan, summed = {}, []
    for pattern, style in template.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        found = [name for name, _ in base.named_modules() if regex.match(name)]
        if not found:
            raise ValueError(f"tensor_parallel_size={tp}: {pattern!r} of {type(config).__name__}'s tensor-parallel "
                             "plan matches no module of the model; refused")
        for name in found:
            if style == "replicated_with_grad_allreduce":
                summed += [f"{prefix}{name}.{p}" for p, _ in base.get_submodule(name).named_parameters()]
            else:
                plan[prefix + name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    return plan, summed


def apply_hf_tensor_parallel(model: nn.Module, tp_mesh) -> list[str]:
    """Split ``model`` over the 1-D ``tp_mesh`` with :func:`hf_tp_plan`; returns the names of the parameters whose
    gradients the TP group sums. Raises ValueError: :func:`hf_tp_plan`."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, summed = hf_tp_plan(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, plan)
    return summed
