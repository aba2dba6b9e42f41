"""The canonical tiles' geometry (the deterministic mode, :mod:`.canonical`): how a layout's documents are cut into
tiles (a function of the documents alone), which tiles a rank holds, which (query tile, key tile) pairs meet and
what each computes, who owns a tile, and whether a call runs on tiles at all."""

from __future__ import annotations

import functools

from ..core.layout import DETERMINISTIC_MULTIPLE, ZigzagDocs
from ..core.masks import AttentionMask, mask_blocks

TILES = (2048, 1024, 512, 256, 128, 64)
"""Tokens per canonical tile, by sequence length: the largest ``T`` of these with ``S`` a multiple of ``16 T`` (the
zigzag chunks ``S / (2 cp)`` are then multiples of ``T`` at cp 1, 2, 4 and 8), else 64. A function of the sequence
alone, so every degree cuts the same tiles; larger tiles mean fewer kernel calls and merges."""


def tile_size(seq_len: int) -> int:
    """The canonical tile of a sequence of ``seq_len`` tokens (:data:`TILES`)."""
    return next((t for t in TILES if seq_len % (16 * t) == 0), TILES[-1])


def _sequence_rule(layout: ZigzagDocs) -> bool:
    """Whether :func:`tilings` cuts ``layout`` by :func:`tile_size`: one unpadded sequence of a multiple of it."""
    return (layout.num_docs == 1 and layout.lengths == layout.padded_lengths
            and layout.padded_lengths[0] % tile_size(layout.padded_lengths[0]) == 0)


@functools.lru_cache(maxsize=256)
def tilings(layout: ZigzagDocs) -> tuple[tuple[int, int], ...]:
    """``(tokens per tile, tiles)`` of each document, a function of the documents alone: one unpadded sequence of a
    multiple of :func:`tile_size`, that size; otherwise (packed documents, other lengths) a 48th of each padded
    document (:data:`~cp_handler.core.layout.DETERMINISTIC_MULTIPLE`: the mode pads every document to a multiple of
    it, and a 48th divides the zigzag chunks at cp 1, 2, 3, 4, 6 and 8)."""
    if _sequence_rule(layout):
        size = tile_size(layout.padded_lengths[0])
        return ((size, layout.padded_lengths[0] // size),)
    return tuple((padded // DETERMINISTIC_MULTIPLE, DETERMINISTIC_MULTIPLE if padded else 0)
                 for padded in layout.padded_lengths)


def tiles_refusal(layout: ZigzagDocs, mask, cp: int, comm_type: str) -> str | None:
    """Why ``layout``'s documents in zigzag chunks over ``cp`` ranks cannot run ``comm_type`` on canonical tiles
    (:func:`tilings`; ``None``: they can): the chunks must be whole tiles, and where documents are padded the mask
    causal (a full mask or a window to the right would let real queries see the padding)."""
    parts = 2 * cp if cp > 1 else 1
    head = f"deterministic=True with cp_comm_type={comm_type!r}"
    if _sequence_rule(layout):
        seq_len = layout.padded_lengths[0]
        tile = tile_size(seq_len)
        if seq_len % (parts * tile):
            return (f"{head}: a sequence of {seq_len} tokens over {cp} ranks has zigzag chunks of {seq_len / parts:g} "
                    f"tokens; the mode's tiles ({tile} tokens for this length) need chunks that are multiples of them "
                    f"(pad the sequence to a multiple of {parts * TILES[-1]})")
        return None
    if any(padded % DETERMINISTIC_MULTIPLE for padded in layout.padded_lengths):
        return (f"{head}: documents of {list(layout.padded_lengths)[:8]} tokens; the mode's tiles need a sequence of "
                f"a multiple of {TILES[-1]} tokens or documents of multiples of {DETERMINISTIC_MULTIPLE} (a "
                f"{DETERMINISTIC_MULTIPLE}th each): pad to one of them")
    if DETERMINISTIC_MULTIPLE % parts:
        return (f"{head} over {cp} ranks: a {DETERMINISTIC_MULTIPLE}th of a document (its canonical tile) divides its "
                f"zigzag chunks only where 2 x cp divides {DETERMINISTIC_MULTIPLE} (cp 1, 2, 3, 4, 6, 8, 12, 24)")
    if layout.lengths != layout.padded_lengths and not mask.causal:
        return (f"{head}: its canonical tiles run causal masks on padded documents (a full one would see a "
                "document's padding: use 'a2a')")
    return None


def rank_ranges(layout: ZigzagDocs, rank: int) -> tuple[tuple[int, int, int, int], ...]:
    """``(document, local row, position in the document, rows)`` of each of ``rank``'s chunks."""
    return tuple((doc, local, cid * layout.chunk(doc), layout.chunk(doc)) for doc in range(layout.num_docs)
                 if layout.padded_lengths[doc] for cid, local, _ in layout.rank_chunks(doc, rank))


def tiles_in(ranges, tiling):
    """``(local rows, tile)`` of each tile in ``ranges`` (chunks that are multiples of their document's tile); a
    tile is ``(document, index in the document)``."""
    for doc, local, first, rows in ranges:
        size = tiling[doc][0]
        for i in range(rows // size):
            yield slice(local + i * size, local + (i + 1) * size), (doc, first // size + i)


def pair_kind(query_tile: int, key_tile: int, size: int, mask: AttentionMask):
    """What a (query tile, key tile) pair computes: ``None`` nothing (no key visible), ``False`` a full call, ``True``
    the causal diagonal, or the pair's own blocks (:func:`~cp_handler.core.masks.mask_blocks` on the pair: windows,
    chunks, soft-caps), always run together, in their order, on this pair alone."""
    if mask.plain:
        if not mask.causal:
            return False
        return None if key_tile > query_tile else key_tile == query_tile
    blocks = mask_blocks(slice(0, size), query_tile * size, slice(0, size), key_tile * size, mask)
    if not blocks:
        return None
    whole = slice(0, size)
    if len(blocks) == 1 and isinstance(blocks[0][2], bool) and blocks[0][:2] == (whole, whole):
        return blocks[0][2]
    return tuple(blocks)


@functools.lru_cache(maxsize=1024)
def partners(tile: int, num_tiles: int, size: int, mask: AttentionMask, queries: bool) -> tuple:
    """``(tile of the other side, :func:`pair_kind`)`` of every tile that meets ``tile``, ascending (``queries``:
    ``tile`` is a query tile, these its key tiles). Every mask's visible tiles are a run around the diagonal, scanned
    from it (the plain masks' in closed form)."""
    def kind(other):
        return pair_kind(tile, other, size, mask) if queries else pair_kind(other, tile, size, mask)

    if mask.plain:
        others = range(num_tiles) if not mask.causal else range(0, tile + 1) if queries else range(tile, num_tiles)
    else:
        lo, hi = tile, tile + 1
        while lo > 0 and kind(lo - 1) is not None:
            lo -= 1
        while hi < num_tiles and kind(hi) is not None:
            hi += 1
        others = range(lo, hi)
    return tuple((other, kind(other)) for other in others)


def meets(tile, tiling, mask: AttentionMask, queries: bool) -> tuple:
    """:func:`partners` of a ``(document, index)`` tile: the tiles of its document it meets, with the pairs'
    kinds."""
    doc, index = tile
    size, count = tiling[doc]
    return tuple(((doc, other), kind) for other, kind in partners(index, count, size, mask, queries))


def tile_owner(tile, tiling, layout: ZigzagDocs) -> int:
    """The rank holding (key) tile ``(document, index)`` in the zigzag layout."""
    doc, index = tile
    return layout.chunk_owner_slot(doc, index * tiling[doc][0] // layout.chunk(doc))[0]


def canonical_applies(layout: ZigzagDocs, mask, sinks, tiled: bool = False) -> bool:
    """Whether a call runs on canonical tiles in the deterministic mode: one unpadded sequence of a multiple of
    :func:`tile_size` without sinks, any mask (every pattern: one process, ``a2a``'s heads); with ``tiled`` (the
    call's pattern runs on canonical tiles alone: ``p2p``, ``all_gather``, ``a2a+p2p``) also sinks and documents of
    multiples of 48 (:func:`tiles_refusal` at one rank). A function of the global call and the pattern alone, so
    every degree decides alike; ``a2a`` keeps one process's blockwise plan for those (tiles of a 48th of a short
    document are a few tokens each: many small calls)."""
    if sinks is not None and not tiled:
        return False
    return _sequence_rule(layout) or (tiled and tiles_refusal(layout, mask, 1, "") is None)
