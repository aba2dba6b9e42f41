"""A Hugging Face training batch (what transformers' and TRL's collators emit) as this rank's CP inputs.

:func:`shard_batch` takes the global batch every rank of a CP group holds and returns the handler of the batch
and the model inputs of this rank: ``input_ids`` dispatched, the labels shifted in **global** order first
(transformers' ``shift_labels`` convention, which its causal-LM loss and TRL's fused LM head take without
shifting again), global ``position_ids`` (:func:`~.hf_inputs.cp_model_inputs`). Two layouts:

* **padded rows** (bshd): ``input_ids (B, S)`` with an optional right-padding ``attention_mask``; ``S`` is padded
  on the right to a multiple of ``2 * cp`` (padding rows: token 0, label ``-100``; right padding is exact for
  every real token under causal attention, which never looks ahead). Left padding, and any mask that is not
  right padding, is refused by name: transformers' mask would hide the padding from later tokens, which the
  handler's causal layout cannot;
* **packed documents** (thd): ``input_ids (1, T)`` with ``cu_seq_lens_q`` (transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, TRL's ``padding_free=True``) or ``position_ids``
  that restart at 0 at each document; the handler attends within documents and restarts RoPE per document.

Keys it does not know are refused by name (a tensor with a sequence dimension passed on unsharded would be
silently wrong).

**Vision-language models** (``vision_language=True``; :mod:`.hf_vlm`): the model takes the whole batch, so
``input_ids`` (and the per-token ``mm_token_type_ids`` / ``token_type_ids`` and the right-padding
``attention_mask``, which the model's own position function reads) stay whole, padded on the right to a multiple of
``2 * cp``; the vision inputs (:data:`VISION_KEYS`: pixels, grids,
image sizes) are passed on as they are; only the labels are this rank's. Padded rows only (the models compute
positions per row: packed documents and ``position_ids`` are refused by name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.layout import DETERMINISTIC_MULTIPLE
from ..handlers.base import ContextParallelHandler
from ..handlers.registry import build_cp_handler
from ..runtime.config import ContextParallelConfig
from .hf_inputs import cp_model_inputs, handler_real_tokens

IGNORE_INDEX = -100
"""transformers' label of a position without loss."""
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""Packed-sequence metadata of the collators: read into the handler's layout, not passed to the model."""
PASSED_ON = ("use_cache", "return_loss", "output_router_logits")
"""Keys passed to the model as they are (no sequence dimension)."""
KNOWN = frozenset(("input_ids", "attention_mask", "labels", "shift_labels", "position_ids", *PACKING_KEYS,
                   *PASSED_ON))
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
               "pixel_attention_mask", "image_sizes")
"""A vision-language batch's vision inputs (TRL's vision collator, the processors): no sequence dimension, passed on
to the model whole (its vision tower runs on every image of the batch)."""
TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")
"""A vision-language batch's per-token types ``(B, S)``: passed whole, padded like ``input_ids``."""


@dataclass
class ShardedBatch:
    """This rank's part of a batch: ``handler``, the model's ``inputs``, the global sequence length,
    ``shift_labels`` (global, ``None`` without labels) and ``token_mask`` (bool ``(B, S_local)``: this rank's real
    tokens, neither the batch's padding nor the handler's)."""

    handler: ContextParallelHandler
    inputs: dict
    seq_len: int
    shift_labels: torch.Tensor | None
    token_mask: torch.Tensor


def shard_batch(batch: dict, config: ContextParallelConfig, cp_group=None, hierarchical_cp_groups=None,
                vision_language: bool = False, cp_comm_hold=None) -> ShardedBatch:
    """The handler of ``batch`` and this rank's model inputs (module doc). Every rank of ``cp_group`` calls it
    with the same batch. ``vision_language``: the batch of a vision-language model (module doc). ``cp_comm_hold``:
    ``"auto"``'s :class:`~cp_handler.auto.PatternHold` shared by a run's batches (the trainers pass theirs).

    Raises:
        ValueError: an unknown key (the vision keys without ``vision_language``), left padding (or another mask than
            right padding), packed documents with a batch dimension other than 1 or positions that disagree with
            ``cu_seq_lens_q``, ``position_ids`` of padded rows that are not ``0..S-1``; for a vision-language model
            packed documents or ``position_ids`` (before any collective).
    """
    known = KNOWN | set(VISION_KEYS + TOKEN_TYPE_KEYS) if vision_language else KNOWN
    unknown = sorted(set(batch) - known)
    if unknown:
        vision = sorted(set(unknown) & set(VISION_KEYS + TOKEN_TYPE_KEYS))
        why = f" ({vision}: vision inputs, for a vision-language model)" if vision else ""
        raise ValueError(f"batch keys {unknown} are not implemented under context parallelism (each would be passed "
                         f"on unsharded){why}; known keys: {sorted(known)}")
    input_ids = batch["input_ids"]
    shift_labels = batch.get("shift_labels")
    if shift_labels is None and batch.get("labels") is not None:
        shift_labels = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    cu_seqlens = packed_cu_seqlens(batch)
    if vision_language and (cu_seqlens is not None or "position_ids" in batch):
        raise ValueError("a vision-language model's batch with " + ("packed documents" if cu_seqlens is not None else
                         "position_ids") + ": not implemented under context parallelism (the model computes its "
                         "positions from each whole row, e.g. Qwen's 3-D mRoPE); pass padded rows without position_ids")
    if cu_seqlens is None:
        input_ids, shift_labels = _padded_rows(batch, input_ids, shift_labels, config)
        meta = {"qkv_format": "bshd"}
    else:
        meta = {"qkv_format": "thd", "cu_seqlens": cu_seqlens}
    if cp_comm_hold is not None:
        meta["cp_comm_hold"] = cp_comm_hold
    handler = build_cp_handler(config, cp_group=cp_group, hierarchical_cp_groups=hierarchical_cp_groups, **meta)
    local_ids = handler.dispatch(input_ids, 1)
    if cu_seqlens is None:
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        token_mask = handler.dispatch(F.pad(real.long(), (0, input_ids.shape[1] - real.shape[1])), 1).bool()
    else:
        token_mask = handler_real_tokens(handler, local_ids)
    if vision_language:  # the whole batch: the model dispatches after its vision tower (:mod:`.hf_vlm`)
        padded = input_ids.shape[1] - batch["input_ids"].shape[1]
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))  # for the model's own positions
        inputs = {"input_ids": input_ids, "attention_mask": F.pad(real, (0, padded)),
                  **{k: F.pad(batch[k], (0, padded)) for k in TOKEN_TYPE_KEYS if batch.get(k) is not None},
                  **{k: batch[k] for k in (*VISION_KEYS, *PASSED_ON) if k in batch}}
    else:
        inputs = {"input_ids": local_ids, **cp_model_inputs(handler, local_ids),
                  **{k: batch[k] for k in PASSED_ON if k in batch}}
    if shift_labels is not None:  # thd padding rows dispatch as 0: shifted so that they come out as -100
        local_labels = handler.dispatch(shift_labels - IGNORE_INDEX, 1) + IGNORE_INDEX
        inputs.update(labels=local_labels, shift_labels=local_labels)
    return ShardedBatch(handler, inputs, batch["input_ids"].shape[1], shift_labels, token_mask)


def packed_cu_seqlens(batch: dict) -> torch.Tensor | None:
    """``cu_seqlens`` (int32) of a packed batch: ``cu_seq_lens_q``, or where ``position_ids`` restart at 0
    (``None``: padded rows, positions ``0..S-1`` or none). Raises ValueError (:func:`shard_batch`)."""
    positions, cu = batch.get("position_ids"), batch.get("cu_seq_lens_q")
    batch_size, length = batch["input_ids"].shape
    if cu is None and positions is not None and batch_size == 1 and bool((positions[0, 1:] == 0).any()):
        cu = torch.cat([(positions[0] == 0).nonzero().flatten(), torch.tensor([length], device=positions.device)])
    if cu is None:
        return None
    cu = cu.flatten().to(torch.int32)
    if batch_size != 1:
        raise ValueError(f"packed documents (cu_seq_lens_q) need input_ids of shape (1, T), got {(batch_size, length)}")
    if positions is not None:
        want = torch.arange(length, device=cu.device) - torch.repeat_interleave(cu[:-1], cu.diff()).long()
        if not torch.equal(positions[0].long().cpu(), want.cpu()):
            raise ValueError("position_ids of the packed batch do not restart at 0 at each document of cu_seq_lens_q; "
                             "refused (which one is meant?)")
    if "attention_mask" in batch and not bool(batch["attention_mask"].all()):
        raise ValueError("packed documents with an attention_mask holding zeros: padding inside a packed batch is "
                         "not implemented under context parallelism")
    return cu


def _padded_rows(batch: dict, input_ids: torch.Tensor, shift_labels, config):
    """bshd: the right-padding check, then ``S`` padded on the right to a multiple of ``2 * cp`` (in the deterministic
    mode also of :data:`~cp_handler.core.layout.DETERMINISTIC_MULTIPLE`: one padded length at every CP degree)."""
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("attention_mask has padding before real tokens (left padding, or holes): under context "
                         "parallelism only right padding is exact; set tokenizer.padding_side = 'right'")
    positions = batch.get("position_ids")
    if positions is not None:
        want = torch.arange(input_ids.shape[1], device=positions.device).expand_as(positions)
        if not torch.equal(positions, want):
            raise ValueError("position_ids of padded rows must be 0..S-1 (positions come from the handler's layout); "
                             "other positions (left padding) are refused")
    multiple = 2 * config.context_parallel_size
    if config.deterministic:
        multiple = math.lcm(multiple, DETERMINISTIC_MULTIPLE)
    pad = -input_ids.shape[1] % multiple
    if pad:
        input_ids = F.pad(input_ids, (0, pad))
        shift_labels = None if shift_labels is None else F.pad(shift_labels, (0, pad), value=IGNORE_INDEX)
    return input_ids, shift_labels
