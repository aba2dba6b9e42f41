"""The state of the Hugging Face forward running now, in the integration's one context variable.

The handler reaches transformers' code as the forward's ``cp_handler`` keyword (:mod:`.hf_model` passes it on to
the attention function through the layers' keyword arguments; the attention function reads the keyword, else the
handler its mask holds, never this state). What transformers calls *without* the forward's keyword arguments cannot
be given it; these read :class:`ForwardState`, the one context variable of the integration, and nothing else does:

* the mask function (:mod:`.hf_mask`: transformers' mask creators call it with the model's own arguments; the
  :class:`~.hf_mask.CPMask` it returns keeps the handler for the layers that drop the keyword);
* the rotary modules' hooks (:mod:`.hf_rotary`) and the routed mixers' kernels (:mod:`.hf_mixers`);
* the load-balancing loss function (:mod:`.hf_router_loss`), with the scope's router-loss fields;
* a vision-language model's pre-hooks on the model and on its language model (:mod:`.hf_vlm`), which run inside
  the forward the generic hook entered;
* the recompute hook (:mod:`.hf_model`): in a layer recomputed in the backward, outside the model's forward, it
  enters the state for a module inside it that reads it;
* the fused LM head (:mod:`.hf_fused_head`), through ``fused_head_on_shard``.

The state holds the forward's handler, what its layers recorded (:class:`ForwardRecord`), how its router loss is
computed, and whether a fused LM head's call runs on the shards. The model's forward hook sets it for the forward
(:mod:`.hf_model`, from the ``cp_handler`` keyword: the handler's one channel into a model, never read back from
this state), :func:`forward_scope` the router loss and fused-head fields for a block (the trainers, the fused head)
and the handler for a mixer probed alone (:func:`handler_context`). The bottom of the integration: it imports
nothing of it."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..handlers.base import ContextParallelHandler


@dataclass
class ForwardRecord:
    """What went through cp_handler during one forward of a prepared model: the attention layers, each with
    its mask type (``"causal"`` / ``"no_mask"``), and whether the router loss was computed over the group."""

    layers: set = field(default_factory=set)
    mask_types: dict = field(default_factory=dict)
    router_loss: bool = False
    token_mask: torch.Tensor | None = None
    """bool ``(B, S_local)``: this rank's real tokens, when the forward's batch says more than the handler's layout
    (a vision-language model's right-padding mask, dispatched: :mod:`.hf_vlm`); ``None``: the layout's."""
    core_attn_calls: int = 0
    """Calls of the attention function recorded (each one ``core_attn``; a layer called twice counts twice; a
    compiled layer's call is not recorded; a mixer's is recorded in ``layers`` but not here)."""


@dataclass(frozen=True)
class ForwardState:
    """What the callbacks transformers makes without the forward's keyword arguments read (module doc).

    Attributes:
        handler: the forward's handler (``None``: no forward under CP runs).
        record: what the running forward of a prepared model records (``None`` outside one).
        router_loss: how its load-balancing loss is computed (a :class:`~.hf_router_loss.RouterLossScope`;
            ``None``: the default, over the handler's CP group).
        fused_head_on_shard: a fused LM head's call on the shards runs now (:mod:`.hf_fused_head`).
    """

    handler: ContextParallelHandler | None = None
    record: ForwardRecord | None = None
    router_loss: Any = None
    fused_head_on_shard: bool = False


_forward: contextvars.ContextVar[ForwardState | None] = contextvars.ContextVar("cp_handler_forward", default=None)
"""The integration's one context variable (module doc); ``None``: :data:`_NO_FORWARD`."""
_NO_FORWARD = ForwardState()


def forward_state() -> ForwardState:
    """The state of the forward running now (the default one, all empty, outside any)."""
    return _forward.get() or _NO_FORWARD


def enter_forward(**changes) -> contextvars.Token:
    """The state with ``changes`` (fields of :class:`ForwardState`) from now on; returns the token
    :func:`exit_forward` takes (a hook pair: the pre-hook enters, the hook exits)."""
    return _forward.set(dataclasses.replace(forward_state(), **changes))


def exit_forward(token: contextvars.Token) -> None:
    """The state before the :func:`enter_forward` that gave ``token``."""
    _forward.reset(token)


@contextlib.contextmanager
def forward_scope(**changes):
    """The state with ``changes`` inside the block (reset on exit, also on error)."""
    token = enter_forward(**changes)
    try:
        yield
    finally:
        exit_forward(token)


def active_handler() -> ContextParallelHandler | None:
    """The handler of the forward running now, if any."""
    return forward_state().handler


def handler_context(handler: ContextParallelHandler):
    """Make ``handler`` the active handler inside the block (reset on exit, also on error)."""
    return forward_scope(handler=handler)


def record_attention_call(module: nn.Module, mask_type: str, core_attn: bool = True) -> None:
    """Called by the attention function for every layer it runs (its ``layer_idx``; a module without
    one counts by identity) with the layer's ``attn_mask_type``; ``core_attn=False``: a mixer's route (its layer
    covered, no ``core_attn`` call)."""
    record = forward_state().record
    if record is not None:
        layer = getattr(module, "layer_idx", None)
        key = layer if isinstance(layer, int) else f"module {id(module)}"
        record.layers.add(key)
        record.mask_types[key] = mask_type
        record.core_attn_calls += core_attn


def set_forward_token_mask(mask: torch.Tensor) -> None:
    """This rank's real tokens of the forward running now (:attr:`ForwardRecord.token_mask`); outside a prepared
    model's forward: ValueError (a mask that nothing would read)."""
    record = forward_state().record
    if record is None:
        raise ValueError("set_forward_token_mask outside a prepared model's forward")
    record.token_mask = mask


def forward_token_mask() -> torch.Tensor | None:
    """The forward's real-token mask (:attr:`ForwardRecord.token_mask`), ``None`` when it has none or no forward of
    a prepared model runs."""
    record = forward_state().record
    return None if record is None else record.token_mask


def record_router_loss() -> None:
    """Called when the router loss of the running forward was computed over the group (:mod:`.hf_router_loss`)."""
    record = forward_state().record
    if record is not None:
        record.router_loss = True
