"""Rotary modules of a Hugging Face model under CP: RoPE that reads the sequence length (dynamic NTK, LongRoPE)
gets the global length, and generation checks that the tables did not change (see :mod:`.hf_model`'s doc).

Hooks on every ``*RotaryEmbedding`` module (:func:`install_rotary_hooks`): each forward gets one extra
position appended to ``position_ids``, the largest *global* position of the batch, and its output row for that
position dropped; under a handler with a KV cache a probe position too (:data:`POSITION_PROBE`)."""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.rope import PositionTablesChanged
from .hf_active import active_handler

POSITION_PROBE = 1
"""A position whose rotary rows a generation's prefill keeps and every decode step recomputes
(:meth:`~cp_handler.inference.KVCache.check_position_tables`): if they differ, the frequencies depend on
the sequence length and the cached keys are stale (position 0 would not show it: cos 1, sin 0)."""


def is_rotary(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary-embedding module (its class name ends in ``RotaryEmbedding``)."""
    return type(module).__name__.endswith("RotaryEmbedding")


def _with_positions(args, kwargs, position_ids: torch.Tensor):
    """A rotary module's call arguments with ``position_ids`` replaced (keyword or second positional)."""
    if "position_ids" in kwargs:
        return args, {**kwargs, "position_ids": position_ids}
    return (args[0], position_ids, *args[2:]), kwargs


def _rotary_pre_hook(module, args, kwargs):
    handler = active_handler()
    if handler is None:
        return None
    if "position_ids" not in kwargs and len(args) < 2:
        given = ", ".join(kwargs) or "only the hidden states"
        raise ValueError(f"{type(module).__name__} is called without position_ids ({given}): it builds its table "
                         "from a length its model derives from this rank's inputs (e.g. transformers 4.57's "
                         "PhiMoE: seq_len=cache_position[-1] + 1), not from the global sequence; refused under "
                         "context parallelism")
    position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
    appended = [handler.token_layout.max_position(position_ids.shape[-1])]
    cache = getattr(handler, "kv_cache", None)
    lengths = ()
    if cache is not None:
        appended.append(POSITION_PROBE)
        lengths = cache.lengths if cache.prefilled else handler.token_layout.document_lengths
    extra = torch.stack([torch.as_tensor(p, dtype=position_ids.dtype, device=position_ids.device) for p in appended])
    module._cp_rows = (position_ids.shape[-1], cache, tuple(lengths))
    return _with_positions(args, kwargs, torch.cat([position_ids, extra.expand(*position_ids.shape[:-1], -1)], -1))


def _tables(output) -> tuple:
    return output if isinstance(output, tuple) else (output,)


def _check_position_tables(module, args, kwargs, probe: tuple, cache, lengths: tuple) -> None:
    """Generation: the probe rows of this forward (``probe``) must be those of every sequence alone (its
    own length) and those of the prefill (:meth:`~cp_handler.inference.KVCache.check_position_tables`).

    Raises:
        PositionTablesChanged: they differ (RoPE that depends on the sequence length).
    """
    name = getattr(module, "_cp_name", type(module).__name__)
    def shown(value) -> str:
        return "tensor" if isinstance(value, torch.Tensor) else str(value)

    others = [*map(shown, args[2:]), *(f"{k}={shown(v)}" for k, v in sorted(kwargs.items()) if k != "position_ids")]
    if others:  # one module serving several tables (ModernBERT, Gemma 3: a layer_type argument)
        name += f" ({', '.join(others)})"
    position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
    for length in sorted(set(lengths)):
        alone = torch.tensor([length - 1, POSITION_PROBE], dtype=position_ids.dtype, device=position_ids.device)
        own_args, own_kwargs = _with_positions(args, kwargs, alone.expand(*position_ids.shape[:-1], -1))
        own = _tables(module.forward(*own_args, **own_kwargs))
        if any(not torch.equal(t.narrow(-2, 1, 1), p) for t, p in zip(own, probe, strict=True)):
            raise PositionTablesChanged(f"{name}: a sequence of {length} tokens alone has other position tables than "
                                        f"the batch of lengths {sorted(set(lengths))}")
    cache.check_position_tables(name, probe)


def _rotary_hook(module, args, kwargs, output):
    if module.__dict__.get("_cp_rows") is None:
        return None
    rows, cache, lengths = module.__dict__.pop("_cp_rows")
    width = rows + (2 if cache is not None else 1)
    tables = _tables(output)
    for t in tables:
        if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] == width):
            raise ValueError(f"{type(module).__name__} returned {tuple(getattr(t, 'shape', ()))}: cp_handler expects "
                             f"rotary tables with {width} positions along dim -2")
    if cache is not None:
        _check_position_tables(module, args, kwargs, tuple(t.narrow(-2, rows + 1, 1) for t in tables), cache, lengths)
    stripped = tuple(t.narrow(-2, 0, rows) for t in tables)
    return stripped if isinstance(output, tuple) else stripped[0]


def install_rotary_hooks(model: nn.Module, skip: frozenset = frozenset()) -> list:
    """The rotary hooks on every rotary module of ``model`` but those whose ``id`` is in ``skip`` (a vision-language
    model's vision tower: :func:`.hf_vlm.vision_modules`); returns their handles."""
    handles = []
    for name, module in model.named_modules():
        if is_rotary(module) and id(module) not in skip:
            module._cp_name = name or type(module).__name__
            handles += [module.register_forward_pre_hook(_rotary_pre_hook, with_kwargs=True),
                        module.register_forward_hook(_rotary_hook, with_kwargs=True, always_call=True)]
    return handles
