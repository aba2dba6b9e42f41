"""Real text for training runs (``cp-train``): tokens from source files.

By default the corpus is the Python standard library's own ``.py`` files (located with
``sysconfig``; ``site-packages`` excluded), so every machine with Python has it. Files are read
in sorted path order as byte-level tokens, each followed by a NUL byte as end-of-document token
(or with a Hugging Face model's tokenizer, each ended by its end-of-sequence token: :mod:`.tokens`),
and concatenated; the stream is cut into sequences of ``seq_len`` tokens. For thd packing the files are also cut into
documents of at most ``max_doc_len`` tokens (default ``seq_len // 4``: most stdlib files are much
longer than a sequence, so without the cut nearly every sequence would hold one document and thd
would train exactly as bshd); a sequence carries the ``cu_seqlens`` of the documents (or pieces of
documents, at its boundaries) in it. Sampling is deterministic in the seed.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokens import BYTE_END_OF_DOCUMENT, ByteTokens, HFTokens

HOLDOUT_FRACTION = 0.05
"""The last 5% of the sequences are held out for evaluation."""


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted. The walk does not enter ``site-packages`` (the installed
    packages, often inside the standard library's folder: 51,000 files under it here, where the library has 1,800;
    0.04 s instead of 0.3 s)."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(p for p in files if p.is_file())


def collect_files(paths: list[str] | None) -> list[Path]:
    """Files named in ``paths`` (folders are walked recursively), or the stdlib files.

    Raises:
        FileNotFoundError: a path that does not exist, or no file found.
    """
    if not paths:
        return stdlib_files()
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"--data {name}: no such file or folder")
        files += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"--data {paths}: no files found")
    return files


CONTROL_FRACTION = 0.01
"""Largest share of control characters (other than tab, newlines, form feed, escape) in a text file."""
TEXT_CONTROLS = frozenset("\t\n\r\f\v\x1b")


def text_file_problem(data: bytes, truncated: bool) -> str | None:
    """Why ``data`` (a file's first bytes; ``truncated``: the file goes on) is not UTF-8 text, or None."""
    if BYTE_END_OF_DOCUMENT in data:
        return f"it holds NUL bytes (the first at byte {data.index(BYTE_END_OF_DOCUMENT)}), which end a document here"
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
    except UnicodeDecodeError as err:
        return f"it is not UTF-8 (byte {err.start}: {err.reason})"
    controls = sum(ch < " " and ch not in TEXT_CONTROLS for ch in text)
    if controls > CONTROL_FRACTION * max(1, len(text)):
        return f"{controls} of its {len(text)} characters are control characters (more than {CONTROL_FRACTION:.0%})"
    return None


def check_text_files(files: list[Path], max_bytes: int) -> None:
    """The bytes :func:`read_token_stream` will read from ``files`` are UTF-8 text (checked for
    ``--data``: a binary file would train silently on noise).

    Raises:
        ValueError: naming the first file that is not text and why.
    """
    total = 0
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            data = f.read(max_bytes - total)
        problem = text_file_problem(data, truncated=len(data) < size)
        if problem:
            raise ValueError(f"--data: {path} is not text: {problem}; cp-train trains on UTF-8 text files "
                             "(byte-level tokens)")
        total += len(data) + 1
        if total >= max_bytes:
            return


def read_token_stream(files: list[Path], max_bytes: int, tokens: ByteTokens | HFTokens | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents of ``files`` (one per file) as one token stream, read up to ``max_bytes`` bytes.

    ``tokens``: bytes (``None``, the default) or a Hugging Face tokenizer (:mod:`.tokens`). Each file
    that ends within the budget is ended by the end-of-document token (bytes: the NUL, which counts
    one byte of the budget); the file the budget cuts is not.

    Returns ``(stream [N] (uint8 for bytes, int32 for a tokenizer), document starts int64 [num_docs])``.
    """
    tokens = tokens or ByteTokens()
    parts, starts, total, read = [], [], 0, 0
    for path in files:
        remaining = max_bytes - read
        with open(path, "rb") as f:
            text = f.read(remaining)
        ended = len(text) < remaining
        starts.append(total)
        parts.append(tokens.document(text, ended))
        total += parts[-1].numel()
        read += len(text) + ended
        if read >= max_bytes:
            break
    return torch.cat(parts), torch.tensor(starts)


def data_fingerprint(files: list[Path], max_bytes: int) -> str:
    """sha256 of the bytes :func:`read_token_stream` reads from ``files`` (each file's length, then its bytes,
    in order, up to ``max_bytes``): the identity of a run's data, recorded in its checkpoints. The same files
    in another order, another file at the same path, or an edited file give another fingerprint; the paths
    themselves do not count (a corpus moved elsewhere is the same data)."""
    digest, read = hashlib.sha256(), 0
    for path in files:
        with open(path, "rb") as f:
            text = f.read(max_bytes - read)
        digest.update(len(text).to_bytes(8, "little") + text)
        read += len(text) + (len(text) < max_bytes - read)
        if read >= max_bytes:
            break
    return digest.hexdigest()


def cut_documents(doc_starts: torch.Tensor, total: int, max_doc_len: int | None) -> torch.Tensor:
    """Document starts with every document longer than ``max_doc_len`` cut into pieces of at most
    that many tokens (``None``: unchanged)."""
    if max_doc_len is None:
        return doc_starts
    ends = torch.cat([doc_starts[1:], torch.tensor([total])])
    pieces = [torch.arange(int(s), int(e), max_doc_len) for s, e in zip(doc_starts, ends, strict=True)]
    return torch.cat(pieces) if pieces else doc_starts


@dataclass
class Batch:
    """A global batch: ``tokens (N, seq_len)`` int64; ``cu_seqlens`` per sequence (int32 ``[docs + 1]``)."""

    tokens: torch.Tensor
    cu_seqlens: list[torch.Tensor]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice | list[int]) -> Batch:
        """The sequences ``index`` (a slice or a list of positions)."""
        if isinstance(index, slice):
            return Batch(self.tokens[index], self.cu_seqlens[index])
        return Batch(self.tokens[index], [self.cu_seqlens[i] for i in index])

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All sequences as one thd pack: ``tokens (1, N * seq_len)`` and their joined ``cu_seqlens``."""
        seq_len, offsets = self.tokens.shape[1], [torch.zeros(1, dtype=torch.int32)]
        for i, cu in enumerate(self.cu_seqlens):
            offsets.append(cu[1:] + i * seq_len)
        return self.tokens.reshape(1, -1), torch.cat(offsets)


class SequenceBatches:
    """Fixed-length sequences cut from a token stream; the last ``holdout_fraction`` is held out.

    Each sequence also carries the ``cu_seqlens`` of the documents (files) inside it, a file cut
    by a sequence boundary continuing as a new document in the next sequence (for thd packing).
    ``global_batch(step, n)`` draws ``n`` sequences, the same on every rank.
    """

    def __init__(self, stream: torch.Tensor, doc_starts: torch.Tensor, seq_len: int, seed: int,
                 holdout_fraction: float = HOLDOUT_FRACTION, max_doc_len: int | None = None):
        n_seq = stream.numel() // seq_len
        if n_seq < 2:
            raise ValueError(f"the corpus has {stream.numel()} tokens: too few for two sequences of seq_len={seq_len}")
        self.sequences = stream[: n_seq * seq_len].view(n_seq, seq_len)
        self.doc_starts, self.seq_len = cut_documents(doc_starts, stream.numel(), max_doc_len), seq_len
        self.n_train = max(1, int(n_seq * (1 - holdout_fraction)))
        self.seed = seed

    def cu_seqlens(self, index: int) -> torch.Tensor:
        """int32 offsets of the documents inside sequence ``index``."""
        start = index * self.seq_len
        inside = self.doc_starts[(self.doc_starts > start) & (self.doc_starts < start + self.seq_len)] - start
        return torch.cat([torch.tensor([0]), inside, torch.tensor([self.seq_len])]).to(torch.int32)

    def heldout_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
        """The first ``num_batches`` batches of ``batch_size`` held-out sequences, in order.

        Raises:
            ValueError: the held-out split has too few sequences.
        """
        start, needed = self.n_train, num_batches * batch_size
        if start + needed > self.sequences.shape[0]:
            raise ValueError(f"--eval-batches {num_batches} x {batch_size} sequences need {needed} held-out sequences, "
                             f"the corpus holds out {self.sequences.shape[0] - start}; use fewer or a larger corpus")
        return [Batch(self.sequences[start + i * batch_size: start + (i + 1) * batch_size].long(),
                      [self.cu_seqlens(j) for j in range(start + i * batch_size, start + (i + 1) * batch_size)])
                for i in range(num_batches)]

    def global_batch(self, step: int, global_batch_size: int) -> Batch:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = torch.randint(0, self.n_train, (global_batch_size,), generator=generator)
        return Batch(self.sequences[index].long(), [self.cu_seqlens(int(i)) for i in index])

    def documents_per_sequence(self, global_batch_size: int, steps: int) -> str:
        """Documents per sequence over the first (up to 10) global batches, for the thd log line."""
        counts = [cu.numel() - 1 for step in range(min(steps, 10))
                  for cu in self.global_batch(step, global_batch_size).cu_seqlens]
        return f"{sum(counts) / len(counts):.1f} documents per sequence (min {min(counts)}, max {max(counts)})"


class DocumentBatches:
    """Whole documents as sequences (dynamic CP): each file is one sequence, files longer than
    ``cap`` tokens are cut into pieces of at most ``cap``. The last ``holdout_fraction`` of the
    pieces is held out. ``global_batch(step, n)`` draws ``n`` pieces, the same on every rank."""

    def __init__(self, stream: torch.Tensor, doc_starts: torch.Tensor, cap: int, seed: int,
                 holdout_fraction: float = 0.05):
        bounds = [*doc_starts.tolist(), stream.numel()]
        self.pieces = [(s, min(s + cap, e)) for b, e in zip(bounds[:-1], bounds[1:], strict=True)
                       for s in range(b, e, cap)]
        if len(self.pieces) < 2:
            raise ValueError("the corpus has fewer than two documents")
        self.stream, self.seed = stream, seed
        self.n_train = max(1, int(len(self.pieces) * (1 - holdout_fraction)))

    def global_batch(self, step: int, n: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = torch.randint(0, self.n_train, (n,), generator=generator).tolist()
        return [self.stream[self.pieces[i][0]: self.pieces[i][1]].long() for i in index]
