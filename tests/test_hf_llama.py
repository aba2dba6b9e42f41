"""cp_handler.models.hf_llama.from_hf_llama: logits equal a Hugging Face LlamaForCausalLM built offline from a config.

Tolerance: float32 atol 1e-5 on logits of order 1e-1..1: both run the same math (RMSNorm, rotate-half
RoPE, SDPA, SwiGLU) and differ at most in float32 operation order.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cp_handler.models.hf_llama import from_hf_llama  # noqa: E402


def tiny_llama(**overrides):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-6, **overrides
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF's default init is tiny; larger weights make the comparison meaningful
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hf(tied):
    hf = tiny_llama(tie_word_embeddings=tied)
    model = from_hf_llama(hf)
    assert model.config.rotary_base == 50000.0 and model.config.num_query_groups == 2
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, model(ids)
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_unsupported_features_are_refused():
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        from_hf_llama(tiny_llama(attention_bias=True))
