"""cp-train with Hugging Face models (``--hf-config`` / ``--hf-model``): parity with the unmodified model
(its own attention implementation), attention variants, the flag rules and the guard's refusals, all
before any rank starts."""

import re

import pytest
from test_cli import cp_generate, cp_train

from cp_handler.cli.args import parse


def _hf_dir(tmp_path, weights: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    folder = tmp_path / ("model" if weights else "config")
    if weights:
        Qwen2ForCausalLM(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("flags", [["--nproc", "2", "--packing", "thd", "--cp-comm-type", "a2a", "--recompute"],
                                   ["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "2"]])
def test_hugging_face_model_trains_with_parity(tmp_path, flags):
    """cp-train drives an unmodified transformers model (Qwen2: q/k/v biases, GQA) through the integration
    (bshd p2p at cp 2 with --check-parity: the Gemma 2 test below and test_checkpoint's Hugging Face resume);
    the thd case loads weights (from_pretrained: eval mode, put in training mode) and recomputes its layers
    (transformers' gradient checkpointing, which runs only in training mode)."""
    weights = "thd" in flags
    source = ["--hf-model" if weights else "--hf-config", _hf_dir(tmp_path, weights)]
    result = cp_train(*flags, *source, "--steps", "3", "--seq-len", "128", "--max-corpus-bytes", "2000000",
                      "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr


def test_hugging_face_attention_variants_train_with_parity(tmp_path):
    """Gemma 2 (sliding window of 48 < the 128-token sequence, attention soft-capping) through cp-train
    --hf-config with --check-parity (the reference: the unmodified model, eager attention)."""
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, sliding_window=48,
                 attn_logit_softcapping=0.5).save_pretrained(tmp_path)
    result = cp_train("--nproc", "2", "--hf-config", str(tmp_path), "--steps", "2", "--seq-len", "128",
                      "--max-corpus-bytes", "2000000", "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr


def test_hugging_face_flag_rules(tmp_path, monkeypatch):
    """Checked in the launcher before any rank starts (in-process ``parse``)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    for flags, message in ((["--hf-config", str(empty)], f"--hf-config {empty}: no loadable Hugging Face config"),
                           (["--hf-config", _hf_dir(tmp_path, False), "--moe-experts", "4"],
                            "--moe-experts builds the reference GPT's MoE layers"),
                           (["--hf-config", "a", "--hf-model", "b"], "--hf-config and --hf-model are exclusive")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            parse(["--nproc", "2", *flags])


HF_REFUSED = [("recurrent_gemma", {}, "is a convolution over the sequence"),
              ("roberta", {"is_decoder": True}, "differ from its own defaults"),
              ("bloom", {}, "did not run cp_handler's attention"),
              # issue 50: a bidirectional model would train a next-token loss seeing its labels; T5 has no causal LM
              ("bert", {"architectures": ["BertModel"], "hidden_dropout_prob": 0.0,
                        "attention_probs_dropout_prob": 0.0},
               "BertLMHeadModel is not a causal language model: its attention layers ['0', '1'] attend "
               "bidirectionally"),
              ("t5", {"dropout_rate": 0.0}, "model_type 't5' is an encoder-decoder model, not a causal language model"),
              # the load-balancing loss would be dropped by cp-train's next-token loss
              ("qwen3_moe", {"output_router_logits": True}, "config.json sets output_router_logits=true")]


@pytest.mark.parametrize("model_type, fields, message", HF_REFUSED, ids=[r[0] for r in HF_REFUSED])
def test_hugging_face_architecture_the_guard_refuses_is_refused_before_spawning(tmp_path, monkeypatch, model_type,
                                                                                 fields, message):
    """The same refusal as every rank would raise (the guard on the config, a small model built on CPU)."""
    from transformers import AutoConfig

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, n_layer=2, n_head=4, max_position_embeddings=512, pad_token_id=0)
    AutoConfig.for_model(model_type, **shape, **fields).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=rf"cp-train: error: --hf-config {re.escape(str(tmp_path))}: .*"
                                         rf"{re.escape(message)}"):
        parse(["--nproc", "2", "--hf-config", str(tmp_path)])


def test_a_model_folder_with_a_tokenizer_trains_exports_and_generates_with_it(tmp_path, monkeypatch):
    """--hf-model DIR holding a tokenizer (merged tokens, not bytes): cp-train trains on
    its tokens with --check-parity, --export-hf writes it beside the weights, cp-generate reads the prompt
    and prints the prompt and its continuation with it (parity with one process), and a resume fed bytes is refused."""
    import json

    from test_tokens import tiny_tokenizer
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    model, ckpt, exported = tmp_path / "model", tmp_path / "ckpt", tmp_path / "exported"
    tokenizer = tiny_tokenizer(model)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    Qwen2ForCausalLM(config).save_pretrained(model)
    result = cp_train("--nproc", "2", "--hf-model", str(model), "--steps", "2", "--seq-len", "128",
                      "--max-corpus-bytes", "300000", "--check-parity", "--save", str(ckpt),
                      "--export-hf", str(exported))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr
    loaded = AutoTokenizer.from_pretrained(exported)  # what transformers loads from the folder (Qwen2's class)
    assert loaded.get_vocab() == tokenizer.get_vocab()

    text = "def main():\n    print("
    (tmp_path / "prompt.txt").write_text(text)
    done = cp_generate("--nproc", "2", "--hf-model", str(exported), "--prompt-file", str(tmp_path / "prompt.txt"),
                       "--max-new-tokens", "5", "--check-parity", "--report-out", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parity passed (float32): same tokens True" in done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["prompt_tokens"] == [len(loaded(text)["input_ids"])] and len(text) > report["prompt_tokens"][0]
    echoed = loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True)  # the prompt, then its continuation
    assert done.stdout == echoed + loaded.decode(report["tokens"][0], skip_special_tokens=True) + "\n"

    config.save_pretrained(tmp_path / "bytes")  # the same model without its tokenizer: fed bytes
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match=r"does not fit this run: the tokens \(the model folder's tokenizer, else "
                                         r"bytes\): checkpoint \{'kind': 'hf'"):
        parse(["--nproc", "2", "--hf-config", str(tmp_path / "bytes"), "--seq-len", "128", "--max-corpus-bytes",
               "300000", "--steps", "4", "--resume", str(ckpt)])
    with pytest.raises(SystemExit, match=rf"vocab_size=200, but its tokenizer has {len(tokenizer)} tokens"):
        small = tmp_path / "small"
        Qwen2Config(**{**config.to_dict(), "vocab_size": 200}).save_pretrained(small)
        tokenizer.save_pretrained(small)
        parse(["--nproc", "2", "--hf-config", str(small)])


def test_training_randomness_and_recompute_without_support_refused_before_spawn(tmp_path, monkeypatch):
    """Dropout (GPT-2's defaults) and router jitter would make a step differ from one process's; an
    architecture without gradient checkpointing cannot --recompute: each named before any rank starts."""
    from transformers import GPT2Config, Qwen2ForCausalLM

    from cp_handler.cli.args import parse

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=256).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SystemExit, match=r"--hf-config .*gpt2: config.json sets attn_pdrop=0.1, embd_pdrop=0.1, "
                                         r"resid_pdrop=0.1: cp-train trains without randomness"):
        parse(["--nproc", "2", "--hf-config", str(tmp_path / "gpt2")])
    qwen2 = _hf_dir(tmp_path, False)
    monkeypatch.setattr(Qwen2ForCausalLM, "supports_gradient_checkpointing", False)  # as CTRL / JetMoE in 5.23
    parse(["--nproc", "2", "--hf-config", qwen2])  # trains without --recompute
    with pytest.raises(SystemExit, match=r"--recompute: Qwen2ForCausalLM does not support gradient checkpointing"):
        parse(["--nproc", "2", "--hf-config", qwen2, "--recompute"])


def test_an_attention_free_model_trains_packed_documents_with_parity(tmp_path):
    """Mamba has no attention heads (cp-train read them before any rank started: an AttributeError, issue 50): with
    --packing thd its scans keep the documents apart, as the reference does running each document alone."""
    import hf_zoo

    hf_zoo.tiny_config("mamba", {"vocab_size": 256}).save_pretrained(tmp_path)
    result = cp_train("--nproc", "2", "--hf-config", str(tmp_path), "--packing", "thd", "--steps", "2", "--seq-len",
                      "64", "--max-corpus-bytes", "300000", "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr
