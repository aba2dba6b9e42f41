"""``cp-generate`` (cp_handler/cli/generate.py, cp_handler/cli/generate_rank.py): a checkpoint written by
cp-train continued at cp 2 with --check-parity (greedy with p2p and a2a prefills; sampled), the flag rules
checked before any rank starts, and the dtype a model was saved in. The generation itself is tested in
tests/test_inference.py; the tolerances are cp-generate's (docs/inference.md).
"""

import json
import os
import re
import shlex

import pytest
import torch
from test_cli import cp_generate


def test_cp_generate_continues_a_trained_checkpoint_with_parity(tmp_path):
    """cp-train --save (multi-head latent attention: --v-head-dim 24 against q/k 16, with --check-parity; under
    umask 027 every file and folder it writes has the umask's mode), then cp-generate --checkpoint at cp 2 (p2p and
    a2a prefill, greedy; p2p sampled, run as the command cp-train printed) with --check-parity, each prompt echoed
    before its continuation."""
    from test_cli import SMALL, cp_train

    from cp_handler.cli.generate import shown, until_end
    from cp_handler.training.tokens import tokens_for

    old = os.umask(0o027)
    try:
        result = cp_train("--nproc", "2", *SMALL, "--v-head-dim", "24", "--check-parity", "--save",
                          str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "m.json"))
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parity passed" in result.stderr
    written = [tmp_path / "m.json", tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]
    modes = {str(p): oct(p.stat().st_mode & 0o777) for p in written}
    assert set(modes.values()) == {"0o640", "0o750"} and modes[str(tmp_path / "ckpt")] == "0o750", modes
    hint = re.search(r"cp-train: continue a prompt from the final checkpoint: (.*)", result.stderr)
    assert hint, result.stderr[-2000:]
    printed = shlex.split(hint[1])
    assert printed[printed.index("--checkpoint") + 1] == str(tmp_path / "ckpt") and "--prompt" in printed
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def main():\n    return ")
    for comm in ("p2p", "a2a"):
        done = cp_generate("--nproc", "2", "--cp-comm-type", comm, "--checkpoint", str(tmp_path / "ckpt"),
                           "--prompt-file", str(prompt), "--max-new-tokens", "12", "--ignore-eos", "--check-parity",
                           "--report-out", str(tmp_path / "r.json"))
        assert done.returncode == 0, done.stderr[-2000:]
        assert "cp-generate: parity passed (float32): same tokens True (0 near-ties)" in done.stderr
        report = json.loads((tmp_path / "r.json").read_text())
        assert len(report["tokens"][0]) == 12 and len(report["kv_cache_bytes_per_rank"]) == 2
        assert done.stdout == "def main():\n    return " + shown(tokens_for(None), report["tokens"][0]) + "\n"
    # sampled, stopped at and printed up to the first end-of-document token (bytes: NUL): the printed command
    done = cp_generate(*printed[1:], "--nproc", "2", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p",
                       "0.9", "--seed", "2", "--check-parity", "--report-out", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parity passed (float32): sampled tokens followed by the reference" in done.stderr
    ids = json.loads((tmp_path / "r.json").read_text())["tokens"][0]
    assert 0 not in ids[:-1] and (len(ids) == 12 or ids[-1] == 0), ids
    inline = printed[printed.index("--prompt") + 1]
    assert done.stdout == inline + shown(tokens_for(None), until_end(ids, 0)) + "\n"  # the prompt echoed first


def test_cp_generate_flag_rules(tmp_path, monkeypatch):
    from test_cli_hf import _hf_dir

    from cp_handler.cli.generate import parse

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x" * 1000)
    hf = _hf_dir(tmp_path, False)  # max_position_embeddings 1024
    cases = [(["--checkpoint", str(tmp_path / "none")], "--checkpoint .*none: no such directory"),
             (["--hf-model", hf, "--checkpoint", hf], "exactly one of --checkpoint"),
             (["--hf-model", hf, "--cp-size", "4"], r"--cp-size 4: cp-generate runs one CP group over all 2 ranks"),
             (["--hf-model", hf, "--max-new-tokens", "100"], r"1000 tokens \+ --max-new-tokens 100 exceed the model's "
                                                             r"1024 positions"),
             (["--hf-model", hf, "--max-new-tokens", "0"], r"--max-new-tokens 0 must be >= 1"),
             (["--hf-model", hf, "--timeout", "nan"], r"--timeout nan must be a finite number > 0"),
             (["--hf-model", hf, "--timeout", "0"], r"--timeout 0.0 must be a finite number > 0"),
             (["--hf-model", hf, "--temperature", "-1"], r"--temperature -1.0 must be a finite number >= 0"),
             (["--hf-model", hf, "--report-out", str(prompt / "r.json")], r"--report-out .*r.json: cannot write in")]
    for flags, message in cases:
        with pytest.raises(SystemExit, match=rf"cp-generate: error: .*({message})"):
            parse(["--nproc", "2", "--prompt-file", str(prompt), *flags])
    # 4 query / 2 KV heads at a2a size 3, once refused here: the prefill's a2a pads them (a2a_head_plan)
    config, _, _ = parse(["--nproc", "3", "--prompt-file", str(prompt), "--hf-model", hf, "--cp-comm-type", "a2a",
                          "--max-new-tokens", "4"])
    assert (config.world_size, config.cp_comm_type) == (3, "a2a")
    from hf_zoo import tiny_config

    for name, message in (("recurrent_gemma", "RecurrentGemmaForCausalLM: module "
                                              "'model.layers.0.temporal_block.conv_1d' is a convolution over the "
                                              "sequence"),  # the guard, before spawn
                          ("lfm2", "generate: module 'model.layers.0.conv' \\(Lfm2ShortConv\\) is a token mixer other "
                                   "than attention")):  # trains exactly, generation refused before spawn
        config = tiny_config(name)
        config.vocab_size = 256
        config.save_pretrained(tmp_path / name)
        with pytest.raises(SystemExit, match=rf"--hf-model .*{name}: {message}"):
            parse(["--nproc", "2", "--prompt-file", str(prompt), "--hf-model", str(tmp_path / name)])
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(SystemExit, match=r"--prompt-file .*prompt.bin is not text: it holds NUL bytes"):
        parse(["--nproc", "2", "--hf-model", hf, "--prompt-file", str(binary)])


def test_cp_generate_runs_a_model_in_the_dtype_it_was_saved_in(tmp_path, monkeypatch):
    """--dtype auto: a Hugging Face folder saved in bfloat16 runs in bfloat16 (whatever transformers' own
    default), with bfloat16's parity tolerance; --dtype float32 overrides it; a GPT checkpoint runs in
    cp-train's --dtype."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cp_handler.cli.generate import parse

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def main():\n    return ")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--nproc", "2", "--prompt-file", str(prompt), "--hf-model", str(tmp_path / "bf16")]
    assert parse(base)[0].dtype == "bfloat16" and parse([*base, "--dtype", "float32"])[0].dtype == "float32"
    done = cp_generate(*base, "--max-new-tokens", "6", "--check-parity")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parity passed (bfloat16)" in done.stderr and "atol = rtol = 0.02" in done.stderr


def test_cp_generate_names_itself_and_a_tiny_temperature_is_greedy(tmp_path, monkeypatch):
    """Every message of a cp-generate run says cp-generate (a failed rank was reported as ``cp-train: ...``);
    ``--temperature 1e-40`` is the greedy limit (it ended in ``probability tensor contains inf/nan``)."""
    import cp_handler.cli.generate_rank as run
    from cp_handler.inference.sampling import Sampling

    seen = {}
    monkeypatch.setattr(run, "launch", lambda *args, **kwargs: seen.update(kwargs) or {0: None})
    run.run_generation(run.GenerateConfig(world_size=2))
    assert seen["program"] == "cp-generate"
    logits = torch.randn(3, 50) * 30
    tiny = Sampling(temperature=1e-40)
    assert torch.equal(tiny.choose(logits, tiny.generator(logits.device)), logits.argmax(-1))
    # the shift changes nothing at ordinary temperatures beyond float32 rounding: scores up to ~130 (30 x 3 / 0.7)
    # are rounded to 1.5e-5 before exp, a relative 1.5e-5 in a probability
    probs = Sampling(temperature=0.7).probabilities(logits)
    torch.testing.assert_close(probs, (logits / 0.7).softmax(-1), rtol=3e-5, atol=1e-7)


def test_an_inline_prompt_is_read_as_a_prompt_file_is_and_only_one_kind_is_given(tmp_path, monkeypatch, capsys):
    """--prompt TEXT (repeatable) gives the tokens --prompt-file gives for the same text; the two do not combine;
    an empty or non-text prompt is refused naming it; a prefix of a flag is not taken for it (``--prompt`` became
    ``--prompt-file`` under argparse's prefix matching)."""
    from test_cli_hf import _hf_dir

    from cp_handler.cli.generate import build_parser, parse

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    hf = _hf_dir(tmp_path, False)  # no tokenizer: bytes
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for path, text in zip(files, ("def main():\n    return ", "caf\u00e9"), strict=True):
        path.write_text(text, encoding="utf-8")
    inline = parse(["--hf-model", hf, "--prompt", "def main():\n    return ", "--prompt", "caf\u00e9"])[0]
    from_files = parse(["--hf-model", hf, "--prompt-file", *map(str, files)])[0]
    assert inline.prompts == from_files.prompts == (tuple(b"def main():\n    return "), tuple("caf\u00e9".encode()))
    assert build_parser().allow_abbrev is False
    for flags, message in ((["--prompt", "x", "--prompt-file", str(files[0])],
                            "argument --prompt-file: not allowed with argument --prompt"),
                           ([], "one of the arguments --prompt --prompt-file is required"),
                           (["--prompt-f", str(files[0])], "unrecognized arguments: --prompt-f (did you mean "
                                                           "--prompt-file?)"),
                           (["--promt", "x"], "unrecognized arguments: --promt (did you mean --prompt?)")):
        with pytest.raises(SystemExit) as exit_info:
            parse(["--hf-model", hf, *flags])
        assert exit_info.value.code == 2 and f"cp-generate: error: {message}" in capsys.readouterr().err
    for text, rule in (("", "--prompt '': an empty prompt"),
                       ("a\x00b", r"--prompt 'a\\x00b' is not text: it holds NUL bytes \(the first at byte 1\)"),
                       ("\udcff", r"--prompt '\\udcff' is not text: it is not UTF-8 \(byte 0: invalid start byte\)")):
        with pytest.raises(SystemExit, match=rf"cp-generate: error: {rule}"):
            parse(["--hf-model", hf, "--prompt", text])


def test_the_prompt_is_echoed_before_its_continuation_and_unprintable_text_is_escaped(monkeypatch, capsys):
    """Terminal controls (escape sequences, carriage returns, bidirectional overrides) and bytes that are not UTF-8
    are printed as Python escapes; newlines, tabs and other text as they are."""
    import cp_handler.cli.generate as generate
    from cp_handler.cli.generate_rank import GenerateConfig
    from cp_handler.training.tokens import ByteTokens

    assert generate.printable("a\x1b[31mb\r\n\tc\u202ed\u00e9\\x") == "a\\x1b[31mb\\r\n\tc\\u202ed\u00e9\\x"
    assert generate.shown(ByteTokens(), list(b"ok\xff\x07\xc3\xa9")) == "ok\\xff\\x07\u00e9"
    assert generate.shown(ByteTokens(), [104, 300]) == "h\ufffd"  # an id that is no byte
    config = GenerateConfig(world_size=1, prompts=(tuple(b"say\t"), tuple(b"\x1b]0;x")), stop_token=0)
    report = {"tokens": [list(b"hi\r") + [0, 65], list(b"\xe2\x80\xae!")], "prompt_tokens": [4, 4],
              "prefill_s": 1.0, "decode_s": 1.0, "prefill_tokens_per_s": 8.0, "decode_tokens_per_s": 8.0,
              "kv_cache_bytes_per_rank": [1024], "cp_size": 1, "prefills": 1}
    monkeypatch.setattr(generate, "parse", lambda argv: (config, None, False))
    monkeypatch.setattr(generate, "run_generation", lambda config: report)
    assert generate.main([]) == 0
    assert capsys.readouterr().out == "say\thi\\r\n\\x1b]0;x\\u202e!\n"
