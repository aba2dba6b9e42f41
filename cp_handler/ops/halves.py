"""Packed documents (thd) through a packed kernel without per-step gathers: the rows of the ring reordered.

In the zigzag layout (:class:`~cp_handler.core.layout.ZigzagDocs`) a rank holds, per document, its first chunk,
its second chunk, then the document's padding. A ring step's blocks pair rows of every document, so a packed
(varlen) call's query or key rows skip the other chunk and the padding of each document: the call gathers
and scatters them (``cp-bench --modes launches`` counts those operators). Inside the ring only, the rows are
put in another order: the real rows of every document's first chunk, then those of every second chunk, then
all the padding. Every step's blocks then group into calls whose query and key rows are each one range:

* step 0: the diagonals of the first chunks and of the second chunks (one causal call over all real rows),
  the second chunks against the first (one full call);
* from a rank ``src < rank``: all queries against ``src``'s first chunks, as two calls (first-chunk queries,
  second-chunk queries), each over ``src``'s first half;
* from ``src > rank``: the second-chunk queries against all of ``src``'s rows (one call). Its keys are needed
  per document (first chunk, then second), so such a block travels in another order, **docs order**: every
  document's real rows (first chunk, then second), then all the padding (:func:`docs_rows`). A block reaches
  the ranks after its owner (``src < rank``) first and those before it (``src > rank``) after the ring's wrap
  from the last rank to rank 0, so the last rank sends every block in docs order (one gather of K/V per step
  it sends, forward and backward) and every other rank passes blocks on as they came. A dK/dV partial computed
  in docs order goes home in docs order and is added by index (:func:`docs_rows`) into its owner's rows.

A document whose keys are on a rank but whose queries are not (a short document) keeps an empty query segment
in its call, so the keys stay one range: packed kernels skip empty segments (a block kernel could not run
them; these plans are for packed kernels only). The same pairs of query and key tokens as
:func:`~.ring.ring_blocks`, so the same result; the token layout
outside the ring (``dispatch``: Megatron-LM's THD sharding, exactly) does not change. The reorder costs one
gather of q, k, v and one of the output per attention call, plus the last rank's docs-order gathers, instead
of gathers in every ring step. Only the plain causal / full masks (windows and chunks plan their own blocks) and
only with a packed kernel (a block kernel would run twice the blocks).
"""

from __future__ import annotations

import functools
import itertools

import torch

from ..core.layout import ZigzagDocs
from .blocks import Block
from .kernels import check_plan


@functools.lru_cache(maxsize=256)
def _starts(layout: ZigzagDocs, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(first-chunk starts, second-chunk starts, real rows (first, second) per document)`` of ``rank`` in
    the reordered rows (see the module doc)."""
    real = [layout.rank_real(i, rank) for i in range(layout.num_docs)]
    firsts = list(itertools.accumulate((a for a, _ in real), initial=0))
    seconds = list(itertools.accumulate((b for _, b in real), initial=firsts[-1]))
    return tuple(firsts), tuple(seconds), tuple(real)


@functools.lru_cache(maxsize=256)
def uses_halves(layout: ZigzagDocs, packed: bool, mask) -> bool:
    """Whether the ring reorders the rows: a packed kernel, the plain causal mask, and a layout with padding, or
    with more than one document over more than one rank (bshd is one unpadded document, and one rank's unpadded
    documents are one range already). Under the causal mask a query chunk with real tokens always meets key chunks
    with real tokens, so no document drops out of a call and the rows stay ranges; with no mask a document's keys
    on another rank may all be padding. One rank with padding is the all-to-all's inner ring (every document
    padded for the whole group): its one causal call then reads every real row as one range."""
    return packed and mask.plain and mask.causal and \
        (layout.lengths != layout.padded_lengths or (layout.size > 1 and layout.num_docs > 1))


@functools.lru_cache(maxsize=256)
def halves_order(layout: ZigzagDocs, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)`` int64 ``[local_len]`` on ``device``: reordered row ``j`` is local row ``order[j]``,
    local row ``i`` is reordered row ``inverse[i]``."""
    firsts, seconds = [], []
    for i in range(layout.num_docs):
        (_, first_row, first_real), *second = layout.rank_chunks(i, rank)
        firsts.append(torch.arange(first_row, first_row + first_real))
        if second:
            _, second_row, second_real = second[0]
            seconds.append(torch.arange(second_row, second_row + second_real))
    order = _then_padding(torch.cat(firsts + seconds), layout.local_len)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
    return order.to(device), inverse.to(device)


@functools.lru_cache(maxsize=256)
def docs_rows(layout: ZigzagDocs, rank: int, device: torch.device) -> torch.Tensor:
    """int64 ``[local_len]`` on ``device``: ``rank``'s rows in docs order (every document's real rows, first chunk
    then second, then all the padding; module doc) as rows of its :func:`halves_order`: docs row ``i`` is
    reordered row ``index[i]``. ``kv.index_select(seq_dim, index)`` puts a reordered block in docs order, and
    ``dkv.index_add_(seq_dim, index, partial)`` adds a docs-order partial into reordered rows."""
    real = [torch.arange(row, row + count) for i in range(layout.num_docs)
            for _, row, count in layout.rank_chunks(i, rank)]
    docs = _then_padding(torch.cat(real), layout.local_len)
    return halves_order(layout, rank, torch.device("cpu"))[1][docs].to(device)


def _then_padding(kept: torch.Tensor, local_len: int) -> torch.Tensor:
    """``kept`` (local rows of real tokens, in the order wanted) followed by every other row of ``local_len`` (the
    padding) in local order."""
    padding = torch.ones(local_len, dtype=torch.bool)
    padding[kept] = False
    return torch.cat([kept, padding.nonzero().flatten()])


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)


@functools.lru_cache(maxsize=512)
def halves_step_plans(layout: ZigzagDocs, step: int, rank: int) -> tuple[list[Block], ...]:
    """The causal plans of ring step ``step`` on ``rank`` over the reordered rows (keys in docs order from a
    ``src > rank``): one plan at step 0 (its first calls write every row), two from ``src < rank``, one from
    ``src > rank`` (module doc); empty blocks dropped."""
    src = (rank - step) % layout.size
    q_first, q_second, q_real = _starts(layout, rank)
    k_first, k_second, k_real = _starts(layout, src)
    docs = range(layout.num_docs)

    def pairs(q_starts, q_col, k_starts, k_col, flag):
        # a document with keys here but no queries keeps an empty query segment, so the keys stay one range
        return [(_span(q_starts[i], q_real[i][q_col]), _span(k_starts[i], k_real[i][k_col]), flag) for i in docs
                if k_real[i][k_col] and (q_real[i][q_col] or flag is False)]

    if step == 0:
        plans = (pairs(q_first, 0, k_first, 0, True) + pairs(q_second, 1, k_second, 1, True)
                 + pairs(q_second, 1, k_first, 0, False),)
    elif src < rank:
        plans = (pairs(q_first, 0, k_first, 0, False), pairs(q_second, 1, k_first, 0, False))
    else:  # src's rows arrive in docs order (module doc): a document's keys are one range
        k_docs = tuple(itertools.accumulate((a + b for a, b in k_real), initial=0))
        plans = ([(_span(q_second[i], q_real[i][1]), _span(k_docs[i], sum(k_real[i])), False) for i in docs
                  if sum(k_real[i])],)
    return tuple(check_plan(plan, empty_queries=True) for plan in plans if any(q.stop > q.start for q, _, _ in plan))


@functools.lru_cache(maxsize=256)
def halves_local_split(layout: ZigzagDocs, rank: int) -> tuple[list[Block], list[Block]]:
    """Step 0 over the reordered rows split as :func:`~.ring.local_blocks_split` splits it: the head (first
    chunks' diagonals, second chunks against the first) and the tail (the second chunks' diagonals)."""
    plans = halves_step_plans(layout, 0, rank)
    if not plans:  # no real token on this rank
        return [], []
    (plan,) = plans
    first_rows = _starts(layout, rank)[1][0]  # the second chunks start here
    tail = [block for block in plan if block[2] is True and block[0].start >= first_rows]
    return [block for block in plan if block not in tail], tail
