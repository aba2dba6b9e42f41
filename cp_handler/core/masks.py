"""One description of what a query may see, and the blocks of a plan it leaves empty, full or partial.

:class:`AttentionMask` is causal (or bidirectional), optionally with a sliding window (left window
``W``: a query at position ``q`` sees keys ``q - W < k <= q``, transformers' ``sliding_window``
convention, i.e. Transformer Engine's ``window_size = (W - 1, 0)``; without the causal mask also a right
window ``R``: keys ``k <= q + R``, so ``window_size = (W - 1, R)`` is two-sided local attention, as encoders
with local layers use) and/or chunked attention (chunk
``C``: only keys in the query's chunk ``k // C == q // C``), plus a soft-cap of the scores
(``softcap * tanh(s / softcap)``, Gemma 2). Positions are inside a document (thd: each document
restarts at 0), so windows and chunks stay within documents.

Every planner asks :func:`mask_blocks` for the blocks between a run of query positions and a run of
key positions: it returns nothing for an empty pair, a full block (no mask) or the square causal
diagonal (the kernels' own causal flag) where it can, and splits the rest into tiles so that only the
band along a window's or chunk's edge goes to the masked kernel (:mod:`cp_handler.ops.kernels.masked`)
as a :class:`BlockMask`. No planner re-derives window or chunk logic on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MASK_TILE = 64
"""Query rows of the tiles a partially masked block is split into: the parts of a tile's keys that
every row sees go to the fast kernels, only the bands where the visibility changes (the causal
diagonal, a window's left edge, a chunk boundary: at most ``MASK_TILE`` keys wide each) to the masked
kernel."""

MASK_KEY_TILE = 512
"""Widest masked block (keys): a soft-capped block is masked everywhere, so it is cut into
``MASK_TILE x MASK_KEY_TILE`` tiles, bounding the masked kernel's explicit scores (see its doc)."""


@dataclass(frozen=True)
class AttentionMask:
    """What a query may see (positions inside one document).

    Attributes:
        causal: keys up to the query's own position (else every key of the document).
        window: sliding window ``W >= 1``: keys ``q - W < k``, ``None``: unbounded.
        chunk: chunked attention ``C >= 1``: keys of the query's chunk, ``None``: no chunks (causal only).
        softcap: soft-capping of the scores, ``None``: none.
        window_right: without ``causal``: keys ``k <= q + R`` (``R >= 0``), ``None``: unbounded.
        plain: causal or full, nothing else (derived, not a field): the plans' fast path, no masked block.

    Raises:
        ValueError / TypeError: a window, chunk or soft-cap that is not a positive number (``window_right``:
            negative); chunks without ``causal``; ``window_right`` with ``causal`` (the causal mask is its 0).
    """

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    window_right: int | None = None

    def __post_init__(self):
        for name, least in (("window", 1), ("chunk", 1), ("window_right", 0)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"attention mask {name}={value!r} must be an int >= {least}")
            if value < least:
                raise ValueError(f"attention mask {name}={value} must be >= {least}")
        if self.chunk is not None and not self.causal:
            raise ValueError(f"attention mask chunk={self.chunk} needs a causal mask (chunks of earlier keys)")
        if self.window_right is not None and self.causal:
            raise ValueError(f"attention mask window_right={self.window_right} without causal=False: the causal mask "
                             "is a right window of 0")
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float))
                                         or not math.isfinite(self.softcap) or self.softcap <= 0):
            raise ValueError(f"attention mask softcap={self.softcap!r} must be a finite number > 0")
        # causal or full, nothing else: the plans' fast path (no masked block); an attribute, not a property: the
        # hot path reads it per call (a property is a Python call)
        object.__setattr__(self, "plain", not self.restricted and self.softcap is None)

    @property
    def restricted(self) -> bool:
        """A window or chunks: blocks may be empty or partial beyond the causal rule."""
        return self.window is not None or self.chunk is not None or self.window_right is not None

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Which (query, key) position pairs are visible (bool, broadcast)."""
        seen = k_pos <= q_pos if self.causal else torch.ones_like(k_pos - q_pos, dtype=torch.bool)
        if self.window is not None:
            seen = seen & (k_pos > q_pos - self.window)
        if self.chunk is not None:
            seen = seen & (k_pos // self.chunk == q_pos // self.chunk)
        if self.window_right is not None:
            seen = seen & (k_pos <= q_pos + self.window_right)
        return seen

    def lookback(self, q_pos: int) -> int:
        """How many positions before ``q_pos`` the query at ``q_pos`` (and every later one in the same
        window / chunk reach) may see: ``W - 1``, or ``q_pos mod C``; ``q_pos`` when unbounded."""
        reach = q_pos
        if self.window is not None:
            reach = min(reach, self.window - 1)
        if self.chunk is not None:
            reach = min(reach, q_pos % self.chunk)
        return reach

    def reach_after(self, end: int) -> float:
        """The first key position no query before ``end`` may see past its own (exclusive): ``end`` causal,
        ``end - 1 + R + 1`` with a right window, unbounded otherwise."""
        if self.causal:
            return end
        return end + self.window_right if self.window_right is not None else math.inf

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """Queries at positions ``[q0, q1)`` against keys ``[k0, k1)``: ``"empty"``, ``"full"``,
        ``"causal"`` (square, on the diagonal, nothing else masked) or ``"partial"``."""
        first_q, last_q, first_k, last_k = q0, q1 - 1, k0, k1 - 1
        if self.causal and first_k > last_q:
            return "empty"
        if self.window is not None and last_k <= first_q - self.window:
            return "empty"
        if self.chunk is not None and (last_k // self.chunk < first_q // self.chunk
                                       or first_k // self.chunk > last_q // self.chunk):
            return "empty"
        if self.window_right is not None and first_k > last_q + self.window_right:
            return "empty"
        window_ok = (self.window is None or first_k > last_q - self.window) and \
            (self.window_right is None or last_k <= first_q + self.window_right)
        chunk_ok = self.chunk is None or first_q // self.chunk == last_q // self.chunk == \
            first_k // self.chunk == last_k // self.chunk
        if not self.causal or last_k <= first_q:
            return "full" if window_ok and chunk_ok else "partial"
        if (q0, q1) == (k0, k1) and window_ok and chunk_ok:
            return "causal"
        return "partial"


@dataclass(frozen=True)
class BlockMask:
    """A block the masked kernel runs: ``mask`` at query positions from ``q_pos`` and key positions
    from ``k_pos`` (the first row's and the first key's position in their document)."""

    mask: AttentionMask
    q_pos: int
    k_pos: int

    def visible(self, nq: int, nk: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``(nq, nk)`` bool: which of the block's ``nq`` queries see which of its ``nk`` keys."""
        q_pos = torch.arange(self.q_pos, self.q_pos + nq, device=device)
        k_pos = torch.arange(self.k_pos, self.k_pos + nk, device=device)
        return self.mask.visible(q_pos[:, None], k_pos[None, :])


CAUSAL = AttentionMask()
"""The plain causal mask (the plans' fast path)."""

NO_MASK = AttentionMask(causal=False)
"""Every key of the document."""


def resolve_mask(causal: bool, mask: AttentionMask | None) -> AttentionMask:
    """The mask an algorithm runs: ``mask`` when given (its ``causal`` must equal ``causal``), else the
    plain causal / full mask.

    Raises:
        TypeError: ``mask`` is not an :class:`AttentionMask`. ValueError: it disagrees with ``causal``.
    """
    if mask is None:
        return CAUSAL if causal else NO_MASK
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"mask={mask!r} must be a cp_handler.core.masks.AttentionMask (or None)")
    if mask.causal != bool(causal):
        raise ValueError(f"mask={mask} disagrees with causal={causal}")
    return mask


def _kind(mask: AttentionMask, q0: int, q1: int, k0: int, k1: int):
    """The third element of a block (see :mod:`cp_handler.ops.blocks`): ``False`` full, ``True``
    square causal, a :class:`BlockMask` otherwise (or always, with a soft-cap); ``None`` for empty."""
    kind = mask.classify(q0, q1, k0, k1)
    if kind == "empty":
        return None
    if mask.softcap is not None or kind == "partial":
        return BlockMask(mask, q0, k0)
    return kind == "causal"


def mask_blocks(q_rows: slice, q_pos: int, k_rows: slice, k_pos: int, mask: AttentionMask,
                tile: int = MASK_TILE, key_tile: int = MASK_KEY_TILE) -> list[tuple[slice, slice, bool | BlockMask]]:
    """The blocks between query rows ``q_rows`` (positions from ``q_pos``, contiguous) and key rows
    ``k_rows`` (positions from ``k_pos``): nothing for an empty pair; one block when it is full or the
    square causal diagonal (or a small partial one within one chunk: a block across a chunk boundary is always
    cut, so that no kernel needs chunks); else per tile of ``tile`` query rows, the keys cut
    where the visibility of those rows changes (:func:`_edges`): full and causal pieces for the fast
    kernels, the rest as :class:`BlockMask` pieces of at most ``key_tile`` keys. Empty pieces are
    dropped (no kernel call, no merge)."""
    nq, nk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
    if not nq or not nk:
        return []
    kind = _kind(mask, q_pos, q_pos + nq, k_pos, k_pos + nk)
    if kind is None:
        return []
    small = nq <= tile and nk <= key_tile and not _straddles_chunk(mask, q_pos, nq, k_pos, nk)
    if not isinstance(kind, BlockMask) or small:
        return [(q_rows, k_rows, kind)]
    blocks = []
    starts = sorted({*range(0, nq, tile), *_chunk_starts(mask, q_pos, nq)})
    for qs, qe in zip(starts, [*starts[1:], nq], strict=True):
        cuts = sorted({0, nk, *_edges(mask, q_pos + qs, q_pos + qe, k_pos, nk)})
        for ks, ke in zip(cuts[:-1], cuts[1:], strict=False):
            kind = _kind(mask, q_pos + qs, q_pos + qe, k_pos + ks, k_pos + ke)
            if kind is None:
                continue
            step = key_tile if isinstance(kind, BlockMask) else ke - ks
            for kt in range(ks, ke, step):
                piece = kind if step == ke - ks else BlockMask(mask, q_pos + qs, k_pos + kt)
                blocks.append((slice(q_rows.start + qs, q_rows.start + qe),
                               slice(k_rows.start + kt, k_rows.start + min(kt + step, ke)), piece))
    return blocks


MASK_FEATURES = ("causal", "window", "window_right", "chunk", "softcap")
"""What a masked block may ask of a kernel (:func:`block_needs`; :attr:`~cp_handler.ops.kernels.base.AttnKernel.masks`):
the causal edge at any offset, the left and right window edges, a chunk boundary, soft-capped scores."""


def _straddles_chunk(mask: AttentionMask, q_pos: int, nq: int, k_pos: int, nk: int) -> bool:
    """The queries at ``[q_pos, q_pos + nq)`` and keys at ``[k_pos, k_pos + nk)`` are not all in one chunk."""
    return mask.chunk is not None and len({q_pos // mask.chunk, (q_pos + nq - 1) // mask.chunk, k_pos // mask.chunk,
                                           (k_pos + nk - 1) // mask.chunk}) > 1


def mask_needs(mask: AttentionMask) -> frozenset[str]:
    """Everything a block of ``mask`` may need (:func:`block_needs` of its blocks is a subset): the causal edge, the
    window edges and the soft-cap it has (never a chunk boundary: :func:`mask_blocks` cuts them)."""
    return frozenset(name for name, on in (("causal", mask.causal), ("window", mask.window is not None),
                                           ("window_right", mask.window_right is not None),
                                           ("softcap", mask.softcap is not None)) if on)


def block_needs(block: BlockMask, nq: int, nk: int) -> frozenset[str]:
    """The :data:`MASK_FEATURES` a kernel must compute to run ``block`` (``nq`` queries, ``nk`` keys) exactly: an
    edge is needed only where it cuts the block (a window wider than the block's reach needs nothing), a chunk
    only where the block straddles a boundary (:func:`mask_blocks` cuts every block
    there, so its blocks never need it)."""
    mask, first_q, last_q = block.mask, block.q_pos, block.q_pos + nq - 1
    first_k, last_k = block.k_pos, block.k_pos + nk - 1
    needs = set()
    if mask.causal and last_k > first_q:
        needs.add("causal")
    if mask.window is not None and first_k <= last_q - mask.window:
        needs.add("window")
    if mask.window_right is not None and last_k > first_q + mask.window_right:
        needs.add("window_right")
    if _straddles_chunk(mask, first_q, nq, first_k, nk):
        needs.add("chunk")
    if mask.softcap is not None:
        needs.add("softcap")
    return frozenset(needs)


def _chunk_starts(mask: AttentionMask, pos: int, n: int) -> list[int]:
    """Offsets (from ``pos``) of the chunk boundaries inside ``n`` positions: row tiles start there, so
    no tile straddles a chunk and every key range is seen by all rows of a tile or by none."""
    if mask.chunk is None:
        return []
    first = (pos // mask.chunk + 1) * mask.chunk
    return [b - pos for b in range(first, pos + n, mask.chunk)]


def _edges(mask: AttentionMask, q0: int, q1: int, k_pos: int, nk: int) -> list[int]:
    """Key offsets (from ``k_pos``) where the visibility of the queries at ``[q0, q1)`` can change:
    the ends of the causal diagonal band, of the window's left-edge band and right-edge band (each at most
    ``q1 - q0`` keys wide) and of the chunk of those queries (a tile never straddles a chunk). Between two
    cuts every row sees all keys or none, except inside a band."""
    points = [q0, q1] if mask.causal else []
    if mask.window is not None:
        points += [q0 - mask.window + 1, q1 - mask.window + 1]
    if mask.chunk is not None:
        points += [q0 // mask.chunk * mask.chunk, ((q1 - 1) // mask.chunk + 1) * mask.chunk]
    if mask.window_right is not None:
        points += [q0 + mask.window_right + 1, q1 + mask.window_right]
    return [p - k_pos for p in points if 0 < p - k_pos < nk]
