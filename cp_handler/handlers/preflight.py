"""The one pre-flight step of a ``core_attn`` call: every check and resolution, once, before any collective.

:func:`preflight` takes what the model passed (``attn_mod``, q, k, v in the handler's ``qkv_format``,
``attn_mask_type``) and returns an :class:`AttnCall`: q/k/v as ``(B, H, S, D)`` views (thd: ``B = 1``,
the ``(T, H, D)`` / ``(1, T, H, D)`` rule applied once, :mod:`cp_handler.ops.qkv_format`), the resolved
mask, sinks and softmax scale (:func:`~.checks.attention_variant`, :func:`~.checks.softmax_scale`), the
layer's comm type and the batch's layout. Its checks: the mask type, q/k/v (:func:`~.checks.check_qkv`),
the local length against the layout, the variant and the backend's own rules (``handler.check_call``); a
failure on one rank fails every rank together, and at the first call of each layer per handler the ranks
agree on the call's shape, layout and variant (:meth:`~.agreement.RankAgreement.checked`). The
backend's ``attend`` and the algorithms behind it trust the call and check nothing again.

A handler memoises what a call resolved (``handler.resolved_calls``) under :func:`call_key`: everything the
checks read but the handler's layout (checked every call) and ``check_call`` (run every call). A layer's later
calls on the handler (activation recomputation, another forward) skip the rest: the mask, sinks and scale, the
variant's description and the agreed values come from the first. So a backend's ``unsupported_variant`` and an
override of ``attention_variant`` read only the ``attn_mod`` attributes of :data:`READ` and ``sinks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask
from ..ops.qkv_format import from_bhsd, to_bhsd
from ..runtime.config import AUTO
from .checks import VARIANT_ALIASES, check_qkv, softmax_scale, variant_description

ATTN_MASK_TYPES = ("causal", "no_mask")
"""Mask types of ``core_attn`` (Transformer Engine's names)."""

AGREED_FIELDS = ("local_len", "batch", "heads", "kv_heads", "head_dim", "v_head_dim", "dtype", "layout", "variant")
"""What the ranks of a CP group compare at the first call of each layer (:func:`preflight`)."""


@dataclass(frozen=True, eq=False)
class AttnCall:
    """One ``core_attn`` call, checked and resolved (see the module doc).

    Attributes:
        q, k, v: ``(B, H, S_local, D)`` / ``(B, Hkv, S_local, D)`` views of the tensors passed.
        mask, sinks, scale: the attention variant of ``attn_mod`` and its softmax scale.
        comm_type: the layer's ``cp_comm_type``.
        layout: the batch's documents (:class:`~cp_handler.core.layout.ZigzagDocs`), or ``None`` for a backend
            without the zigzag layout.
        layer: ``attn_mod.layer_number`` (``None``: not given).
        qkv_format: the handler's format; ``given``: the q passed (:meth:`restore` shapes the output like it).
        attn_mod: the module passed (a backend that keeps per-module state, Transformer Engine's, reads it).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: AttentionMask
    sinks: torch.Tensor | None
    scale: float
    comm_type: str
    layout: ZigzagDocs | None
    layer: int | None
    qkv_format: str
    given: torch.Tensor
    attn_mod: object = None

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output's shape: the q passed with the values' head dim (MLA: ``Dv``, else ``D``)."""
        return (*self.given.shape[:-1], self.v.shape[-1])

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """``out (B, H, S_local, D)`` shaped like the q that was passed."""
        return from_bhsd(out, self.qkv_format, self.given)

    def in_format(self, t: torch.Tensor) -> torch.Tensor:
        """``t (B, H, S, D)`` of this call in the handler's ``qkv_format``, thd as ``(T, H, D)``."""
        return from_bhsd(t, self.qkv_format, self.given[0] if self.qkv_format == "thd" and self.given.dim() == 4
                         else self.given)


def _seq_dim(qkv_format: str, q: torch.Tensor) -> int:
    """The sequence dim of a q passed in ``qkv_format`` (checked shape: raises ValueError)."""
    if qkv_format == "thd":
        if q.dim() == 3 or (q.dim() == 4 and q.shape[0] == 1):
            return q.dim() - 3
        raise ValueError(f"core_attn q {tuple(q.shape)}: qkv_format='thd' takes (T, H, D) or (1, T, H, D)")
    if q.dim() != 4:
        raise ValueError(f"core_attn q {tuple(q.shape)}: qkv_format={qkv_format!r} takes a 4-D tensor")
    return 0 if qkv_format == "sbhd" else 1


READ = ("softmax_scale", "window_size", "attention_chunk_size", "softcap", "layer_number", *VARIANT_ALIASES)
"""The attributes of ``attn_mod`` the checks read (besides ``sinks``): part of a resolved call's key."""
_PLAIN = (type(None), bool, int, float, str, tuple)


def call_key(attn_mod, q, k, v, attn_mask_type) -> tuple | None:
    """Everything the checks of :func:`preflight` read but the handler's layout and ``check_call``: the mask type,
    q/k/v's shapes, dtypes and devices, ``attn_mod``'s variant attributes and its sinks (by identity, with their
    shape, dtype and device); ``None`` when a value cannot be a key (the call is checked in full)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    key = [attn_mask_type, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device]
    for name in READ:
        value = getattr(attn_mod, name, None)
        if not isinstance(value, _PLAIN):
            return None
        key.append(value)
    sinks = getattr(attn_mod, "sinks", None)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            return None
        key += [id(sinks), sinks.shape, sinks.dtype, sinks.device]
    key = tuple(key)
    try:
        hash(key)
    except TypeError:  # an unhashable value inside a tuple, or as attn_mask_type: checked in full (and refused)
        return None
    return key


def preflight(handler, attn_mod, q, k, v, attn_mask_type: str) -> AttnCall:
    """The :class:`AttnCall` of one ``core_attn`` of ``handler`` (see the module doc). A call whose
    :func:`call_key` the handler resolved before (``handler.resolved_calls``) skips the checks that key covers:
    the layout is still checked, ``check_call`` still run and the ranks' agreement still made once per layer.

    Raises:
        ValueError / TypeError: naming the argument, the value and the rule (on every rank of the group when
            the agreement check runs); :class:`~.agreement.RanksRefused` when the ranks disagree.
    """
    key = call_key(attn_mod, q, k, v, attn_mask_type)
    entry = handler.resolved_calls.get(key) if key is not None else None
    if entry is not None and entry[2] is getattr(attn_mod, "sinks", None):
        call = _resolved_call(handler, attn_mod, q, k, v, entry)
        if call is not None:
            return call
    resolved = {}

    def local_checks() -> dict[str, int | str]:
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {ATTN_MASK_TYPES}")
        if not isinstance(q, torch.Tensor):
            check_qkv(q, k, v, seq_dim=0)  # raises, naming q
        seq_dim = _seq_dim(handler.qkv_format, q)
        check_qkv(q, k, v, seq_dim)
        layout = handler.token_layout.call_layout(q.shape[seq_dim])
        scale = softmax_scale(attn_mod, q.shape[-1])
        mask, sinks = handler.attention_variant(attn_mod, attn_mask_type, q, q.shape[-2])
        comm_type = handler.comm_type_for(attn_mod)
        layer = getattr(attn_mod, "layer_number", None)
        if comm_type == AUTO:  # the pattern this call's shapes run fastest on (the same inputs on every rank)
            comm_type = handler.resolve_auto(q, k, v, seq_dim, mask, layout, layer, sinks=sinks)
        call = AttnCall(*(to_bhsd(t, handler.qkv_format) for t in (q, k, v)), mask, sinks, scale, comm_type,
                        layout, layer, handler.qkv_format, q, attn_mod)
        handler.check_call(call)
        resolved["call"] = call
        batch = q.shape[1 - seq_dim] if q.dim() == 4 and handler.qkv_format != "thd" else 1
        values = {"local_len": q.shape[seq_dim], "batch": batch, "heads": q.shape[-2], "kv_heads": k.shape[-2],
                  "head_dim": q.shape[-1], "v_head_dim": v.shape[-1], "dtype": str(q.dtype),
                  "variant": variant_description(comm_type, mask, sinks, scale)}
        resolved["entry"] = (seq_dim, mask, sinks, scale, comm_type, layer, values)
        return {**values, "layout": _layout_text(layout)}

    agreement_key = handler.agreement_key(attn_mod)
    device = q.device if isinstance(q, torch.Tensor) else "cpu"
    if agreement_key is None:
        local_checks()
    else:
        handler.agreement.checked(agreement_key, device, AGREED_FIELDS, local_checks)
    if key is not None:
        if len(handler.resolved_calls) >= RESOLVED_CALLS:
            handler.resolved_calls.clear()
        handler.resolved_calls[key] = resolved["entry"]
    return resolved["call"]


RESOLVED_CALLS = 4096
"""Resolved calls a cache (``handler.resolved_calls``) keeps before it starts over."""


def _layout_text(layout) -> str:
    return "none" if layout is None else f"document lengths {list(layout.lengths)}"


def _resolved_call(handler, attn_mod, q, k, v, entry) -> AttnCall | None:
    """The call from a resolved entry (the hot path: the layout checked, ``check_call`` run, the agreement made
    once per layer); ``None`` when the layout or ``check_call`` refuses it (the full path then raises, on every rank
    where the agreement runs)."""
    seq_dim, mask, sinks, scale, comm_type, layer, values = entry
    fmt = handler.qkv_format
    try:
        layout = handler.token_layout.call_layout(q.shape[seq_dim])
        if fmt == "bshd":  # to_bhsd inline for the common format (the hot path: three calls fewer)
            bq, bk, bv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            bq, bk, bv = to_bhsd(q, fmt), to_bhsd(k, fmt), to_bhsd(v, fmt)
        call = AttnCall(bq, bk, bv, mask, sinks, scale, comm_type, layout, layer, fmt, q, attn_mod)
        handler.check_call(call)
    except (ValueError, TypeError):
        return None
    agreement_key = handler.agreement_key(attn_mod)
    if agreement_key is not None and agreement_key not in handler.agreement.done:
        handler.agreement.agree(agreement_key, {**values, "layout": _layout_text(layout)}, q.device)
    return call
