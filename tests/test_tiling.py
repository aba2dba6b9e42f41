"""Tiled MLPs (``cp_handler.models.tiling.tile_mlps``, ``cp-train --mlp-chunk-tokens``): every feed-forward block over
chunks of tokens, each recomputed in the backward.

* One process, float64: the reference GPT and a Hugging Face Llama with tiled MLPs give the loss and every
  parameter gradient of the same model with whole MLPs, with and without layer recomputation, chunks that do not
  divide the tokens included. Tolerance 1e-12: the chunks' matmuls sum the same products over fewer rows, so
  only float64 rounding differs (measured 1.3e-15 for the GPT).
* Under CP: ``cp-train --check-parity`` with tiled MLPs at cp 2 (the reference GPT with FSDP2 and recomputation;
  a Hugging Face Qwen2 on packed documents) against one process with whole MLPs (parity's float32 1e-5).
* What is not a dense MLP is refused by name before any module changes: a mixture of experts (ours, Mixtral's),
  GPT-2's ``Conv1D``, a model without ``mlp`` modules, an ``mlp`` that mixes tokens (the probe), a chunk below 1;
  and cp-train refuses them before any rank starts. The memory effect is counted in tests/test_bench.py.
"""

import copy

import pytest
import torch
from test_cli_hf import _hf_dir
from test_fsdp import _run
from torch import nn

from cp_handler.cli.args import parse
from cp_handler.models import GPTConfig, GPTModel
from cp_handler.models.loss import TokenLoss
from cp_handler.models.moe import SwiGLU
from cp_handler.models.tiling import tile_mlps

SHAPE = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 64,
         "vocab_size": 50}


def _gpt_loss(model, ids):
    return model(ids, output=TokenLoss(ids.roll(-1, 1), torch.ones(ids.shape, dtype=torch.float64)))


def _hf_loss(model, ids):
    return model(ids, labels=ids).loss


def _gpt():
    return GPTModel(GPTConfig(**SHAPE)).double()


def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()


@pytest.mark.parametrize("build, loss, names", [(_gpt, _gpt_loss, ["layers.0.mlp", "layers.1.mlp"]),
                                                (_llama, _hf_loss, ["model.layers.0.mlp", "model.layers.1.mlp"])])
@pytest.mark.parametrize("recompute", [False, True])
def test_tiled_mlps_give_the_whole_mlps_loss_and_gradients(build, loss, names, recompute):
    torch.manual_seed(0)
    whole = build()
    whole.train()
    tiled = copy.deepcopy(whole)
    assert tile_mlps(tiled, 7) == names  # 2 x 24 tokens: chunks of 7, the last one 6
    if recompute:
        getattr(tiled, "activation_checkpointing_enable", tiled.gradient_checkpointing_enable)()  # HF's name, GPT's
    ids = torch.randint(0, 50, (2, 24))
    want, got = loss(whole, ids), loss(tiled, ids)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for (name, p), q in zip(whole.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


class _TokenMixer(nn.Module):
    """Linear layers, but a running sum over the tokens: chunks give another result."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).cumsum(-2)


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_what_is_not_a_dense_mlp_is_refused_by_name():
    from transformers import GPT2Config, MixtralConfig

    moe = GPTModel(GPTConfig(**{**SHAPE, "num_moe_experts": 4}))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp \(MoEFeedForward\) cannot be tiled: its child 'experts'"):
        tile_mlps(moe, 4)
    mixtral = _meta(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, num_local_experts=4))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp \(MixtralSparseMoeBlock\) cannot be tiled"):
        tile_mlps(mixtral, 4)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.mlp \(GPT2MLP\) cannot be tiled: its child 'c_fc' "
                                         r"\(Conv1D\) is not an nn.Linear"):
        tile_mlps(_meta(GPT2Config(n_embd=32, n_layer=1, n_head=4)), 4)
    with pytest.raises(ValueError, match="Linear has no module named 'mlp'"):
        tile_mlps(nn.Linear(4, 4), 4)
    with pytest.raises(ValueError, match=r"mlp_chunk_tokens=0 must be >= 1"):
        tile_mlps(_gpt(), 0)
    model = nn.Module()
    model.first, model.second = nn.Module(), nn.Module()
    model.first.mlp, model.second.mlp = SwiGLU(8, 16), _TokenMixer()
    with pytest.raises(ValueError, match=r"second\.mlp \(_TokenMixer\) gives, on chunks of 4 tokens, another result"):
        tile_mlps(model, 4)
    assert "forward" not in vars(model.first.mlp)  # refused before any module changed
    assert tile_mlps(nn.ModuleDict({"mlp": SwiGLU(8, 16)}), 4) == ["mlp"]  # the negative control of the probe


def test_cp_train_with_tiled_mlps_matches_one_process(tmp_path):
    _, err = _run(tmp_path, "gpt", "--nproc", "2", "--fsdp", "--recompute", "--mlp-chunk-tokens", "48",
                  "--steps", "2", "--check-parity")
    assert "parity passed" in err, err[-2000:]
    _, err = _run(tmp_path, "hf", "--nproc", "2", "--hf-config", _hf_dir(tmp_path, False), "--packing", "thd",
                  "--mlp-chunk-tokens", "40", "--steps", "2", "--check-parity")
    assert "parity passed" in err, err[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--mlp-chunk-tokens", "0"], "--mlp-chunk-tokens 0 must be >= 1"),
    (["--mlp-chunk-tokens", "8", "--moe-experts", "4"], "--mlp-chunk-tokens with --moe-experts 4"),
    (["--mlp-chunk-tokens", "8", "--hf-config", "MIXTRAL"],
     r"--mlp-chunk-tokens: model\.layers\.0\.mlp \(MixtralSparseMoeBlock\) cannot be tiled"),
])
def test_cp_train_refuses_before_any_rank(tmp_path, flags, message, monkeypatch):
    from transformers import MixtralConfig

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, vocab_size=256).save_pretrained(tmp_path / "mixtral")
    flags = [str(tmp_path / "mixtral") if f == "MIXTRAL" else f for f in flags]
    with pytest.raises(SystemExit, match=message):
        parse(["--nproc", "2", *flags])
