"""cp-train's model flags: the reference GPT's shape, its MoE layers, or a Hugging Face config
(checked by the guard before any rank starts). Every error names the flag."""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..integrations.transformers import check_architecture, check_transformers
from ..models import GPTConfig
from ..models.tiling import tile_mlps
from ..runtime.config import AttentionShape
from ..training.tokens import BYTE_VOCAB_SIZE, has_tokenizer, tokens_for
from .training_args import check_compile_mixers, check_deterministic_mixers


def check_moe_flags(args: argparse.Namespace) -> None:
    """The MoE flags' rules (the expert layout itself is checked by ParallelLayout). Raises ValueError."""
    if args.expert_parallel_size != 1 and not args.moe_experts:
        raise ValueError(f"--expert-parallel-size {args.expert_parallel_size} needs --moe-experts E")
    if args.moe_experts < 0 or (args.moe_experts and args.moe_experts % args.expert_parallel_size):
        raise ValueError(f"--moe-experts {args.moe_experts} must be a multiple of --expert-parallel-size "
                         f"{args.expert_parallel_size} (each rank holds the same number of experts)")
    if args.moe_experts and (args.dynamic_cp or args.eval_every or args.check_eval_cp or args.eval_cp_size):
        raise ValueError("--moe-experts runs with a static CP layout and no evaluation: drop --dynamic-cp / "
                         "--eval-every / --eval-cp-size / --check-eval-cp")
    if (args.hf_config or args.hf_model) and args.moe_experts:
        raise ValueError("--moe-experts builds the reference GPT's MoE layers: drop it with --hf-config / --hf-model")


def hf_config(args: argparse.Namespace):
    """The Hugging Face config of ``--hf-config`` / ``--hf-model`` (``None`` without them).

    Raises:
        ValueError: both flags, a directory without a loadable config, tokenizer files that do not load, a
            vocabulary smaller than the tokens fed (the folder's tokenizer, else 256 bytes).
        ImportError: transformers missing or outside the tested releases.
    """
    if args.hf_config and args.hf_model:
        raise ValueError("--hf-config and --hf-model are exclusive: --hf-model DIR already has the config")
    source = args.hf_model or args.hf_config
    if source is None:
        return None
    flag = "--hf-model" if args.hf_model else "--hf-config"
    try:
        with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"{flag} {source}: no config.json in it (a Hugging Face model directory holds config.json"
                         f"{' and the weights' if args.hf_model else ''})") from None
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{flag} {source}: config.json is not a JSON object ({err})") from None
    if not model_type:  # transformers 4.x would guess the architecture from the folder's name
        raise ValueError(f"{flag} {source}: no loadable Hugging Face config (config.json has no model_type)")
    check_transformers()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag} {source}: no loadable Hugging Face config ({err})") from None
    check_causal_lm_config(config, f"{flag} {source}")
    tokens = tokens_for(source, flag)
    if getattr(config, "vocab_size", tokens.vocab_size) < tokens.vocab_size:
        feeds = (f"its tokenizer has {tokens.vocab_size} tokens" if has_tokenizer(source) else
                 f"without a tokenizer in it the tokens are bytes (0..{BYTE_VOCAB_SIZE - 1})")
        raise ValueError(f"{flag} {source}: vocab_size={config.vocab_size}, but {feeds}")
    return config


def check_causal_lm_config(config, where: str) -> None:
    """The config must have a causal-LM class in transformers (an encoder-decoder such as T5 has none; transformers
    would list every class it knows). Raises ValueError naming ``where`` and the model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = "an encoder-decoder model" if getattr(config, "is_encoder_decoder", False) else \
            "a model with no causal-LM class in transformers"
        raise ValueError(f"{where}: model_type {config.model_type!r} is {kind}, not a causal language model "
                         "(cp-train and cp-generate run decoder-only models)")


def check_hf_architecture(args: argparse.Namespace):
    """The Hugging Face guard on ``--hf-config`` / ``--hf-model``'s architecture, before any rank starts
    (:func:`~cp_handler.integrations.transformers.check_architecture`: the ranks' own message); returns
    the config (``None`` without the flags).

    Raises:
        ValueError: ``--hf-config DIR: <the guard's refusal>``.
    """
    config = hf_config(args)
    if config is None:
        return None
    try:
        check_architecture(config)
    except ValueError as err:
        raise ValueError(f"{_hf_flag(args)}: {err}") from None
    return config


def _hf_flag(args: argparse.Namespace) -> str:
    return f"{'--hf-model' if args.hf_model else '--hf-config'} {args.hf_model or args.hf_config}"


def check_hf_training(args: argparse.Namespace, config) -> None:
    """cp-train's rules for the Hugging Face ``config`` (generation has none of them): no randomness in
    training, gradient checkpointing with ``--recompute``, dense MLPs with ``--mlp-chunk-tokens`` (the model on
    ``meta``: its structure; the ranks probe the weights). Raises ValueError naming the flag."""
    try:
        check_training_is_deterministic(config)
        check_no_router_loss(config)
        if args.recompute:
            check_gradient_checkpointing(config)
        if args.compile:
            check_compile_mixers(config)
        if args.deterministic:
            check_deterministic_mixers(config)
        if args.mlp_chunk_tokens:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                tile_mlps(AutoModelForCausalLM.from_config(config), args.mlp_chunk_tokens)
    except ValueError as err:
        raise ValueError(f"{_hf_flag(args)}: {err}") from None


RANDOM_IN_TRAINING = ("dropout", "pdrop", "jitter", "layerdrop")
"""Parts of config field names whose non-zero value draws random numbers in training mode (dropout,
router jitter, layer drop)."""
OTHER_HEADS = ("classifier", "summary")
"""Field prefixes of other tasks' heads (sequence classification, GPT-2's summary): not in a causal LM."""


def check_training_is_deterministic(config) -> None:
    """cp-train trains Hugging Face models in training mode with no randomness: each step must equal one
    process's (``--check-parity``) and a resume must be exact; attention dropout does not run under CP at
    all. Raises ValueError naming every config field (of the config and its sub-configs) that would
    draw random numbers."""
    def fields(cfg, prefix=""):
        for name, value in vars(cfg).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config (text, vision...)
                yield from fields(value, f"{prefix}{name}.")
            elif any(part in name for part in RANDOM_IN_TRAINING) and not name.startswith(OTHER_HEADS) and \
                    isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                yield f"{prefix}{name}={value}"

    random = sorted(set(fields(config)))
    if random:
        raise ValueError(f"config.json sets {', '.join(random)}: cp-train trains without randomness (every step "
                         "equals one process's, and attention dropout does not run under context parallelism); "
                         "set them to 0")


def check_no_router_loss(config) -> None:
    """cp-train's Hugging Face route trains the next-token loss alone: a config that turns a MoE model's
    load-balancing loss on (``output_router_logits``) is refused rather than trained without it. Raises ValueError."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "output_router_logits", False) or getattr(config, "output_router_logits", False):
        raise ValueError(f"config.json sets output_router_logits=true (router_aux_loss_coef="
                         f"{getattr(text, 'router_aux_loss_coef', None)}): cp-train trains a Hugging Face model's "
                         "next-token loss only and would drop its load-balancing loss; set output_router_logits to "
                         "false, or train with CPTrainer / CPSFTTrainer, which add it from the whole sequence")


def check_gradient_checkpointing(config) -> None:
    """``--recompute`` needs an architecture with transformers' gradient checkpointing. Raises ValueError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not model_class.supports_gradient_checkpointing:
        raise ValueError(f"--recompute: {model_class.__name__} does not support gradient checkpointing in "
                         "transformers")


def model_shape(args: argparse.Namespace) -> tuple[GPTConfig | None, AttentionShape, str]:
    """``(reference GPT config or None for a Hugging Face model, its attention shape, the words that
    name where the heads come from)``; a Hugging Face architecture is checked by the guard and by
    cp-train's training rules first.

    Raises:
        ValueError: a GPT shape rule, the guard's refusal (:func:`check_hf_architecture`) or a training
            rule (:func:`check_hf_training`).
    """
    config = check_hf_architecture(args)
    if config is None:
        gpt = model_config(args)
        return gpt, AttentionShape(gpt.num_attention_heads, gpt.num_query_groups, gpt.kv_channels, gpt.v_head_dim), \
            f"--num-heads {gpt.num_attention_heads} / --num-kv-heads {gpt.num_query_groups}"
    check_hf_training(args, config)
    shape = hf_attention_shape(config)
    where = f"{args.hf_model or args.hf_config}/config.json"
    if shape is None:
        return None, None, f"no attention heads in {where}"
    return None, shape, f"{shape.num_heads} query heads / {shape.num_kv_heads} KV heads of {where}"


def hf_attention_shape(config) -> AttentionShape | None:
    """The attention shape of a Hugging Face config (its text config's heads and head dim); ``None`` for a model
    without attention heads (Mamba: its token mixers are routed, and no attention rule applies)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return AttentionShape(heads, kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads)


def hf_layers(args: argparse.Namespace) -> int:
    """Decoder layers of the ``--hf-config`` / ``--hf-model`` model (a per-layer comm type list's length)."""
    config = hf_config(args)
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers


def layer_types(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--layer-pattern`` as the GPT's ``layer_types`` (``None`` without it). Raises ValueError naming the flag."""
    pattern = args.layer_pattern
    if pattern is None:
        return None
    if args.hf_config or args.hf_model:
        raise ValueError("--layer-pattern shapes the reference GPT: drop it with --hf-config / --hf-model (the "
                         "Hugging Face config has the model's layer types)")
    if not pattern or set(pattern) - {"A", "L"} or args.num_layers % len(pattern):
        raise ValueError(f"--layer-pattern {pattern!r}: letters A (attention) and L (linear attention), its length "
                         f"dividing --num-layers {args.num_layers}")
    names = {"A": "full_attention", "L": "linear_attention"}
    return tuple(names[c] for c in pattern * (args.num_layers // len(pattern)))


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The reference GPT's shape from the flags (byte-level vocabulary). Raises ValueError."""
    return GPTConfig(
        vocab_size=BYTE_VOCAB_SIZE, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_query_groups=args.num_kv_heads,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels, v_head_dim=args.v_head_dim,
        rotary_base=args.rotary_base,
        num_moe_experts=args.moe_experts,
        moe_router_topk=args.moe_top_k, moe_aux_loss_coeff=args.moe_aux_loss_coeff, layer_types=layer_types(args),
    )
