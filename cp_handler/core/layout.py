"""Where tokens live: the zigzag (DualChunkSwap) split of a sequence over a CP group.

A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks; rank ``r`` keeps chunks ``r`` and
``2cp-1-r``, in that order. Under a causal mask every rank then does the same attention work
(Megatron-LM ``get_batch_on_this_cp_rank``; Transformer Engine calls it DualChunkSwap).
Pure index arithmetic: nothing here communicates.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import torch


def zigzag_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp_size``) held by ``cp_rank``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_chunk_owner(chunk: int, cp_size: int) -> tuple[int, int]:
    """``(rank, local half)`` that holds global chunk ``chunk``."""
    if chunk < cp_size:
        return chunk, 0
    return 2 * cp_size - 1 - chunk, 1


def check_cu_seqlens(cu_seqlens) -> None:
    """``cu_seqlens``: a 1-D int32/int64 tensor ``[num_docs + 1]`` from 0, non-decreasing (a repeated value is
    a zero-length document, as data loaders pad the number of documents of a batch; Transformer Engine
    accepts them too), with at least one token in all.

    Raises:
        TypeError: not a tensor, or another dtype (uint8/int8 wrap around). ValueError: the shape,
        the start, a decreasing value (a negative length), or no token at all.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 tensor [num_docs + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; it must be int32 (or int64): smaller integer "
                        "types wrap around")
    values = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    if values is None or len(values) < 2 or values[0] != 0:
        raise ValueError(f"cu_seqlens must be 1-D [num_docs + 1] starting at 0, got shape {tuple(cu_seqlens.shape)}"
                         f"{'' if values is None else f' and values {values[:8]}'}")
    bad = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing (no negative document length): cu_seqlens[{bad - 1}]="
                         f"{values[bad - 1]}, cu_seqlens[{bad}]={values[bad]}")
    if values[-1] == 0:
        raise ValueError(f"cu_seqlens={values[:8]} holds no token (every document has length 0)")


DETERMINISTIC_MULTIPLE = 48
"""The deterministic mode pads every document (thd) and row (a Hugging Face batch) to a multiple of this too: 48 is a
multiple of ``2 * cp`` for cp 1, 2, 3, 4, 6 and 8, so at those degrees each has one padded length and the kernel runs
the same blocks (docs/deterministic.md)."""


def padded_length(seq_len: int, cp_size: int, deterministic: bool = False) -> int:
    """Tokens of a sequence (document) padded to a multiple of ``2 * cp`` (none at cp=1; in the deterministic mode
    also of :data:`DETERMINISTIC_MULTIPLE`, at every cp): the one rule of the zigzag padding (:class:`ZigzagDocs`,
    the dynamic CP scheduler's budgets, a Hugging Face batch's rows)."""
    multiple = 2 * cp_size if cp_size > 1 else 1
    if deterministic:
        multiple = math.lcm(multiple, DETERMINISTIC_MULTIPLE)
    return -(-seq_len // multiple) * multiple


def _arange(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length)


@dataclass(frozen=True)
class ZigzagDocs:
    """Documents zigzag-sharded over a group of ``size`` ranks: the layout every algorithm runs on.

    Document ``i`` has ``lengths[i]`` real tokens and is padded (at its end) to
    ``padded_lengths[i]``, a multiple of ``2 * size`` (Transformer Engine's ``cu_seqlens_padded``),
    then cut into ``2 * size`` chunks of ``chunk(i)`` tokens; rank ``r`` holds chunks ``r`` and
    ``2size-1-r`` of every document (``thd_get_partitioned_indices``). A rank's local tensor is its
    two chunks of document 0, then of document 1, ...: every rank holds the same number of tokens,
    ``local_offsets[i]`` is where document ``i`` starts on every rank. bshd is one document with
    no padding. With ``size == 1`` a document is one chunk and need not be padded. A zero-length document
    has chunks of 0 tokens: it holds no row anywhere, produces nothing and receives nothing.
    """

    lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    size: int

    @classmethod
    def from_lengths(cls, lengths, size: int, deterministic: bool = False) -> ZigzagDocs:
        """Pad each document to a multiple of ``2 * size`` (none at ``size == 1``; :func:`padded_length`'s
        ``deterministic`` rule).

        Raises:
            ValueError: an empty document list, a negative length, or no token at all.
        """
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 0 or sum(lengths) == 0:
            raise ValueError(f"document lengths {list(lengths)[:8]}... must be >= 0 with at least one token (and at "
                             "least one document)")
        return cls(lengths, tuple(padded_length(n, size, deterministic) for n in lengths), size)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, size: int, deterministic: bool = False) -> ZigzagDocs:
        """From real ``cu_seqlens`` (int32 ``[num_docs + 1]``, starting at 0, non-decreasing), padded as
        :meth:`from_lengths`.

        Raises:
            TypeError / ValueError: :func:`check_cu_seqlens`.
        """
        check_cu_seqlens(cu_seqlens)
        return cls.from_lengths(torch.diff(cu_seqlens.cpu()).tolist(), size, deterministic)

    @classmethod
    def uniform(cls, seq_len: int, size: int) -> ZigzagDocs:
        """One unpadded document of ``seq_len`` tokens (the bshd / sbhd layout)."""
        return cls((seq_len,), (seq_len,), size)

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    def chunk(self, i: int) -> int:
        """Tokens per chunk of document ``i`` (the whole padded document when ``size == 1``)."""
        return self.padded_lengths[i] // (2 * self.size) if self.size > 1 else self.padded_lengths[i]

    @cached_property
    def local_offsets(self) -> tuple[int, ...]:
        """Start of each document in every rank's local tensor, plus the local length at the end."""
        offsets = [0]
        for padded in self.padded_lengths:
            offsets.append(offsets[-1] + padded // self.size)
        return tuple(offsets)

    @property
    def local_len(self) -> int:
        return self.local_offsets[-1]

    @cached_property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """int32 ``[num_docs + 1]`` offsets of the padded documents in the global padded sequence."""
        return torch.tensor([0, *itertools.accumulate(self.padded_lengths)], dtype=torch.int32)

    def real_in_chunk(self, i: int, chunk_id: int) -> int:
        """Real (unpadded) tokens of document ``i`` in its chunk ``chunk_id`` (a prefix of the chunk)."""
        c = self.chunk(i)
        return max(0, min(c, self.lengths[i] - chunk_id * c))

    def rank_real(self, i: int, rank: int) -> tuple[int, int]:
        """Real tokens of document ``i`` in ``rank``'s first and second chunk. If the first is not
        full the second is empty, so a rank's real tokens of a document are a prefix of its slice."""
        if self.size == 1:
            return self.lengths[i], 0
        first, second = zigzag_chunk_ids(rank, self.size)
        return self.real_in_chunk(i, first), self.real_in_chunk(i, second)

    def rank_chunks(self, i: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        """``(chunk_id, local row, real tokens)`` of each chunk of document ``i`` on ``rank`` (one
        chunk at ``size == 1``); the chunk starts at position ``chunk_id * chunk(i)`` of the document."""
        ids = zigzag_chunk_ids(rank, self.size) if self.size > 1 else (0,)
        c, off = self.chunk(i), self.local_offsets[i]
        return tuple((cid, off + half * c, self.real_in_chunk(i, cid)) for half, cid in enumerate(ids))

    def chunk_owner_slot(self, i: int, chunk_id: int) -> tuple[int, int]:
        """``(rank, local row)`` where chunk ``chunk_id`` of document ``i`` starts."""
        rank, half = zigzag_chunk_owner(chunk_id, self.size) if self.size > 1 else (0, 0)
        return rank, self.local_offsets[i] + half * self.chunk(i)

    def positions(self, rank: int) -> torch.Tensor:
        """Position inside its document of every local slot of ``rank`` (int64 ``[local_len]``; computed once per
        layout and rank: read it, do not write into it)."""
        return _positions(self, rank)

    def real_mask(self, rank: int) -> torch.Tensor:
        """True for the local slots of ``rank`` that hold real tokens (bool ``[local_len]``)."""
        lengths = torch.repeat_interleave(torch.tensor(self.lengths), torch.tensor(self.padded_lengths) // self.size)
        return self.positions(rank) < lengths

    def dispatch_index(self, rank: int) -> torch.Tensor:
        """For each local slot of ``rank``: index of its token in the packed real sequence, or
        ``total`` (one past the end) for padding (int64 ``[local_len]``)."""
        starts = torch.repeat_interleave(torch.tensor([0, *itertools.accumulate(self.lengths)][:-1]),
                                         torch.tensor(self.padded_lengths) // self.size)
        index = starts + self.positions(rank)
        return torch.where(self.real_mask(rank), index, sum(self.lengths))

    def gathered_index(self, real_only: bool) -> torch.Tensor:
        """For each token of the global sequence (padded, or ``real_only``), its row in the ranks'
        local tensors concatenated rank by rank (int64; computed once per layout: read it, do not write into it)."""
        return _gathered_index(self, real_only)

    def inner(self, a2a_size: int) -> ZigzagDocs:
        """The layout after an all-to-all over ``a2a_size`` adjacent ranks and the reorder of
        :meth:`a2a_reorder_index`: a zigzag over ``size / a2a_size`` ranks, same documents."""
        return ZigzagDocs(self.lengths, self.padded_lengths, self.size // a2a_size)

    def a2a_reorder_index(self, a2a_size: int) -> torch.Tensor:
        """Rows of the all-to-all output (``a2a_size`` local tensors rank by rank) in the order of
        :meth:`inner`: per document, the members' first chunks ascending, then their second chunks
        descending by member, i.e. super-chunks ``p`` and ``2P-1-p`` (see :func:`a2a_chunk_order`)."""
        parts = []
        for i in range(self.num_docs):
            c, start = self.chunk(i), self.local_offsets[i]
            parts += [_arange(a * self.local_len + start, c) for a in range(a2a_size)]
            parts += [_arange(a * self.local_len + start + c, c) for a in reversed(range(a2a_size))]
        return torch.cat(parts)


@functools.lru_cache(maxsize=512)
def _gathered_index(layout: ZigzagDocs, real_only: bool) -> torch.Tensor:
    parts = []
    for i in range(layout.num_docs):
        c = layout.chunk(i)
        n_tokens = layout.lengths[i] if real_only else layout.padded_lengths[i]
        for chunk_id in range(-(-n_tokens // c) if c else 0):
            rank, row = layout.chunk_owner_slot(i, chunk_id)
            parts.append(_arange(rank * layout.local_len + row, min(c, n_tokens - chunk_id * c)))
    return torch.cat(parts)


@functools.lru_cache(maxsize=512)
def _positions(layout: ZigzagDocs, rank: int) -> torch.Tensor:
    parts = []
    for i in range(layout.num_docs):
        c = layout.chunk(i)
        ids = zigzag_chunk_ids(rank, layout.size) if layout.size > 1 else (0,)
        parts += [_arange(k * c, c) for k in ids]
    return torch.cat(parts)
