"""The handler of the Hugging Face forward running now: a context variable set by the model's forward hook
(:mod:`.hf_model`), by :func:`handler_context`, or, in a layer recomputed in the backward, by the recompute hook
of a module inside it that reads it. The attention function takes its handler from its call (the ``cp_handler``
keyword or its mask, :mod:`.hf_attention`) and reads this only where neither carries one; what transformers
calls without the forward's keyword arguments reads it: the mask function (:mod:`.hf_mask`), the rotary hooks
(:mod:`.hf_rotary`), the mixer routes (:mod:`.hf_mixers`) and the router loss (:mod:`.hf_router_loss`). The
bottom of the integration: it imports nothing of it."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from torch import nn

from ..handlers.base import ContextParallelHandler

_active: contextvars.ContextVar[ContextParallelHandler | None] = contextvars.ContextVar("cp_handler", default=None)


def active_handler() -> ContextParallelHandler | None:
    """The handler of the forward running now (keyword or context manager), if any."""
    return _active.get()


def set_active(handler: ContextParallelHandler | None) -> contextvars.Token:
    """Make ``handler`` active; returns the token :func:`reset_active` takes."""
    return _active.set(handler)


def reset_active(token: contextvars.Token) -> None:
    _active.reset(token)


@contextlib.contextmanager
def value_in(variable: contextvars.ContextVar, value):
    """``variable`` holds ``value`` inside the block (reset on exit, also on error)."""
    token = variable.set(value)
    try:
        yield value
    finally:
        variable.reset(token)


def handler_context(handler: ContextParallelHandler):
    """Make ``handler`` the active handler inside the block (reset on exit, also on error)."""
    return value_in(_active, handler)


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


_record: contextvars.ContextVar[ForwardRecord | None] = contextvars.ContextVar("cp_handler_record", default=None)


def start_record() -> contextvars.Token:
    """A new :class:`ForwardRecord` for the forward starting now; returns the token :func:`end_record` takes."""
    return _record.set(ForwardRecord())


def end_record(token: contextvars.Token) -> ForwardRecord:
    """The record of the forward that ends now (the record is reset)."""
    record = _record.get()
    _record.reset(token)
    return record


def record_attention_call(module: nn.Module, mask_type: str, core_attn: bool = True) -> None:
    """Called by the attention function for every layer it runs (its ``layer_idx``; a module without
    one counts by identity) with the layer's ``attn_mask_type``; ``core_attn=False``: a mixer's route (its layer
    covered, no ``core_attn`` call)."""
    record = _record.get()
    if record is not None:
        layer = getattr(module, "layer_idx", None)
        key = layer if isinstance(layer, int) else f"module {id(module)}"
        record.layers.add(key)
        record.mask_types[key] = mask_type
        record.core_attn_calls += core_attn


def set_forward_token_mask(mask: torch.Tensor) -> None:
    """This rank's real tokens of the forward running now (:attr:`ForwardRecord.token_mask`); outside a prepared
    model's forward: ValueError (a mask that nothing would read)."""
    record = _record.get()
    if record is None:
        raise ValueError("set_forward_token_mask outside a prepared model's forward")
    record.token_mask = mask


def forward_token_mask() -> torch.Tensor | None:
    """The forward's real-token mask (:attr:`ForwardRecord.token_mask`), ``None`` when it has none or no forward of
    a prepared model runs."""
    record = _record.get()
    return None if record is None else record.token_mask


def record_router_loss() -> None:
    """Called when the router loss of the running forward was computed over the group (:mod:`.hf_router_loss`)."""
    record = _record.get()
    if record is not None:
        record.router_loss = True
