"""The tokens cp-train and cp-generate feed: bytes (the reference GPT, a model folder without a
tokenizer) or the tokenizer saved in a Hugging Face model folder (cp_handler.training.tokens)."""

import pytest
import torch

from cp_handler.training.data import read_token_stream
from cp_handler.training.tokens import ByteTokens, has_tokenizer, tokens_for

TEXTS = [b"def main():\n    print('hello')\n", "x = 'caf\u00e9'  # \u00e9t\u00e9\n".encode(), b"pass\n" * 40]


def tiny_tokenizer(folder):
    """A byte-level BPE tokenizer with an end-of-sequence token, trained offline on a few lines and saved
    with ``save_pretrained`` into ``folder``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([t.decode() for t in TEXTS] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture()
def corpus(tmp_path):
    files = []
    for i, text in enumerate(TEXTS):
        files.append(tmp_path / f"{i}.py")
        files[-1].write_bytes(text)
    return files


def test_bytes_end_each_whole_file_with_nul_and_cut_the_last_at_the_budget(corpus):
    stream, starts = read_token_stream(corpus, 10_000)
    assert stream.dtype == torch.uint8
    assert bytes(stream.tolist()) == b"".join(t + b"\0" for t in TEXTS)
    assert starts.tolist() == [0, len(TEXTS[0]) + 1, len(TEXTS[0]) + len(TEXTS[1]) + 2]
    budget = len(TEXTS[0]) + 1 + 5  # the second file is cut after 5 bytes: no NUL after it
    cut, starts = read_token_stream(corpus, budget)
    assert bytes(cut.tolist()) == TEXTS[0] + b"\0" + TEXTS[1][:5] and starts.tolist() == [0, len(TEXTS[0]) + 1]
    exact, _ = read_token_stream(corpus[:1], len(TEXTS[0]))  # the NUL does not fit the budget: not added
    assert bytes(exact.tolist()) == TEXTS[0]


def test_a_folder_with_a_tokenizer_is_read_with_it(tmp_path, corpus):
    tokenizer = tiny_tokenizer(tmp_path / "model")
    assert has_tokenizer(str(tmp_path / "model")) and not has_tokenizer(str(tmp_path))
    assert isinstance(tokens_for(str(tmp_path)), ByteTokens)
    tokens = tokens_for(str(tmp_path / "model"))
    eos = tokenizer.eos_token_id
    stream, starts = read_token_stream(corpus, 10_000, tokens)
    want = [tokenizer(t.decode())["input_ids"] + [eos] for t in TEXTS]
    assert stream.dtype == torch.int32 and stream.tolist() == sum(want, [])
    assert starts.tolist() == [0, len(want[0]), len(want[0]) + len(want[1])]
    assert max(stream.tolist()) >= 256  # merged tokens: not bytes
    # the budget cuts the second file inside its two-byte character: the half character is dropped
    cut, _ = read_token_stream(corpus[:2], len(TEXTS[0]) + 1 + TEXTS[1].index("\u00e9".encode()) + 1, tokens)
    assert cut.tolist() == want[0] + tokenizer("x = 'caf")["input_ids"]
    assert tokens.decode(tokenizer(TEXTS[1].decode())["input_ids"]) == TEXTS[1].decode()


def test_tokenizer_files_that_do_not_load_are_an_error_not_bytes(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"--hf-model .*: its tokenizer files do not load"):
        tokens_for(str(tmp_path))
    from transformers import PreTrainedTokenizerFast

    no_eos = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(tmp_path / "eos").backend_tokenizer)
    no_eos.save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ValueError, match=r"its tokenizer has no end-of-sequence token"):
        tokens_for(str(tmp_path / "no_eos"), "--hf-config")


def test_ids_that_are_not_bytes_show_as_replacement_characters():
    tokens = ByteTokens()
    assert tokens.decode(list("h\u00e9".encode()) + [300, 104]) == "h\u00e9\ufffdh"
    assert tokens.not_bytes([1, 256, 300, 255]) == 2


def test_the_ranks_read_the_training_config_s_model_folder_tokens(tmp_path, corpus):
    from types import SimpleNamespace

    from cp_handler.training.steps import token_stream

    tiny_tokenizer(tmp_path / "model")
    for folder in (None, str(tmp_path / "model")):
        config = SimpleNamespace(data=tuple(str(p) for p in corpus), max_corpus_bytes=10_000, hf_source=folder)
        stream, _ = token_stream(config)
        assert torch.equal(stream, read_token_stream(corpus, 10_000, tokens_for(folder))[0])
    assert stream.dtype == torch.int32
