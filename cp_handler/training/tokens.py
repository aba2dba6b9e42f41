"""The tokens of ``cp-train`` and ``cp-generate``: bytes, or the tokenizer saved with a Hugging Face model.

The reference GPT, and a Hugging Face model folder without a tokenizer, read text as byte-level
tokens (vocabulary 256, NUL ends a document). A Hugging Face folder (``--hf-model`` / ``--hf-config``
/ ``cp-generate --hf-model``) that holds a tokenizer (any of :data:`TOKENIZER_FILES`) is read with it
(``transformers.AutoTokenizer``; its own special tokens, as ``run_clm.py`` does), each document ended
by the tokenizer's end-of-sequence token: a model trained on a tokenizer is never fed bytes. A
tokenizer file that does not load is an error, never a silent fall-back to bytes.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os

import torch

BYTE_VOCAB_SIZE = 256
BYTE_END_OF_DOCUMENT = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json")
"""Files whose presence in a model folder means it has a tokenizer (those ``save_pretrained`` writes)."""


class ByteTokens:
    """Byte-level tokens: ids 0..255 are the bytes of the text."""

    vocab_size = BYTE_VOCAB_SIZE
    end_of_document = BYTE_END_OF_DOCUMENT
    identity = {"kind": "bytes"}
    """What ``cp_train.json`` records (a resume with other tokens is refused)."""

    def encode(self, text: bytes) -> list[int]:
        return list(text)

    def document(self, text: bytes, ended: bool) -> torch.Tensor:
        """A file's ``text`` as training tokens (uint8), then the end-of-document token when the file
        ``ended`` (was read whole)."""
        return torch.frombuffer(bytearray(text + bytes([self.end_of_document] * ended)), dtype=torch.uint8)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; an id outside 0..255 (a model with a larger vocabulary) shows as U+FFFD,
        like bytes that are not UTF-8 (count them with :meth:`not_bytes`)."""
        out, run = [], bytearray()
        for t in ids:
            if 0 <= t < BYTE_VOCAB_SIZE:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace") + "\ufffd")
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

    @staticmethod
    def not_bytes(ids: list[int]) -> int:
        """How many of ``ids`` are not byte tokens."""
        return sum(not 0 <= t < BYTE_VOCAB_SIZE for t in ids)


class HFTokens:
    """The tokenizer saved in a Hugging Face model folder.

    Raises:
        ValueError: the tokenizer does not load, or has no end-of-sequence token.
    """

    def __init__(self, folder: str, flag: str):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{flag} {folder}: its tokenizer files do not load ({str(err).splitlines()[0]})") from None
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{flag} {folder}: its tokenizer has no end-of-sequence token (eos_token), which "
                             "ends each training document")
        self.vocab_size = len(self.tokenizer)
        self.end_of_document = self.tokenizer.eos_token_id
        vocab = json.dumps(sorted(self.tokenizer.get_vocab().items())).encode()
        self.identity = {"kind": "hf", "vocab_size": self.vocab_size, "eos_token_id": self.end_of_document,
                         "vocab_sha256": hashlib.sha256(vocab).hexdigest()[:16]}
        """What ``cp_train.json`` records: the vocabulary itself (hashed), not the tokenizer's class name,
        which differs between transformers releases."""

    def encode(self, text: bytes) -> list[int]:
        """Token ids of UTF-8 ``text`` (with the tokenizer's own special tokens, e.g. BOS)."""
        return self.tokenizer(text.decode("utf-8"))["input_ids"]

    def document(self, text: bytes, ended: bool) -> torch.Tensor:
        """A file's ``text`` as training tokens (int32; a multi-byte character cut by the byte budget is
        dropped), then the end-of-sequence token when the file ``ended``."""
        ids = self.tokenizer(codecs.getincrementaldecoder("utf-8")().decode(text, final=False))["input_ids"]
        if ended and (not ids or ids[-1] != self.end_of_document):
            ids.append(self.end_of_document)
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @staticmethod
    def not_bytes(ids: list[int]) -> int:
        return 0


def has_tokenizer(folder: str | None) -> bool:
    """Whether the model folder ``folder`` holds tokenizer files."""
    return folder is not None and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def tokens_for(folder: str | None, flag: str = "--hf-model") -> ByteTokens | HFTokens:
    """The tokens of a run whose model comes from ``folder`` (given as ``flag``; ``None``: the reference
    GPT): the folder's tokenizer when it has one, else bytes.

    Raises:
        ValueError: tokenizer files that do not load, or a tokenizer without an end-of-sequence token.
    """
    return HFTokens(folder, flag) if has_tokenizer(folder) else ByteTokens()
