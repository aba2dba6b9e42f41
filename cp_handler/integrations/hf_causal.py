"""Training with a next-token loss needs a causal language model: the check the trainers, cp-train and
:class:`~.transformers.CPCausalLM` run before the first step (a bidirectional layer lets every position see its own
label: BERT built as ``BertLMHeadModel`` without ``is_decoder`` trained silently; an encoder-decoder has no causal
LM). The mask types come from the model's forward hook (:mod:`.hf_model`)."""

from __future__ import annotations

import torch
from torch import nn

from ..handlers.registry import build_cp_handler
from ..runtime.config import ContextParallelConfig
from .hf_inputs import cp_model_inputs, text_config


def check_decoder_only(model: nn.Module) -> None:
    """Raises ValueError for an encoder-decoder model (T5, BART): not a causal language model."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model, not a causal language model: "
                         "next-token training under context parallelism takes decoder-only models")


def check_causal(model: nn.Module, tokens: int = 8) -> None:
    """Training with a next-token loss needs a causal language model: no encoder-decoder, and every attention
    layer causal (a bidirectional layer lets each position see its own label). Checked on one forward at cp=1 in
    eval mode (skipped for weights on the ``meta`` device: the ranks check the built model).

    Raises:
        ValueError: naming the model and the bidirectional layers.
    """
    check_decoder_only(model)
    name = type(model).__name__
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return
    ids = torch.randint(1, min(int(getattr(text_config(model), "vocab_size", 100) or 100), 100), (1, tokens),
                        generator=torch.Generator().manual_seed(0)).to(weight.device)
    handler, was_training = build_cp_handler(ContextParallelConfig()), model.training
    model.eval()
    try:
        # eager even when compiled: a compiled layer's attention records no layer (:mod:`.hf_model`)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(input_ids=ids, **cp_model_inputs(handler, ids), use_cache=False, cp_handler=handler)
    finally:
        model.train(was_training)
    bidirectional = sorted(str(layer) for layer, kind in model.__dict__.get("_cp_mask_types", {}).items()
                           if kind != "causal")
    if bidirectional:
        raise ValueError(f"{name} is not a causal language model: its attention layers {bidirectional} attend "
                         "bidirectionally (every position would see its own next-token label); next-token training "
                         "refuses it (a decoder config sets is_decoder=True, where the architecture has one)")
