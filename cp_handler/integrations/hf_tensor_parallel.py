"""Tensor parallelism of a Hugging Face causal LM under CP, from transformers' own plan: the config class's
``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``, what ``from_pretrained(tp_plan="auto")``
reads), applied with PyTorch's ``parallelize_module`` on the decoder (the model's ``base_model``).

Styles taken: ``"colwise"`` (``ColwiseParallel``; on a parameter of no module of its own, a per-head parameter
such as the attention sinks of Granite-SWA / MiMo-V2-Flash: sharded over its first dimension, each TP rank holding its
heads' entries), ``"local_params"`` (the owner of such a parameter: its forward runs with this rank's entries as a
plain tensor, as transformers' ``LocalParamsParallel`` does), ``"rowwise"`` (``RowwiseParallel``) and
``"replicated_with_grad_allreduce"`` (a weight every TP rank holds whole and applies to its own heads, Qwen3's
``q_norm`` / ``k_norm``: kept replicated, its gradient summed over the TP group by the training step) and
``"mla_kv_a_proj"`` (multi-head latent attention's ``kv_a_proj_with_mqa``, DeepSeek-V2 / V3: kept whole on every TP
rank; the rotary part of its output, ``qk_rope_head_dim`` columns, goes to this rank's heads directly, so its gradient
is summed over the TP group, as transformers' ``MlaKvAProjParallel`` does; the latent part reaches the heads through
the column-wise ``kv_b_proj``, whose input gradient PyTorch's TP sums). With fewer key-value heads than TP ranks
(``num_key_value_heads < tp``, ``tp`` a multiple of it) the column-wise ``k_proj`` / ``v_proj`` are replicated as
Megatron-LM does (:func:`~cp_handler.training.tensor_parallel.local_attention_shape`'s rule, the reference GPT's
``ReplicatedKVHeads``): every TP rank holds them whole and keeps the key-value head its query heads use; their
gradients (weight and bias) are summed over the TP group by the training step. Any other style in the plan (packed
projections, sequence parallelism, ...) is refused by name, as is a model without a plan. MoE experts are not in
transformers' TP plans (their own ``base_model_ep_plan``): they stay whole on every TP rank, as the reference GPT's.
 The output head and the embedding stay replicated (as the reference GPT's,
:mod:`cp_handler.training.tensor_parallel`). transformers' attention layers reshape by ``-1`` heads, so the CP
attention (:mod:`.hf_attention`) sees the TP rank's ``H / tp`` query and ``Hkv / tp`` key-value heads.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from ..runtime.reductions import replicated_kv_heads, sum_grad_over_group
from .hf_inputs import text_config

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "mla_kv_a_proj", "local_params")
"""The styles of transformers' plans this module applies (module doc)."""


def hf_tp_plan(model: nn.Module, tp: int, ordered: bool = False) -> tuple[dict, list[str]]:
    """``(plan, summed)`` for ``model`` (a :class:`~.transformers.CPCausalLM`, or the Hugging Face model itself):
    ``plan`` maps module paths of ``model`` to ``ColwiseParallel`` / ``RowwiseParallel`` (and the module doc's other
    styles); ``summed`` names the parameters whose gradients the TP group sums (``replicated_with_grad_allreduce``;
    ``k_proj`` / ``v_proj`` replicated when ``num_key_value_heads < tp``). ``ordered``: ``"rowwise"``
    adds its partial sums in TP-rank order (:func:`~cp_handler.runtime.reductions.ordered_rowwise_parallel`;
    the deterministic mode).

    Raises:
        ValueError: no ``base_model_tp_plan``; a style not in :data:`STYLES` (named with its module pattern); head
            counts or the MLP width that ``tp`` does not divide; a plan none of whose patterns matches a module (a
            pattern matching none is skipped, as transformers does: the plans list alternatives, DeepSeek's
            ``q_proj`` without a query LoRA and ``q_b_proj`` with one, dense and MoE layers' MLPs).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ..runtime.reductions import ordered_rowwise_parallel

    rowwise = ordered_rowwise_parallel() if ordered else RowwiseParallel

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
    kv_heads = getattr(config, "num_key_value_heads", None)
    replicate = kv_heads is not None and kv_heads < tp and tp % kv_heads == 0  # Megatron-LM's rule (module doc)
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if value is not None and value % tp and not (field == "num_key_value_heads" and replicate):
            extra = " nor divides it (key-value heads are replicated when tp is a multiple of their count)" \
                if field == "num_key_value_heads" else ""
            raise ValueError(f"tensor_parallel_size={tp}: {type(config).__name__}.{field}={value} is not divisible "
                             f"by it{extra}; each TP rank holds an equal share")
    base = hf.base_model
    prefix = "" if model is base else next(name + "." for name, m in model.named_modules() if m is base)
    modules, parameters = dict(base.named_modules()), dict(base.named_parameters())
    plan, summed, head_params = {}, [], {}
    for pattern, style in template.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for name in [n for n in parameters if regex.match(n)] if style == "colwise" else ():
            owner, _, param = name.rpartition(".")
            head_params.setdefault(owner, []).append(param)  # a per-head parameter: split by its owner
        for name in [n for n in modules if regex.match(n)]:
            module = modules[name]
            if style == "replicated_with_grad_allreduce":
                summed += [f"{prefix}{name}.{p}" for p, _ in module.named_parameters()]
            elif style == "mla_kv_a_proj":
                plan[prefix + name] = _mla_kv_a_proj()(config.qk_rope_head_dim)
            elif style == "local_params":
                plan[prefix + name] = None  # filled below with this module's per-head parameters
            elif style == "colwise" and replicate and name.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
                plan[prefix + name] = replicated_kv_heads()(kv_heads, module.out_features // kv_heads)
                summed += [f"{prefix}{name}.{p}" for p, _ in module.named_parameters()]
            else:
                plan[prefix + name] = ColwiseParallel() if style == "colwise" else rowwise()
    for owner, params in head_params.items():
        if plan.get(prefix + owner, ...) is not None:
            raise ValueError(f"tensor_parallel_size={tp}: {type(config).__name__}'s plan splits the parameters "
                             f"{[f'{owner}.{p}' for p in params]} \"colwise\" but does not run their module "
                             f"{owner!r} \"local_params\"; refused")
        for param in params:
            shape = parameters[f"{owner}.{param}"].shape
            if len(shape) > 2:  # transformers splits such a parameter on another dimension (ndim - 2)
                raise ValueError(f"tensor_parallel_size={tp}: {owner}.{param} of shape {tuple(shape)} split "
                                 "\"colwise\": only per-head vectors and matrices (split on dimension 0) are applied")
            rows = shape[0]
            if rows % tp:
                raise ValueError(f"tensor_parallel_size={tp}: {owner}.{param} has {rows} rows, not divisible by it; "
                                 "each TP rank holds an equal share")
        plan[prefix + owner] = _local_head_params()(tuple(params))
    plan = {path: style for path, style in plan.items() if style is not None}  # "local_params" with nothing split
    if not plan:
        raise ValueError(f"tensor_parallel_size={tp}: no pattern of {type(config).__name__}'s tensor-parallel plan "
                         f"matches a module of the model ({list(template)}); refused")
    return plan, summed


@functools.cache
def _mla_kv_a_proj():
    from torch.distributed.tensor.parallel import ParallelStyle

    class MlaKvAProj(ParallelStyle):
        """``"mla_kv_a_proj"`` (module doc): the weight whole on every TP rank; the last ``rope_dim`` output columns'
        gradient summed over the TP group."""

        def __init__(self, rope_dim: int):
            super().__init__()
            self.rope_dim = rope_dim

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            group, rope = device_mesh.get_group(), self.rope_dim

            def hook(_, args, out):
                latent, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
                return torch.cat([latent, sum_grad_over_group(rotary, group)], dim=-1)

            module.register_forward_hook(hook)
            return module

    return MlaKvAProj


@functools.cache
def _local_head_params():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class LocalHeadParams(ParallelStyle):
        """A module's per-head parameters (``"colwise"`` on a parameter, its module ``"local_params"``; module doc):
        each becomes a DTensor sharded over its first dimension (this rank's heads' entries; its gradient this rank's
        part, a checkpoint reshards it), and the module's forward runs with the local entries as a plain tensor."""

        def __init__(self, names: tuple[str, ...]):
            super().__init__()
            self.names = names

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            for name in self.names:
                whole = module._parameters[name]
                module._parameters[name] = nn.Parameter(distribute_tensor(whole.data, device_mesh, [Shard(0)]),
                                                        requires_grad=whole.requires_grad)
            held = {}

            def local(mod, args):
                for name in self.names:
                    held[name] = mod._parameters[name]
                    mod._parameters[name] = held[name].to_local()  # differentiable: the gradient reaches the shard

            def restore(mod, args, out):
                for name in self.names:
                    if not isinstance(mod._parameters[name], DTensor):
                        mod._parameters[name] = held.pop(name)

            module.register_forward_pre_hook(local)
            module.register_forward_hook(restore)
            return module

    return LocalHeadParams


def apply_hf_tensor_parallel(model: nn.Module, tp_mesh, ordered: bool = False) -> list[str]:
    """Split ``model`` over the 1-D ``tp_mesh`` with :func:`hf_tp_plan` (``ordered``: its row-wise sums in TP-rank
    order); returns the names of the parameters whose gradients the TP group sums. Raises ValueError:
    :func:`hf_tp_plan`."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, summed = hf_tp_plan(model, tp_mesh.size(), ordered)
    parallelize_module(model, tp_mesh, plan)
    return summed
