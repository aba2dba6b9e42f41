"""What a Hugging Face model's forward takes under a handler: every local token's global position, the
all-ones mask, and the text config the model reads its shape from."""

from __future__ import annotations

import torch
from torch import nn

from ..handlers.base import ContextParallelHandler


def text_config(model: nn.Module):
    """The config of the model's text part (``get_text_config()``: multimodal models nest it), else ``config``."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def handler_real_tokens(handler: ContextParallelHandler, local_ids: torch.Tensor) -> torch.Tensor:
    """bool ``(B, S_local)``: the local slots holding tokens of the batch, from the handler's layout
    (:meth:`~cp_handler.handlers.token_layout.TokenLayout.real_token_mask`: thd, not the padding the handler adds;
    bshd, every slot)."""
    real = handler.token_layout.real_token_mask()
    if real is None:
        return torch.ones(local_ids.shape, dtype=torch.bool, device=local_ids.device)
    return real.to(local_ids.device).view(1, -1).expand(local_ids.shape[0], -1)


def local_position_ids(handler: ContextParallelHandler, input_ids: torch.Tensor) -> torch.Tensor:
    """Global position of every local token (``(B, S_local)`` int64; thd: restarting per document,
    0 at the padding slots the handler adds), as the model's rotary embedding takes them."""
    positions = handler.token_layout.positions(input_ids.shape[1], input_ids.device)
    return positions.view(1, -1).expand(input_ids.shape[0], -1)


def cp_model_inputs(handler: ContextParallelHandler, input_ids: torch.Tensor) -> dict:
    """The keyword arguments a model's forward takes under ``handler``: ``position_ids`` and
    ``cache_position`` (global positions, :func:`local_position_ids`) and an all-ones
    ``attention_mask`` (so transformers does not re-derive documents from the zigzag's jumps in the
    positions; the handler's layout is the mask)."""
    positions = local_position_ids(handler, input_ids)
    return {"position_ids": positions, "cache_position": positions[0],
            "attention_mask": torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)}
