"""The ``"cp_handler"`` attention function of transformers' ``AttentionInterface`` (registered by
:func:`~.transformers.register`): every attention layer of a registered model runs through its forward's handler's
``core_attn``, with every argument it accepts implemented (soft-capping and learnable sinks included) and the
others refused by name (:data:`HARMLESS`, :func:`check_arguments`); the layer's mask classified at global
positions (:mod:`.hf_mask`).

The handler comes with the call (:func:`call_handler`): the ``cp_handler`` keyword, which the model's hook leaves
in the forward's keyword arguments and transformers passes on through the decoder layers to the attention
function in the models that forward them (a recomputed layer gets them again); else the handler of the forward
that built the layer's mask (:class:`~.hf_mask.CPMask`: a decoder layer that drops extra keyword arguments,
StableLM's). Nothing else: the attention function never reads the context variable of :mod:`.hf_active`, and a
call with neither raises.
"""

from __future__ import annotations

import torch

from ..handlers.base import ContextParallelHandler
from .hf_active import record_attention_call
from .hf_inputs import local_position_ids
from .hf_mask import CPMask

HARMLESS = {
    "position_ids": lambda v: True,  # the handler's layout has the positions
    "cache_position": lambda v: True,
    "use_cache": lambda v: True,  # the cache update happens before attention; q/k lengths are checked
    "output_router_logits": lambda v: True,  # MoE routing, not attention
    "logits_to_keep": lambda v: True,  # the LM head's slice, not attention
    "shift_labels": lambda v: True,  # the loss's arguments, passed down every layer (Trainer, TRL); not attention
    "num_items_in_batch": lambda v: True,
    "output_attentions": lambda v: not v,
    "output_hidden_states": lambda v: True,  # collected between layers (Llama 4's VLM passes it down)
    "encoder_hidden_states": lambda v: v is None,
    "past_key_values": lambda v: v is None,
    "past_key_value": lambda v: v is None,
    "head_mask": lambda v: v is None,
    "block_indices": lambda v: v is None,
    "position_bias": lambda v: v is None,
    "cu_seq_lens_q": lambda v: v is None,
    "cu_seq_lens_k": lambda v: v is None,
    "max_length_q": lambda v: v is None,
    "max_length_k": lambda v: v is None,
}
"""Keyword arguments transformers passes to attention functions that change nothing here when their
value passes the test; any other value, and any other argument, is refused by name."""


def check_arguments(kwargs: dict) -> None:
    """Raises ValueError naming every argument that is not :data:`HARMLESS` with its value."""
    refused = {k: v for k, v in kwargs.items() if k not in HARMLESS or not HARMLESS[k](v)}
    if refused:
        shown = ", ".join(f"{k}={v if not isinstance(v, torch.Tensor) else 'tensor ' + str(tuple(v.shape))}"
                          for k, v in refused.items())
        raise ValueError(f"the model passed attention arguments cp_handler does not implement: {shown}; they are "
                         "refused instead of dropped (docs/huggingface.md lists what runs under CP)")


def check_local_index_scaling(module, handler: ContextParallelHandler, local_len: int) -> None:
    """Llama 4's attention temperature tuning scales the queries of its NoPE layers by
    ``log1p(floor((i + 1) / floor_scale))`` of each token's *index* ``i`` in the forward's input
    (transformers 5: ``torch.arange(length)``; 4.57: ``cache_position``, an index too by default), not of
    ``position_ids``. Exact when every real local token's index gives the scale of its global position;
    otherwise (a CP shard, a decode step of one token per sequence, documents packed after the first,
    once positions reach ``floor_scale - 1``) refused (ValueError), naming a row whose scale would differ."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    positions = local_position_ids(handler, torch.zeros((1, local_len), dtype=torch.long))[0]
    index = torch.arange(local_len)
    real = handler.token_layout.real_token_mask()
    real = torch.ones(local_len, dtype=torch.bool) if real is None else real.cpu()
    scale = module.floor_scale
    differs = (real & ((index + 1) // scale != (positions.cpu() + 1) // scale)).nonzero()
    if differs.numel():
        row = int(differs[0])
        raise ValueError(f"layer {module.layer_idx}: Llama 4's attention temperature tuning (NoPE layer, floor_scale="
                         f"{module.floor_scale}) scales each query by a function of its index in the model's input, "
                         f"not of its position: here input row {row} is at position {int(positions[row])}, whose "
                         "scale differs (a context-parallel shard, a decode step or a packed document reaching "
                         "floor_scale - 1); refused")


def _mask_type(module, attention_mask, is_causal, handler, local_len: int) -> tuple[str, str | None, int | None]:
    """``(attn_mask_type, "sliding" / "chunked" / None, size)`` of this layer from its mask (see :mod:`.hf_mask`)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None:
        return ("causal" if causal else "no_mask"), None, None
    if not isinstance(attention_mask, CPMask):
        raise ValueError(f"a materialised attention mask ({type(attention_mask).__name__} "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}) reached cp_handler's attention: under CP the "
                         "handler's layout is the mask; pass attention_mask from cp_model_inputs (2-D ones) instead")
    longest = handler.token_layout.max_seqlen or handler.get_rotary_seq_len(local_len)
    return _from_spec(module, attention_mask.spec(longest))


def _from_spec(module, spec) -> tuple[str, str | None, int | None]:
    """``(attn_mask_type, "sliding" / "chunked" / None, size)`` of a classified mask; ValueError for one the
    handler does not compute."""
    if spec.kind in ("causal", "bidirectional"):
        return ("causal" if spec.kind == "causal" else "no_mask"), None, None
    if spec.kind in ("sliding", "chunked"):
        return "causal", spec.kind, spec.size
    raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} asks for {spec.describe()}: not supported under "
                     "context parallelism by cp_handler")


def call_handler(cp_handler, attention_mask) -> ContextParallelHandler | None:
    """The handler of this attention call (module doc): the keyword, else the mask's, else ``None``."""
    mask_handler = attention_mask.forward_handler if isinstance(attention_mask, CPMask) else None
    return cp_handler or mask_handler


def cp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, sliding_window=None, softcap=None, s_aux=None, cp_handler=None, **kwargs):
    """transformers attention function: ``query (B, H, S_local, D)``, ``key``/``value`` with the KV
    heads -> ``(B, S_local, H, D)`` from ``handler.core_attn``. The mask is the model's own mask
    function classified at global positions (``attention_mask`` is a :class:`~.hf_mask.CPMask`):
    causal, bidirectional, a sliding window or chunks; ``softcap`` (Gemma 2) and ``s_aux`` (GPT-OSS's
    learnable sinks, one logit per query head) go to the handler as ``attn_mod.softcap`` / ``attn_mod.sinks``;
    ``cp_handler`` is the handler (:func:`call_handler`).

    Raises:
        RuntimeError: no handler (neither the keyword nor the mask's). ValueError: an argument or a mask
            cp_handler does not implement (see the module doc); q and k of different lengths (a decoding step with
            a cache); a ``sliding_window`` argument that disagrees with the mask.
    """
    handler = call_handler(cp_handler, attention_mask)
    if handler is None:
        raise RuntimeError("attn_implementation='cp_handler' needs a handler: pass cp_handler=handler to the "
                           "model's forward")
    if not getattr(module, "_cp_handler_prepared", False):
        raise ValueError(f"{type(module).__name__}: this model was not checked for context parallelism: call "
                         "cp_handler.integrations.transformers.register(model) once before running it")
    check_arguments(kwargs)
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported under context parallelism; set the "
                         "config's attention_dropout to 0 (or put the model in eval mode)")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    if torch.is_autocast_enabled(q.device.type):  # mixed precision (Trainer's bf16 / fp16): as autocast casts SDPA
        q, k, v = (t.to(torch.get_autocast_dtype(q.device.type)) for t in (q, k, v))
    if torch.compiler.is_compiling():  # what reads per-batch values runs where the mask was built (hf_mask)
        mask_type, kind, size = _compiled_mask_type(module, attention_mask, is_causal, sliding_window)
        layer = getattr(module, "layer_idx", None) if handler.layer_in_compiled_calls else None
    else:
        check_local_index_scaling(module, handler, q.shape[1])
        mask_type, kind, size = _mask_type(module, attention_mask, is_causal, handler, q.shape[1])
        record_attention_call(module, mask_type)
        longest = handler.token_layout.max_seqlen or handler.get_rotary_seq_len(q.shape[1])
        _check_sliding_window(module, kind, sliding_window, mask_type, longest)
        layer = getattr(module, "layer_idx", None)  # None: an attention block shared by several layers (Zamba)
    attn = LayerAttention(scaling, None if layer is None else layer + 1, (size - 1, 0) if kind == "sliding" else None,
                          size if kind == "chunked" else None, softcap, s_aux)
    out = handler.core_attn(attn, q, k, v, attn_mask_type=mask_type)
    return out.contiguous(), None  # (B, S, H, D) as transformers' own attention functions return it


class LayerAttention:
    """The ``attn_mod`` a transformers attention layer gives ``core_attn``: its variant attributes (a plain class:
    Dynamo traces its construction, not a SimpleNamespace's)."""

    def __init__(self, softmax_scale, layer_number, window_size, attention_chunk_size, softcap, sinks):
        self.softmax_scale, self.layer_number, self.window_size = softmax_scale, layer_number, window_size
        self.attention_chunk_size, self.softcap, self.sinks = attention_chunk_size, softcap, sinks


def _check_sliding_window(module, kind, sliding_window, mask_type: str, longest: int) -> None:
    if kind is None and sliding_window is not None and sliding_window < longest and mask_type == "causal":
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: sliding_window={sliding_window} was passed to "
                         "attention, but the layer's mask is a plain causal one; refused (which one is meant?)")


def _compiled_mask_type(module, attention_mask, is_causal, sliding_window) -> tuple[str, str | None, int | None]:
    """:func:`_mask_type` and the sliding-window check under torch.compile: from the spec classified where the mask
    was built (:func:`~.hf_mask.classify_at_creation`). Not checked here: Llama 4's temperature tuning of NoPE
    layers (refused under compile), and the layer record (the model counts the handler's calls instead)."""
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        raise ValueError("Llama 4's attention temperature tuning (NoPE layers) is checked per batch against the "
                         "positions; not under torch.compile: run this model without compiling")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None:
        return ("causal" if causal else "no_mask"), None, None
    if not isinstance(attention_mask, CPMask) or attention_mask.created is None:
        raise ValueError("under torch.compile, cp_handler's attention needs the mask built by its mask function in "
                         "a forward with a handler (pass attention_mask from cp_model_inputs and cp_handler=handler)")
    mask_type, kind, size = _from_spec(module, attention_mask.created)
    if kind is None and sliding_window is not None and mask_type == "causal":  # reads the batch's length (a guard)
        _check_sliding_window(module, kind, sliding_window, mask_type, attention_mask.longest)
    return mask_type, kind, size
