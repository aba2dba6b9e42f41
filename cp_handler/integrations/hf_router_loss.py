"""A mixture-of-experts model's load-balancing loss under context parallelism, from the whole batch's statistics.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE, gpt-oss, Jamba... 31 modules of 5.23 share
one ``load_balancing_loss_func``) return ``aux_loss`` and add ``router_aux_loss_coef * aux_loss`` to their loss when
``output_router_logits`` is on; TRL's SFTTrainer turns it on from ``router_aux_loss_coef``. The loss is Switch
Transformer's (Fedus et al. 2021, eq. 4-6): ``E * sum_e f_e * P_e`` with ``f_e`` the top-k choices of expert ``e``
per routed row and ``P_e`` its mean router probability, both over every real token of the batch and every layer.
Each rank of a CP group holds a shard: its own ``f`` and ``P`` would give another loss (Qwen3-Next: 6e-3 relative,
its embedding update 13% off). Here, while a handler is active:

* ``f``, ``P`` (detached) and the row count ``R`` are summed over the stats group (one all-reduce, no gradient);
* this rank's **share** is ``E * sum_e f_e * p_e / R`` with ``p`` this rank's probability sums: the shares sum over
  the group to the batch's loss, and a share's gradient is the batch loss's gradient with respect to this rank's
  router logits (the loss is linear in ``P`` for the given ``f``; ``f`` has no gradient).

The function returns what its consumer adds (:class:`RouterLossScope`): ``"share"`` (value and gradient the share:
the model's own loss sums shares, like the token loss; the default) or ``"replicated"`` (value the batch's loss on
every rank, gradient ``cp`` times the share: TRL adds ``outputs.aux_loss`` after its ``num_processes`` scaling, DDP
averages it over the ranks, and it logs its mean). Rows count only for real tokens: the batch's own padding and the
slots the handler pads are masked out, as one process masks its padding. Which rows are real comes from a source that
knows it (the trainer's batch, the forward's padding mask dispatched by the handler, the handler's layout), never from
a tensor whose shape happens to match (:func:`_token_mask`).

:func:`prepare_router_loss` routes a model's module-level function through :func:`cp_load_balancing_loss` when
its code is transformers' shared one (identified against Mixtral's, whose formula this implements), and refuses a
model whose loss is on with another function. Outside a handler the original runs unchanged. A forward that returns
an ``aux_loss`` this module did not compute is refused by the model hook (:mod:`.hf_model`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .hf_active import active_handler, forward_scope, forward_state, forward_token_mask, record_router_loss
from .hf_inputs import text_config

FUNCTION = "load_balancing_loss_func"
"""The module-level name transformers' MoE modeling files give the load-balancing loss."""
CONVENTIONS = ("share", "replicated")


@dataclass(frozen=True)
class RouterLossScope:
    """How the load-balancing loss of the forwards in a :func:`router_loss_scope` is computed.

    Args:
        group: the ranks whose router statistics make the batch (``None``: the active handler's CP group).
        token_mask: ``(B, S_local)`` bool, this rank's real tokens (``None``: the forward's, else the handler's
            layout: :func:`_token_mask`).
        convention: ``"share"`` or ``"replicated"`` (module doc).
    """

    group: dist.ProcessGroup | None = None
    token_mask: torch.Tensor | None = None
    convention: str = "share"

    def __post_init__(self):
        if self.convention not in CONVENTIONS:
            raise ValueError(f"RouterLossScope.convention={self.convention!r}: one of {CONVENTIONS}")


def router_loss_scope(scope: RouterLossScope):
    """The load-balancing loss of the forwards inside the block follows ``scope``."""
    return forward_scope(router_loss=scope)


def _reference():
    """transformers' shared function (Mixtral's module holds it; TRL's fused LM head imports it from there)."""
    from transformers.models.mixtral import modeling_mixtral

    return getattr(modeling_mixtral.load_balancing_loss_func, "_cp_original", modeling_mixtral.load_balancing_loss_func)


def _same_code(a, b) -> bool:
    """Whether two functions have the same code (docstrings and line numbers aside)."""
    ca, cb = a.__code__, b.__code__
    consts = [[c for c in code.co_consts if not isinstance(c, str)] for code in (ca, cb)]
    return (ca.co_code, ca.co_names, ca.co_varnames) == (cb.co_code, cb.co_names, cb.co_varnames) and \
        consts[0] == consts[1]


def router_loss_enabled(model: torch.nn.Module) -> bool:
    """Whether the model's config turns the load-balancing loss on (``output_router_logits``)."""
    return bool(getattr(text_config(model), "output_router_logits", False) or
                getattr(model.config, "output_router_logits", False))


def prepare_router_loss(model: torch.nn.Module) -> None:
    """Route the load-balancing loss of ``model``'s modeling module, and Mixtral's (which TRL's fused LM head
    calls), through :func:`cp_load_balancing_loss` (idempotent; outside a handler the original runs).

    Raises:
        ValueError: the config turns the loss on (``output_router_logits``) and the module's function is not
            transformers' shared one (or there is none): it would be computed from this rank's shard.
    """
    from transformers.models.mixtral import modeling_mixtral

    module = sys.modules.get(type(model).__module__)
    function = getattr(module, FUNCTION, None)
    for owner in {modeling_mixtral, module} if callable(function) and _same_code(function, _reference()) else ():
        if not hasattr(getattr(owner, FUNCTION), "_cp_original"):
            setattr(owner, FUNCTION, _routed(getattr(owner, FUNCTION)))
    if router_loss_enabled(model) and not hasattr(getattr(module, FUNCTION, None), "_cp_original"):
        raise ValueError(f"{type(model).__name__}: output_router_logits=True turns on a router loss "
                         f"({module.__name__ if module else '?'}.{FUNCTION} is not transformers' shared load-balancing "
                         "loss) that cp_handler does not compute from the whole sequence: each rank would use its "
                         "shard's routing; set output_router_logits=False (TRL: router_aux_loss_coef=0)")


def _routed(original):
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if active_handler() is None:
            return original(gate_logits, num_experts, top_k, attention_mask)
        return cp_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)

    load_balancing_loss_func._cp_original = original
    return load_balancing_loss_func


def cp_load_balancing_loss(gate_logits, num_experts: int, top_k: int = 2,
                           attention_mask: torch.Tensor | None = None) -> torch.Tensor | int:
    """The load-balancing loss of the batch under the active handler (module doc).

    Args:
        gate_logits: one ``(B * S_local, E)`` tensor per MoE layer (transformers' ``router_logits``).
        num_experts: ``E``. top_k: experts per token.
        attention_mask: not read: the model passes the whole batch's mask or a shard's depending on the model; the
            real tokens come from the scope, the forward or the handler's layout (:func:`_token_mask`).

    Returns:
        A float32 scalar (the scope's convention), or ``0`` without router logits (transformers' convention).

    Raises:
        ValueError: router logits whose rows are not this rank's ``B * S_local`` tokens.
    """
    record_router_loss()
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    handler, scope = active_handler(), forward_state().router_loss or RouterLossScope()
    group = scope.group if scope.group is not None else handler.cp_group
    rows_per_layer = gate_logits[0].reshape(-1, num_experts).shape[0]
    mask = _token_mask(handler, scope, rows_per_layer, gate_logits[0].device)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    probs, rows = torch.zeros_like(counts), mask.new_zeros(())
    for layer in gate_logits:
        weights = torch.softmax(layer.reshape(-1, num_experts), dim=-1)
        if weights.shape[0] != mask.numel():
            raise ValueError(f"router logits of {weights.shape[0]} rows, but this rank holds {mask.numel()} tokens: "
                             "cannot tell which rows are real tokens")
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        counts = counts.scatter_add(0, chosen, mask.repeat_interleave(top_k))
        probs = probs + (weights.float() * mask[:, None]).sum(0)
        rows = rows + mask.sum()
    stats = torch.cat([counts, probs.detach(), rows[None]])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    fraction, total = stats[:num_experts] / stats[-1], stats[-1]
    share = num_experts * (fraction * probs).sum() / total
    if scope.convention == "share":
        return share
    value, size = num_experts * (fraction * stats[num_experts:-1]).sum() / total, dist.get_world_size(group) \
        if group is not None else 1
    return size * share + (value - size * share).detach()


def _token_mask(handler, scope: RouterLossScope, rows: int, device) -> torch.Tensor:
    """This rank's real tokens, float32 ``(rows,)`` (one per routed row, batch-major), from a source that knows them:
    the scope's (a trainer's batch), else the forward's (a vision-language model's padding mask, dispatched by the
    handler: :func:`~.hf_active.forward_token_mask`), else the handler's layout
    (:meth:`~cp_handler.handlers.token_layout.TokenLayout.real_token_mask`, repeated over the rows of the batch).
    Never from the ``attention_mask`` the model passes (its shape is the whole batch's or a shard's, by model).

    Raises:
        ValueError: the rows are not whole rows of the layout's local sequence.
    """
    mask = scope.token_mask if scope.token_mask is not None else forward_token_mask()
    if mask is None:
        real = handler.token_layout.real_token_mask()
        if real is None:
            return torch.ones(rows, dtype=torch.float32, device=device)
        if rows % real.numel():
            raise ValueError(f"router logits of {rows} rows, but this rank holds {real.numel()} tokens per row: "
                             "cannot tell which rows are real tokens")
        mask = real.repeat(rows // real.numel())
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def active_scope() -> RouterLossScope | None:
    """The scope of the forwards running now (``None``: none set)."""
    return forward_state().router_loss
