"""Dynamic CP scheduler: sequences of a global batch -> micro-batches of aligned CP groups.

Pure Python (no process groups), so it is unit-testable and fast. Rules:

* sequence ``i`` gets ``cp_i`` = the smallest power of two >= ``L_i / max_seqlen_per_dp_cp_rank``
  (at least ``min_dynamic_context_parallel_size``), counting the padding of ``L_i`` to ``2 * cp_i``;
* a micro-batch splits the ``R`` ranks into disjoint aligned power-of-two blocks (a group of size
  ``g`` starts at a multiple of ``g``); a group packs sequences of its size whose padded tokens per
  rank stay within ``max_seqlen_per_dp_cp_rank``; ranks left over get empty groups of the minimum
  size, so every rank has a group (and takes part) in every micro-batch;
* every rank sees the same number of micro-batches (they are global).

Placement (longest processing time first): sequences by decreasing cost; each opens a new group
while an aligned block is free (a buddy allocator hands out blocks, so no scan over rank indices),
else joins the least-loaded group of its size that has room, else waits for the next micro-batch.
This balances the estimated work (:mod:`.workload`) across the groups of a micro-batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .workload import Workload


@dataclass
class Group:
    """One CP group of one micro-batch: ranks ``first .. first + size - 1`` and their sequences."""

    size: int
    first: int
    sequences: list[int] = field(default_factory=list)
    tokens_per_rank: int = 0
    cost: float = 0.0

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass
class MicroBatch:
    groups: list[Group]

    def group_of(self, rank: int) -> Group:
        for group in self.groups:
            if group.first <= rank < group.first + group.size:
                return group
        raise KeyError(rank)


@dataclass
class Schedule:
    micro_batches: list[MicroBatch]
    cp_sizes: list[int]

    def for_rank(self, rank: int) -> list[Group]:
        """This rank's group in every micro-batch (the same count on every rank)."""
        return [mb.group_of(rank) for mb in self.micro_batches]


def padded_len(seq_len: int, cp: int) -> int:
    """Tokens of a sequence padded to a multiple of ``2 * cp`` (no padding at cp=1)."""
    multiple = 2 * cp if cp > 1 else 1
    return -(-seq_len // multiple) * multiple


def cp_size_for(seq_len: int, budget: int, min_size: int, num_ranks: int) -> int:
    """Smallest power of two >= ``min_size`` whose per-rank padded share fits ``budget``.

    Raises:
        ValueError: the sequence does not fit even on the largest power-of-two block of ranks.
    """
    size = min_size
    largest = 1 << (num_ranks.bit_length() - 1)
    while padded_len(seq_len, size) // size > budget:
        size *= 2
        if size > largest:
            raise ValueError(
                f"a sequence of {seq_len} tokens does not fit: max_seqlen_per_dp_cp_rank={budget} on at most "
                f"{largest} ranks holds {largest * budget} tokens (with padding to 2*cp)"
            )
    return size


class _Buddy:
    """Free aligned power-of-two blocks of ``[0, num_ranks)``; ``take(size)`` splits the smallest free block
    that holds ``size`` (best fit, lowest start among equals) and returns the start."""

    def __init__(self, num_ranks: int):
        self.free: dict[int, list[int]] = {}
        start = 0
        for bit in reversed(range(num_ranks.bit_length())):  # num_ranks as a sum of aligned powers of two
            if num_ranks >> bit & 1:
                heapq.heappush(self.free.setdefault(1 << bit, []), start)
                start += 1 << bit

    def take(self, size: int) -> int | None:
        bigger = sorted(s for s, starts in self.free.items() if s >= size and starts)
        if not bigger:
            return None
        block = bigger[0]
        start = heapq.heappop(self.free[block])
        while block > size:  # split, keep the upper halves free
            block //= 2
            heapq.heappush(self.free.setdefault(block, []), start + block)
        return start

    def remaining(self) -> list[tuple[int, int]]:
        return sorted((start, size) for size, starts in self.free.items() for start in starts)


LOOKAHEAD = 8
"""How many of the least-loaded groups of a size are tried before a sequence waits for the next
micro-batch (bounds the work per sequence to O(LOOKAHEAD log groups))."""


def _join_open_group(heap: list, groups: list[Group], tokens: int, budget: int) -> int | None:
    """Pop up to LOOKAHEAD least-loaded groups; return the index of the first with room (popped: its
    caller pushes it back with its new cost); the others go back unchanged."""
    tried, found = [], None
    while heap and len(tried) < LOOKAHEAD:
        entry = heapq.heappop(heap)
        if groups[entry[2]].tokens_per_rank + tokens <= budget:
            found = entry[2]
            break
        tried.append(entry)
    for entry in tried:
        heapq.heappush(heap, entry)
    return found


def _fill_micro_batch(order, lengths, cp_sizes, num_ranks, budget, min_size, workload):
    buddy, groups, waiting = _Buddy(num_ranks), [], []
    open_by_size: dict[int, list] = {}  # size -> heap of (cost, first, index into groups)
    # Within a micro-batch free blocks only shrink and groups only fill, so failures are remembered:
    no_block_from = num_ranks + 1  # no free block of this size or larger
    no_room_from: dict[int, int] = {}  # size -> fewest tokens that found no room
    for i in order:
        size, tokens = cp_sizes[i], padded_len(lengths[i], cp_sizes[i]) // cp_sizes[i]
        heap = open_by_size.setdefault(size, [])
        start = buddy.take(size) if size < no_block_from else None
        if start is not None:
            groups.append(Group(size, start))
            index = len(groups) - 1
        else:
            no_block_from = min(no_block_from, size)
            index = None if tokens >= no_room_from.get(size, budget + 1) else _join_open_group(heap, groups, tokens,
                                                                                               budget)
            if index is None:
                no_room_from[size] = min(no_room_from.get(size, budget + 1), tokens)
                waiting.append(i)
                continue
        group = groups[index]
        group.sequences.append(i)
        group.tokens_per_rank += tokens
        group.cost += workload.cost(lengths[i], size)
        heapq.heappush(heap, (group.cost, group.first, index))
    for start, size in buddy.remaining():  # ranks with nothing to do still get (empty) groups
        groups += [Group(min(min_size, size), s) for s in range(start, start + size, min(min_size, size))]
    return MicroBatch(sorted(groups, key=lambda g: g.first)), waiting


def schedule_sequences(lengths: list[int], num_ranks: int, max_seqlen_per_dp_cp_rank: int,
                       min_dynamic_context_parallel_size: int = 1, workload: Workload | None = None) -> Schedule:
    """Schedule one global batch.

    Args:
        lengths: tokens of each sequence (>= 1).
        num_ranks: DP x CP ranks (>= 1).
        max_seqlen_per_dp_cp_rank: token budget of one rank in one micro-batch (padding counted).
        min_dynamic_context_parallel_size: smallest CP group size (a power of two).
        workload: cost model used to balance (default :class:`Workload`).

    Raises:
        ValueError: a bad argument, or a sequence that cannot fit even on all ranks.
    """
    min_size = min_dynamic_context_parallel_size
    if num_ranks < 1 or max_seqlen_per_dp_cp_rank < 1 or min_size < 1 or min_size & (min_size - 1):
        raise ValueError(f"num_ranks={num_ranks}, max_seqlen_per_dp_cp_rank={max_seqlen_per_dp_cp_rank} must be "
                         f">= 1 and min_dynamic_context_parallel_size={min_size} a power of two")
    if min_size > num_ranks:
        raise ValueError(f"min_dynamic_context_parallel_size={min_size} exceeds the {num_ranks} ranks")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence length must be >= 1")
    workload = workload or Workload()
    cp_sizes = [cp_size_for(n, max_seqlen_per_dp_cp_rank, min_size, num_ranks) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-workload.cost(lengths[i], 1), i))
    micro_batches = []
    while order:
        micro_batch, order = _fill_micro_batch(order, lengths, cp_sizes, num_ranks, max_seqlen_per_dp_cp_rank,
                                               min_size, workload)
        micro_batches.append(micro_batch)
    return Schedule(micro_batches, cp_sizes)
