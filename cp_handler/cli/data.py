"""Real text for ``cp-train``: byte-level tokens from source files.

By default the corpus is the Python standard library's own ``.py`` files (located with
``sysconfig``; ``site-packages`` excluded), so every machine with Python has it. Files are read
in sorted path order, each followed by a NUL byte as end-of-document token, and concatenated;
the stream is cut into sequences of ``seq_len`` tokens. Sampling is deterministic in the seed.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256
END_OF_DOCUMENT = 0


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


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


def read_token_stream(files: list[Path], max_bytes: int) -> torch.Tensor:
    """Concatenated bytes of ``files`` (each ended by ``END_OF_DOCUMENT``), at most ``max_bytes``: uint8 [N]."""
    parts, total = [], 0
    for path in files:
        data = path.read_bytes() + bytes([END_OF_DOCUMENT])
        parts.append(data[: max_bytes - total])
        total += len(parts[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


class SequenceBatches:
    """Fixed-length sequences cut from a token stream; the last ``holdout_fraction`` is held out.

    ``global_batch(step)`` returns ``(global_batch_size, seq_len)`` int64, the same on every rank.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int, holdout_fraction: float = 0.05):
        n_seq = stream.numel() // seq_len
        if n_seq < 2:
            raise ValueError(f"the corpus has {stream.numel()} tokens: too few for two sequences of seq_len={seq_len}")
        self.sequences = stream[: n_seq * seq_len].view(n_seq, seq_len)
        self.n_train = max(1, int(n_seq * (1 - holdout_fraction)))
        self.seed = seed

    def global_batch(self, step: int, global_batch_size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = torch.randint(0, self.n_train, (global_batch_size,), generator=generator)
        return self.sequences[index].long()
