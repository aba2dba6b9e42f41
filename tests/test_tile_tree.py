"""The canonical tiles' merge tree (cp_handler/ops/tile_tree.py): the order partials are combined in depends on the
tile indices alone. The combine writes the tree's shape (``"(left right)"``), so any difference in order or grouping
shows as a different string: whatever order the leaves arrive in, and when they are cut into runs on several ranks,
each rank's complete nodes added to the owner's tree as nodes (what the deterministic mode's backward sends), the
result is one process's, leaf by leaf in ascending order (hypothesis, no deadline)."""

from hypothesis import given
from hypothesis import strategies as st

from cp_handler.ops.tile_tree import TileTree, split


def _shape(left, right):
    return f"({left} {right})"


def _tree(num_tiles: int, visible: range) -> TileTree:
    return TileTree(num_tiles, visible, _shape)


@st.composite
def _cases(draw):
    num_tiles = draw(st.integers(1, 40))
    lo = draw(st.integers(0, num_tiles - 1))
    visible = range(lo, draw(st.integers(lo + 1, num_tiles)))
    order = draw(st.permutations(list(visible)))
    cuts = sorted(draw(st.sets(st.integers(visible.start + 1, max(visible.start + 1, visible.stop - 1)),
                               max_size=6)) - {visible.stop})
    return num_tiles, visible, order, cuts


def _one_process(num_tiles: int, visible: range) -> str:
    tree = _tree(num_tiles, visible)
    for tile in visible:
        tree.add(tile, str(tile))
    return tree.result()


@given(_cases())
def test_any_arrival_order_and_any_cut_into_runs_gives_one_process_tree(case):
    num_tiles, visible, order, cuts = case
    want = _one_process(num_tiles, visible)
    tree = _tree(num_tiles, visible)
    for tile in order:  # any arrival order
        tree.add(tile, str(tile))
    assert tree.result() == want
    owner = _tree(num_tiles, visible)  # runs on several ranks: each sends its complete nodes
    bounds = [visible.start, *cuts, visible.stop]
    nodes = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        rank = _tree(num_tiles, visible)
        for tile in reversed(range(start, stop)):
            rank.add(tile, str(tile))
        nodes += list(rank.done.items())
    for (lo, hi), value in reversed(nodes):
        owner.add(lo, value, hi)
    assert owner.result() == want


def test_the_tree_splits_at_the_largest_power_of_two_below_the_width():
    """Node ``[lo, hi)`` splits at ``lo`` plus the largest power of two below ``hi - lo``: balanced for a power of
    two, a power-of-two left part otherwise; aligned runs of a power of two tiles are nodes."""
    assert [split(0, n) for n in (2, 3, 4, 5, 8, 9, 16, 48)] == [1, 2, 2, 4, 4, 8, 8, 32]
    assert _one_process(4, range(4)) == "((0 1) (2 3))"
    assert _one_process(6, range(6)) == "(((0 1) (2 3)) (4 5))"
    assert _one_process(8, range(2, 5)) == "((2 3) 4)"  # tiles outside the visible run are absent
    rank = _tree(16, range(16))
    for tile in range(4, 8):
        rank.add(tile, str(tile))
    assert list(rank.done) == [(4, 8)]  # an aligned run of 4 tiles: one node
