"""Load a Hugging Face ``LlamaForCausalLM`` into :class:`cp_handler.models.gpt.GPTModel` (``from_hf_llama``; this
module imports the model, the model does not import it).

Parameter names match HF's (``model.`` prefix dropped), so the state dict maps one to one.
Features the reference model does not have (biases, rope scaling) are refused, not ignored.
"""

from __future__ import annotations

from .gpt import GPTConfig, GPTModel


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        raise ValueError(f"rope scaling {rope_type!r}/{scaling!r} is not supported: only default RoPE")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has no rope_theta")
    return float(theta)


def gpt_config_from_hf(hf_config) -> GPTConfig:
    """GPTConfig of a HF ``LlamaConfig``.

    Raises:
        ValueError: attention or MLP bias, or rope scaling (not in the reference model).
    """
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"HF config {flag}=True is not supported by models.GPTModel")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=head_dim,
        rotary_base=_rope_theta(hf_config),
        norm_epsilon=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def from_hf_llama(hf_model) -> GPTModel:
    """A :class:`~cp_handler.models.gpt.GPTModel` with the weights of a Hugging Face ``LlamaForCausalLM``, same dtype.

    Raises:
        ValueError: a feature the reference model does not have (:func:`gpt_config_from_hf`), or a
            state dict that does not match.
    """
    model = GPTModel(gpt_config_from_hf(hf_model.config))
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (model.config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"HF Llama state dict does not match GPTModel: missing {missing}, unexpected {unexpected}")
    return model.to(next(hf_model.parameters()).dtype)
