"""Input checks of the handlers: what one rank can see (cheap, before any collective); the agreement of the
ranks of a CP group (one small all-gather per handler and kind of call) is :mod:`.agreement`.

Every failure is a ``ValueError`` or ``TypeError`` naming the argument, its value and the rule:
never a gloo abort, an ATen error from deep inside a kernel, or a silently wrong result.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..core.layout import check_cu_seqlens  # noqa: F401 - the handlers' checks, one owner (layout)
from ..core.masks import AttentionMask
from ..ops.sinks import check_sinks


def check_member(group: dist.ProcessGroup | None) -> None:
    """Raises ValueError when this process is not a rank of ``group``."""
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"cp_group: this process (global rank {dist.get_rank()}) is not a member of the CP group "
                         f"(global ranks {dist.get_process_group_ranks(group)}); build the handler on its ranks only")


def check_dim(name: str, dim, ndim: int) -> int:
    """``dim`` as a non-negative index of a ``ndim``-dimensional tensor.

    Raises:
        TypeError: not an int (bools refused). ValueError: out of range.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}={dim!r} must be an int")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a {ndim}-D tensor (valid: {-ndim}..{ndim - 1})")
    return dim % ndim


def check_shift(shifts) -> int:
    """Raises TypeError unless ``shifts`` is one int (not a bool, not a sequence)."""
    if isinstance(shifts, bool) or not isinstance(shifts, int):
        raise TypeError(f"roll_tensor shifts={shifts!r} must be one int")
    return shifts


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_dim: int, head_dim_index: int = -2) -> None:
    """q, k, v of ``core_attn`` agree: floating dtype, one dtype, one device, q and k the same shape outside
    heads (batch, sequence, head dim), v as k but for its head dim (multi-head latent attention: a value head
    dim other than the query / key head dim, DeepSeek-V2/V3), query heads a multiple of KV heads (GQA).

    Args:
        seq_dim: the sequence dim of the tensors (its length must agree too).
        head_dim_index: the heads dim.

    Raises:
        TypeError: a non-floating or mismatched dtype. ValueError: a device, shape or head mismatch.
    """
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"core_attn {name} must be a tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"core_attn {name} has dtype {t.dtype}; attention takes floating tensors")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"core_attn q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"core_attn q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(f"core_attn q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must have the same "
                         "number of dims")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"core_attn k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape but for the "
                         "head dim (the last one)")
    heads = head_dim_index % q.dim()
    outside = [d for d in range(q.dim()) if d != heads]
    if [q.shape[d] for d in outside] != [k.shape[d] for d in outside]:
        raise ValueError(f"core_attn q {tuple(q.shape)} and k {tuple(k.shape)} must agree in every dim but heads "
                         f"(batch, sequence along dim {seq_dim % q.dim()}, head dim)")
    if q.shape[heads] % k.shape[heads]:
        raise ValueError(f"core_attn: query heads {q.shape[heads]} must be a multiple of KV heads {k.shape[heads]} "
                         "(GQA)")


def softmax_scale(attn_mod, head_dim: int) -> float:
    """``attn_mod.softmax_scale`` (``None`` or absent: ``head_dim ** -0.5``; ``0.0`` is not "unset").

    Raises:
        TypeError: not a number. ValueError: not finite and > 0 (at 0 PyTorch's causal kernels return
            NaN: the masked ``-inf`` scores are multiplied by the scale).
    """
    scale = getattr(attn_mod, "softmax_scale", None)
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"attn_mod.softmax_scale={scale!r} must be a number (or None for head_dim ** -0.5)")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"attn_mod.softmax_scale={scale} must be a finite number > 0 (None: head_dim ** -0.5)")
    return float(scale)


def window_size(attn_mod) -> tuple[int, int] | None:
    """``attn_mod.window_size`` as Transformer Engine's ``(left, right)`` pair of ints (``-1``: unbounded), or None.

    Raises:
        TypeError: not a pair of ints. ValueError: a bound below -1.
    """
    window = getattr(attn_mod, "window_size", None)
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"attn_mod.window_size={window!r} must be a (left, right) pair of ints, -1 for unbounded "
                        "(Transformer Engine's convention), or None")
    if min(window) < -1:
        raise ValueError(f"attn_mod.window_size={tuple(window)}: each bound must be >= -1 (-1: unbounded)")
    return tuple(window)


VARIANT_ALIASES = {"sliding_window": "window_size=(W - 1, 0)", "attn_logit_softcapping": "softcap",
                   "s_aux": "sinks", "softmax_offset": "sinks", "chunk_size": "attention_chunk_size"}
"""Attributes other libraries name these variants by, refused on an ``attn_mod`` (a value there would
otherwise be ignored): the attribute the handlers read instead."""


def attention_variant(attn_mod, attn_mask_type: str, q: torch.Tensor, heads: int):
    """The mask and sinks of ``attn_mod``: ``(AttentionMask, sinks (heads,) or None)``.

    Attributes read: ``window_size`` (Transformer Engine's ``(left, right)``, ``-1`` unbounded; a causal left window
    ``(W - 1, 0)`` is the window ``W`` of :class:`~cp_handler.core.masks.AttentionMask`; with ``no_mask`` a two-sided
    ``(L, R)`` is the window ``L + 1`` and the right window ``R``), ``attention_chunk_size``
    (chunked attention, Llama 4), ``softcap`` (``softcap * tanh(score / softcap)``, Gemma 2) and ``sinks``
    (a tensor of one logit per query head, GPT-OSS). ``None`` or absent: not used.

    Raises:
        TypeError / ValueError: naming the attribute: a value of the wrong type, a window / chunk /
            soft-cap that is not positive, a right bound with the causal mask, ``(-1, 0)`` with
            ``no_mask`` (it is the causal mask), a chunk without a causal mask, sinks of the wrong shape, dtype
            or device, or an alias of another library (:data:`VARIANT_ALIASES`) set.
    """
    for alias, name in VARIANT_ALIASES.items():
        if getattr(attn_mod, alias, None) is not None:
            raise ValueError(f"attn_mod.{alias}={getattr(attn_mod, alias)!r} is not read by the handlers (it would be "
                             f"ignored); set attn_mod.{name} instead")
    causal = attn_mask_type == "causal"
    window, left, right = window_size(attn_mod), None, None
    if window == (-1, 0) and not causal:
        raise ValueError(f"attn_mod.window_size={window} with attn_mask_type='no_mask': (-1, 0) is the causal mask: "
                         "pass attn_mask_type='causal' (Transformer Engine refuses it too)")
    if window is not None and causal and window[1] not in (0, -1):
        raise ValueError(f"attn_mod.window_size={window} with attn_mask_type='causal': a causal mask takes left "
                         "windows (W - 1, 0) only; a right bound needs attn_mask_type='no_mask' (two-sided windows)")
    if window is not None:
        left = window[0] + 1 if window[0] >= 0 else None
        right = window[1] if window[1] >= 0 and not causal else None
    chunk = getattr(attn_mod, "attention_chunk_size", None)
    softcap = getattr(attn_mod, "softcap", None)
    if chunk is not None and not causal:
        raise ValueError(f"attn_mod.attention_chunk_size={chunk!r} needs attn_mask_type='causal'")
    try:
        mask = AttentionMask(causal=causal, window=left, chunk=chunk, softcap=softcap, window_right=right)
    except (TypeError, ValueError) as err:
        raise type(err)(f"attn_mod: {err} (attributes window_size, attention_chunk_size, softcap)") from None
    sinks = getattr(attn_mod, "sinks", None)
    try:
        check_sinks(sinks, heads, q)
    except (TypeError, ValueError) as err:
        raise type(err)(f"attn_mod.{err}") from None
    return mask, sinks


def variant_names(mask, sinks) -> list[str]:
    """The attributes of ``attn_mod`` behind ``mask`` / ``sinks`` that go beyond the plain mask, for errors."""
    used = []
    if mask.window is not None or mask.window_right is not None:
        left = -1 if mask.window is None else mask.window - 1
        right = 0 if mask.causal else (-1 if mask.window_right is None else mask.window_right)
        used.append(f"attn_mod.window_size={(left, right)} (sliding window)")
    if mask.chunk is not None:
        used.append(f"attn_mod.attention_chunk_size={mask.chunk} (chunked attention)")
    if mask.softcap is not None:
        used.append(f"attn_mod.softcap={mask.softcap} (soft-capping)")
    if sinks is not None:
        used.append(f"attn_mod.sinks {tuple(sinks.shape)} (learnable sinks)")
    return used


def variant_description(comm_type: str, mask, sinks, scale: float) -> str:
    """What shapes a ``core_attn`` call's communication and result beyond the tensors' shapes, in the terms the
    caller set them: the layer's comm type, the mask (``attn_mask_type`` and the ``attn_mod`` attributes of
    :func:`variant_names`: window, chunk, soft-cap, the sinks' shape) and the softmax scale. Compared across
    ranks (a window that differs between ranks would hang the halo exchange, or return an answer of neither
    window) and quoted when they differ, e.g. ``cp_comm_type='p2p', attn_mask_type='causal',
    attn_mod.window_size=(3, 0) (sliding window), softmax_scale=0.125``."""
    mask_type = "causal" if mask.causal else "no_mask"
    return ", ".join([f"cp_comm_type={comm_type!r}", f"attn_mask_type={mask_type!r}", *variant_names(mask, sinks),
                      f"softmax_scale={float(scale)!r}"])
