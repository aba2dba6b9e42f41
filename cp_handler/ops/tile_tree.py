"""The canonical tiles' merge tree: partials combined in one order whatever order they arrive in.

The deterministic mode (:mod:`.canonical`) cuts the sequence into tiles fixed by its length alone. A query tile's
output is its partials over the key tiles merged, a query tile's dq its partials over the key tiles summed, a key
tile's dk / dv its partials over the query tiles summed. Floating-point merges and sums are not associative, so the
bits follow the order they are combined in; a ring delivers the key tiles in an order that follows the rank and the
group. Here the order is a fixed binary tree over the tile indices ``[0, K)`` (``K`` tiles in the sequence; a node
``[lo, hi)`` splits at ``lo`` plus the largest power of two below ``hi - lo``), each node its left child combined with
its right one, so the result depends on the tile indices alone: the same at every CP degree and in every pattern. A
node whose leaves are all invisible (above the causal diagonal) is absent and its sibling passes up unchanged.

Partials are combined as soon as their sibling is complete and kept until then: arriving in a ring's order (runs of
consecutive tiles), a tree holds ``O(log K)`` pending nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def split(lo: int, hi: int) -> int:
    """Where node ``[lo, hi)`` (``hi - lo >= 2``) splits: ``lo`` plus the largest power of two below ``hi - lo``."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


@functools.lru_cache(maxsize=64)
def _links(num_tiles: int) -> dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int], bool]]:
    """``node -> (parent, sibling, is_left)`` of every node below the root of the tree over ``num_tiles`` tiles."""
    links, stack = {}, [(0, num_tiles)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo > 1:
            mid = split(lo, hi)
            links[(lo, mid)] = ((lo, hi), (mid, hi), True)
            links[(mid, hi)] = ((lo, hi), (lo, mid), False)
            stack += [(lo, mid), (mid, hi)]
    return links


class TileTree:
    """One tile's partials over the ``num_tiles`` tiles of the other side, of which those in ``visible`` (a range of
    tile indices) contribute, combined in the tree of the module doc.

    Args:
        num_tiles: tiles of the sequence (``K``).
        visible: the tiles whose partials :meth:`add` receives (each exactly once, in any order).
        combine: ``combine(left, right) -> node``; may reuse ``left``'s storage (partials are this tree's own).
    """

    def __init__(self, num_tiles: int, visible: range, combine: Callable):
        self.links, self.visible, self.combine = _links(num_tiles), visible, combine
        self.root = (0, num_tiles)
        self.done: dict[tuple[int, int], object] = {}

    def _absent(self, node: tuple[int, int]) -> bool:
        return node[1] <= self.visible.start or node[0] >= self.visible.stop

    def add(self, tile: int, partial, stop: int | None = None) -> None:
        """Receive the partial of ``tile`` (or, with ``stop``, of the complete node ``[tile, stop)``, combined
        elsewhere in this tree's order); combine up the tree while the sibling is complete."""
        node = (tile, tile + 1 if stop is None else stop)
        while node != self.root:
            parent, sibling, is_left = self.links[node]
            if not self._absent(sibling):
                other = self.done.pop(sibling, None)
                if other is None:
                    self.done[node] = partial
                    return
                partial = self.combine(partial, other) if is_left else self.combine(other, partial)
            node = parent
        self.done[node] = partial

    def result(self):
        """The combined partials of every visible tile (raises ``KeyError`` if one has not arrived)."""
        return self.done[self.root]
