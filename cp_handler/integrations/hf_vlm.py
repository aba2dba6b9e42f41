"""Vision-language models (VLMs) under CP: the vision tower and the merge on the whole sequence, the language
model on this rank's shard.

A Hugging Face VLM embeds the tokens, runs its vision tower on ``pixel_values``, scatters the features into the
image placeholder rows of ``inputs_embeds`` and hands the merged sequence to its language model (LM: the
submodule holding ``embed_tokens`` under the text config, e.g. ``model.model.language_model`` of Qwen2.5-VL,
``model.language_model.model`` of Llama 4, ``model.model.text_model`` of Idefics3). Under a handler
(:func:`prepare_vision_language`, called by ``register(model)``):

* **the whole batch goes in**: every rank of the CP group calls the model on the same global batch
  (``input_ids (B, S)``, ``S`` a multiple of ``2 * cp``, pixels, grids, token types); the vision tower runs on every
  image on every rank of the group (**replicated**, the simple choice: no bytes move for it; its compute is
  repeated ``cp`` times; its parameters' gradients, like every other parameter's, are this rank's share, summed by
  the data-parallel all-reduce over the dp x cp ranks);
* **the vision tower keeps its own attention** (``set_attn_implementation({"text_config": "cp_handler"})``: the
  vision config keeps its implementation) and its rotary modules get no hooks;
* **the LM's inputs are dispatched** by a pre-hook on the LM (:func:`_language_model_pre_hook`): the merged
  ``inputs_embeds``; the positions the model computed on the whole sequence (Qwen's 3-D mRoPE ``position_ids``,
  ``(3, B, S)`` from ``get_rope_index``, with their gaps; their largest is what RoPE reading the length gets), or
  ``0..S-1`` where the model passes none; Qwen3-VL's
  deepstack inputs (``visual_pos_masks`` dispatched, the rows of ``deepstack_visual_embeds`` of this rank's visual
  tokens taken in its order); the mask becomes the handler's layout (an all-ones local mask; a dict of masks built
  outside the LM, Gemma 3's, is classified again at the global length). So the LM returns this rank's hidden
  states and the model returns this rank's logits ``(B, S / cp, V)``, in the handler's order.

Refused by name, before any collective: an LM call with a tensor argument this hook does not know (it would be
passed on unsharded), packed documents (thd: the models compute positions per row), a cache (by its type, whatever
the argument's name: :mod:`.hf_cache`, in the generic hook), left padding or holes in ``attention_mask``, Qwen-style
mRoPE models given images without ``mm_token_type_ids`` (without it transformers silently falls back to positions
``0..S-1``), and Gemma 3's image blocks (``token_type_ids`` marking images: bidirectional attention within each
image, a mask the handler does not compute).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..handlers.base import ContextParallelHandler
from .hf_active import active_handler, set_forward_token_mask
from .hf_attention import HARMLESS
from .hf_inputs import text_config
from .hf_mask import CPMask, classify_at_creation

LM_SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "cache_position", "attention_mask",
                      "visual_pos_masks", "deepstack_visual_embeds")
"""The LM's arguments the pre-hook dispatches (or replaces); every other tensor argument must be :data:`HARMLESS`
(a loss argument passed down, a flag), else the call is refused."""
VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw")
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")


def is_vision_language(model: nn.Module) -> bool:
    """Whether ``model`` is a VLM: its config has a ``vision_config`` and a separate text config."""
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None and text_config(model) is not config


def language_model(model: nn.Module) -> nn.Module:
    """The LM of a VLM: the outermost submodule with ``embed_tokens`` whose config is the text config.

    Raises:
        ValueError: none found (the model's layout is not one this integration knows).
    """
    text = text_config(model)
    for module in model.modules():
        if module is not model and getattr(module, "config", None) is text and hasattr(module, "embed_tokens"):
            return module
    raise ValueError(f"{type(model).__name__}: no submodule with embed_tokens under the text config (the language "
                     "model a vision-language model hands its merged sequence to); not supported under context "
                     "parallelism")


def vision_modules(model: nn.Module) -> set[int]:
    """``id`` of every module of ``model`` outside its language model and not an ancestor of it (the vision tower,
    the projector): modules whose rotary tables and attention are their own."""
    lm = language_model(model)
    path = next(name for name, m in model.named_modules() if m is lm)
    inside = {id(m) for m in lm.modules()}
    return {id(m) for name, m in model.named_modules()
            if id(m) not in inside and not (name == "" or path.startswith(name + "."))}


def set_text_attention(model: nn.Module, implementation: str) -> None:
    """Switch the text config (and the modules built from it) to ``implementation``; the vision config keeps its own
    (transformers' dict form of ``set_attn_implementation``)."""
    keys = [k for k in model.config.sub_configs if getattr(model.config, k, None) is text_config(model)]
    if not keys:
        raise ValueError(f"{type(model).__name__}: its text config is not one of its sub-configs "
                         f"{sorted(model.config.sub_configs)}; not supported under context parallelism")
    model.set_attn_implementation({key: implementation for key in keys})


def _global_batch(handler: ContextParallelHandler, name: str, tensor: torch.Tensor) -> None:
    if handler.qkv_format == "thd":
        raise ValueError(f"{name}: packed documents (qkv_format='thd') of a vision-language model are not implemented "
                         "under context parallelism (its positions are computed per row); use padded rows")
    multiple = 2 * handler.cp_size
    if handler.cp_size > 1 and tensor.shape[1] % multiple:
        raise ValueError(f"{name} has {tensor.shape[1]} tokens per row: a vision-language model under context "
                         f"parallelism takes the whole batch, padded on the right to a multiple of 2 * cp = {multiple} "
                         "(shard_batch does it)")


def _model_pre_hook(model, args, kwargs, mrope: bool):
    """On the VLM itself, after the generic hook made the forward's handler active (:mod:`.hf_model`): the rules of
    the whole batch (module doc). A right-padding ``attention_mask`` stays as it is for the model's own position
    function (Qwen's ``get_rope_index`` gives padding position 1, as in one process); the LM's mask becomes the
    handler's layout (the LM pre-hook), whose causal order keeps real tokens from padding on the right; the mask,
    dispatched, is the forward's real-token mask (:func:`~.hf_active.set_forward_token_mask`: what counts tokens, the
    router loss, counts these)."""
    handler = active_handler()
    if handler is None:
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError(f"{type(model).__name__} under context parallelism takes input_ids (the whole batch), "
                         "not inputs_embeds alone")
    _global_batch(handler, "input_ids", ids)
    visual = any(kwargs.get(k) is not None for k in (*IMAGE_INPUTS, *VIDEO_INPUTS))
    if visual and mrope and kwargs.get("mm_token_type_ids") is None and \
            kwargs.get("position_ids") is None:
        raise ValueError(f"{type(model).__name__}: images or videos without mm_token_type_ids: its 3-D positions "
                         "(get_rope_index) need them, and without them transformers falls back to positions 0..S-1 "
                         "(silently wrong); pass the processor's mm_token_type_ids (return_mm_token_type_ids=True)")
    token_types = kwargs.get("token_type_ids")
    if token_types is not None and bool((token_types != 0).any()):
        raise ValueError(f"{type(model).__name__}: token_type_ids mark image tokens, which attend bidirectionally "
                         "within each image (Gemma 3's image blocks): a mask cp_handler does not compute under context "
                         "parallelism; refused (dropping token_type_ids would change the logits of image rows)")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)} for input_ids {tuple(ids.shape)}: under "
                             "context parallelism a vision-language model takes a (B, S) padding mask")
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("attention_mask has padding before real tokens (left padding, or holes): under context "
                             "parallelism only right padding is exact; set the processor's padding_side = 'right'")
        if not bool(mask.all()):  # this rank's real tokens, for what counts tokens (the router loss)
            set_forward_token_mask(handler.dispatch(mask.long(), 1).bool())
    return args, kwargs


def _visual_rows(handler: ContextParallelHandler, visual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``visual_pos_masks`` dispatched, and the indices (into the global visual rows, batch-major as transformers
    orders them) of this rank's visual tokens in its own batch-major order."""
    order = visual.flatten().long().cumsum(0).view_as(visual) - 1
    local = handler.dispatch(visual.long(), 1).bool()
    return local, handler.dispatch(order, 1)[local]


def _language_model_pre_hook(lm, args, kwargs):
    """Dispatch the merged sequence and what goes with it (module doc); a no-op without an active handler. The rules
    of the whole batch (layout, length) were checked by :func:`_model_pre_hook` on the same call, and a cache was
    refused by the generic hook (:mod:`.hf_cache`)."""
    handler = active_handler()
    if handler is None:
        return None
    if args:
        raise ValueError(f"{type(lm).__name__} was called with {len(args)} positional arguments: cp_handler's "
                         "vision-language route dispatches keyword arguments only")
    unknown = sorted(k for k, v in kwargs.items() if k not in LM_SEQUENCE_INPUTS and k not in HARMLESS and
                     (isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and
                                                       any(isinstance(t, torch.Tensor) for t in v))))
    if unknown:
        raise ValueError(f"{type(lm).__name__} was given {unknown}: tensors cp_handler's vision-language route does "
                         f"not shard (it dispatches {list(LM_SEQUENCE_INPUTS)}); refused instead of passed on whole")
    sequence = next((kwargs[k] for k in ("inputs_embeds", "input_ids") if kwargs.get(k) is not None), None)
    if sequence is None:
        raise ValueError(f"{type(lm).__name__} was called without inputs_embeds or input_ids")
    batch, length = sequence.shape[:2]
    for key in ("input_ids", "inputs_embeds"):
        if kwargs.get(key) is not None:
            kwargs[key] = handler.dispatch(kwargs[key], 1)
    local_len = length // handler.cp_size
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=sequence.device).expand(batch, -1)
    if positions.shape[-1] != length:
        raise ValueError(f"position_ids of shape {tuple(positions.shape)} for a sequence of {length} tokens")
    rotary = positions[1:] if positions.dim() == 3 and positions.shape[0] == 4 else positions  # row 0: text positions
    handler.token_layout.set_max_position(rotary.max())  # RoPE reading the length: one process's (:mod:`.hf_rotary`)
    kwargs["position_ids"] = handler.dispatch(positions, positions.dim() - 1)
    if kwargs.get("cache_position") is not None:
        kwargs["cache_position"] = handler.dispatch(kwargs["cache_position"], 0)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict):  # built outside the LM on the whole sequence (Gemma 3): classified at its length
        for value in mask.values():
            if isinstance(value, CPMask) and value.forward_handler is not None:
                classify_at_creation(value, local_len)
    else:  # all ones: without a mask transformers re-derives documents from the zigzag's jumps in the positions
        kwargs["attention_mask"] = torch.ones(batch, local_len, dtype=torch.long, device=sequence.device)
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:
        kwargs["visual_pos_masks"], rows = _visual_rows(handler, visual)
        if kwargs.get("deepstack_visual_embeds") is not None:
            kwargs["deepstack_visual_embeds"] = [embeds[rows] for embeds in kwargs["deepstack_visual_embeds"]]
    return args, kwargs


def prepare_vision_language(model: nn.Module) -> list:
    """The hooks of the module doc on ``model`` (a VLM: :func:`is_vision_language`); returns their handles. Its
    attention implementation is set by ``register`` (:func:`set_text_attention`)."""
    mrope = any(hasattr(m, "get_rope_index") for m in model.modules())  # positions from the model (Qwen's mRoPE)
    return [model.register_forward_pre_hook(functools.partial(_model_pre_hook, mrope=mrope), with_kwargs=True),
            language_model(model).register_forward_pre_hook(_language_model_pre_hook, with_kwargs=True)]
