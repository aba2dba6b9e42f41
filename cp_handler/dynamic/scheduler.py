"""Dynamic CP scheduler: sequences of a global batch -> micro-batches of aligned CP groups.

Pure Python (no process groups), so it is unit-testable and fast. The shape of a schedule:

* a **micro-batch** splits the ``R`` ranks into disjoint aligned power-of-two groups (a group of
  size ``g`` starts at a multiple of ``g``); ranks left over get empty groups, so every rank has a
  group in every micro-batch and all ranks see the same number of micro-batches;
* a **group** runs its sequences at its size, as one or more **packs** one after another (thd
  batches of at most ``max_seqlen_per_dp_cp_rank`` padded tokens per rank: the memory budget);
  packs only communicate inside their group, so groups of one micro-batch run independently and
  the micro-batch ends when its slowest group does.

Algorithm (balance the estimated time, :mod:`.workload` / :mod:`.cost_model`):

1. each sequence's smallest power-of-two size whose padded share fits the budget (at least
   ``min_dynamic_context_parallel_size``), doubled while the sequence alone would outlast the
   average rank's share of the batch and doubling makes it faster; sequences of one size form a class;
2. classes are put into micro-batches largest size first, as many as fit the ranks one group each
   (every class that fits the world shares one micro-batch; a class of the whole world runs alone);
3. in a micro-batch, groups are apportioned to its classes by their work: the fewest groups per
   class that hold it at a target load per rank (largest class first, counting the room bigger
   groups have spare for smaller sequences), at the smallest target whose groups fit the ranks;
   laid out largest first (so they are aligned);
4. longest processing time first: each sequence (by decreasing cost) goes to the group, among
   those at least its smallest size, where it would finish first (a bigger group runs it faster;
   the cost model decides whether that pays); as sequences are whole, the apportionment is then
   refined a few times (the slowest group's class weighed up) and the best fill kept; finally each
   group's sequences are packed first-fit.

Cost per step: sorting plus ``O(n log R)`` heap operations; 4096 sequences on 1024 ranks take
milliseconds (docs/dynamic_cp.md).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ..core.layout import padded_length
from .workload import Workload


@dataclass
class Group:
    """One CP group of one micro-batch: ranks ``first .. first + size - 1``, its sequences and their
    packs (each pack one forward/backward, at most the budget of padded tokens per rank)."""

    size: int
    first: int
    sequences: list[int] = field(default_factory=list)
    packs: list[list[int]] = field(default_factory=list)
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

    @property
    def time(self) -> float:
        """Estimated time: the slowest group's cost."""
        return max(g.cost for g in self.groups)


@dataclass
class Schedule:
    micro_batches: list[MicroBatch]
    cp_sizes: list[int]
    """The CP size each sequence runs at (its group's size; at least its smallest fitting size)."""

    def for_rank(self, rank: int) -> list[Group]:
        """This rank's group in every micro-batch (the same count on every rank)."""
        return [mb.group_of(rank) for mb in self.micro_batches]

    @property
    def makespan(self) -> float:
        """Sum over micro-batches of the slowest group's cost."""
        return sum(mb.time for mb in self.micro_batches)


def cp_size_for(seq_len: int, budget: int, min_size: int, num_ranks: int) -> int:
    """Smallest power of two >= ``min_size`` whose per-rank padded share fits ``budget``.

    Raises:
        ValueError: the sequence does not fit even on the largest power-of-two block of ranks.
    """
    size = min_size
    largest = 1 << (num_ranks.bit_length() - 1)
    while padded_length(seq_len, size) // size > budget:
        size *= 2
        if size > largest:
            raise ValueError(
                f"a sequence of {seq_len} tokens does not fit: max_seqlen_per_dp_cp_rank={budget} on at most "
                f"{largest} ranks holds {largest * budget} tokens (with padding to 2*cp)"
            )
    return size


def _widen(sizes: list[int], lengths: list[int], num_ranks: int, largest: int, workload) -> list[int]:
    """A sequence that alone would take longer than the average rank's share of the batch (the lower
    bound) gets the next larger size (up to ``largest``) while that makes it faster: no rank waits on
    one long sequence."""
    share = sum(workload.cost(n, c) * c for n, c in zip(lengths, sizes, strict=True)) / num_ranks
    widened = []
    for n, size in zip(lengths, sizes, strict=True):
        while size < largest and workload.cost(n, size) > share and workload.cost(n, 2 * size) < workload.cost(n, size):
            size *= 2
        widened.append(size)
    return widened


def _class_batches(sizes: list[int], num_ranks: int) -> list[list[int]]:
    """Classes (smallest sizes) into micro-batches, largest first, as many per batch as fit one group each."""
    batches, used = [], num_ranks + 1
    for size in sorted(sizes, reverse=True):
        if used + size > num_ranks:
            batches.append([])
            used = 0
        batches[-1].append(size)
        used += size
    return batches


def _group_counts(classes: list[int], work: dict[int, float], target: float) -> dict[int, int]:
    """Fewest groups per class that hold its work at ``target`` per rank, largest class first, less the
    room bigger groups have spare (smaller sequences may run in bigger groups, never the reverse)."""
    counts, spare = {}, 0.0
    for c in sorted(classes, reverse=True):
        need = work[c] - spare
        count = math.ceil(need / (c * target) - 1e-9) if need > 1e-12 * work[c] else 0
        counts[c] = max(count, 1 if not counts else 0)
        spare += counts[c] * c * target - work[c]
    return counts


def _apportion(classes: list[int], work: dict[int, float], num_ranks: int) -> list[int]:
    """Group sizes of one micro-batch, largest first (so they are aligned when laid out in order): the
    counts of :func:`_group_counts` at the smallest target load whose groups fit the ranks (bisection
    between ``work / ranks`` and the largest ``work / size`` of a class, where one group per class
    fits); ranks left over become groups of the largest size that fits."""
    def ranks_needed(target):
        return sum(c * n for c, n in _group_counts(classes, work, target).items())

    low, high = sum(work[c] for c in classes) / num_ranks, max(work[c] / c for c in classes)
    if ranks_needed(low) > num_ranks:
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (low, middle) if ranks_needed(middle) <= num_ranks else (middle, high)
        low = high
    sizes = [c for c, n in _group_counts(classes, work, low).items() for _ in range(n)]
    free, size = num_ranks - sum(sizes), max(classes)
    while free:
        while size > free:
            size //= 2
        sizes.append(size)
        free -= size
    return sorted(sizes, reverse=True)


def _pack(group: Group, lengths: list[int], budget: int) -> None:
    """First-fit decreasing of the group's sequences into packs of at most ``budget`` tokens per rank."""
    room: list[int] = []
    for i in sorted(group.sequences, key=lambda i: -lengths[i]):
        tokens = padded_length(lengths[i], group.size) // group.size
        for p, left in enumerate(room):
            if tokens <= left:
                group.packs[p].append(i)
                room[p] -= tokens
                break
        else:
            group.packs.append([i])
            room.append(budget - tokens)


def _fill(order: list[int], min_sizes: list[int], lengths: list[int], group_sizes: list[int],
          workload) -> tuple[MicroBatch, dict[int, int]]:
    """LPT over the groups of one micro-batch (see module doc, step 4)."""
    groups, heaps, first = [], {}, 0
    for size in group_sizes:
        groups.append(Group(size, first))
        heaps.setdefault(size, []).append((0.0, len(groups) - 1))
        first += size
    sizes = sorted(heaps)
    placed = {}
    for i in order:
        best = None
        for size in sizes:
            if size < min_sizes[i]:
                continue
            load, index = heaps[size][0]
            finish = load + workload.cost(lengths[i], size)
            if best is None or finish < best[0]:
                best = (finish, size, index)
        finish, size, index = best
        heapq.heapreplace(heaps[size], (finish, index))
        groups[index].sequences.append(i)
        groups[index].cost = finish
        placed[i] = size
    return MicroBatch(groups), placed


REFINE_STEPS = 8
"""Apportionments tried per micro-batch: each next one weighs the class of the slowest group 10% more."""
REFINE_TOLERANCE = 0.01
"""Refining stops once the slowest group is within this of the micro-batch's lower bound."""


def _balanced_fill(order, classes, work, min_sizes, lengths, num_ranks, workload):
    """LPT over the apportioned groups; the fluid apportionment ignores that sequences are whole, so
    while the slowest group's class can take more groups, weigh it up and keep the best fill."""
    weights, best = dict(work), None
    bound = sum(work[c] for c in classes) / num_ranks  # every rank equally busy
    for _ in range(REFINE_STEPS if len(classes) > 1 else 1):
        micro_batch, placed = _fill(order, min_sizes, lengths, _apportion(classes, weights, num_ranks), workload)
        if best is None or micro_batch.time < best[0].time:
            best = (micro_batch, placed)
        if best[0].time <= (1 + REFINE_TOLERANCE) * bound:
            break
        slowest = max(micro_batch.groups, key=lambda g: g.cost).size
        if slowest not in weights:
            break
        weights[slowest] *= 1.1
    return best


def schedule_sequences(lengths: list[int], num_ranks: int, max_seqlen_per_dp_cp_rank: int,
                       min_dynamic_context_parallel_size: int = 1, workload: Workload | None = None,
                       max_dynamic_context_parallel_size: int | None = None) -> Schedule:
    """Schedule one global batch (module doc).

    Args:
        lengths: tokens of each sequence (>= 1).
        num_ranks: DP x CP ranks (>= 1).
        max_seqlen_per_dp_cp_rank: padded tokens of one rank in one pack (the memory budget).
        min_dynamic_context_parallel_size: smallest CP group size (a power of two).
        workload: ``cost(seq_len, cp)`` of one sequence on one rank of a group of ``cp`` (default
            :class:`Workload`, ``L^2 / cp``; :class:`~.cost_model.CostModel` for a measured GPU).
        max_dynamic_context_parallel_size: largest CP group size (default: the largest power of two
            <= ``num_ranks``); equal to the minimum and to what the longest sequence needs, every
            sequence runs at that one size: static CP.

    Raises:
        ValueError: a bad argument, or a sequence that cannot fit even on all ranks.
    """
    min_size, budget = min_dynamic_context_parallel_size, max_seqlen_per_dp_cp_rank
    if num_ranks < 1 or budget < 1 or min_size < 1 or min_size & (min_size - 1):
        raise ValueError(f"num_ranks={num_ranks}, max_seqlen_per_dp_cp_rank={budget} must be "
                         f">= 1 and min_dynamic_context_parallel_size={min_size} a power of two")
    if min_size > num_ranks:
        raise ValueError(f"min_dynamic_context_parallel_size={min_size} exceeds the {num_ranks} ranks")
    largest = max_dynamic_context_parallel_size or 1 << (num_ranks.bit_length() - 1)
    if largest < min_size or largest & (largest - 1) or largest > num_ranks:
        raise ValueError(f"max_dynamic_context_parallel_size={largest} must be a power of two between "
                         f"min_dynamic_context_parallel_size={min_size} and the {num_ranks} ranks")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence length must be >= 1")
    workload = workload or Workload()
    min_sizes = [cp_size_for(n, budget, min_size, largest) for n in lengths]
    min_sizes = _widen(min_sizes, lengths, num_ranks, largest, workload)
    costs = [workload.cost(n, c) for n, c in zip(lengths, min_sizes, strict=True)]
    by_class: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-costs[i], i)):
        by_class.setdefault(min_sizes[i], []).append(i)
    work = {c: sum(costs[i] for i in members) * c for c, members in by_class.items()}
    micro_batches, cp_sizes = [], list(min_sizes)
    for classes in _class_batches(list(by_class), num_ranks):
        order = sorted((i for c in classes for i in by_class[c]), key=lambda i: (-costs[i], i))
        micro_batch, placed = _balanced_fill(order, classes, work, min_sizes, lengths, num_ranks, workload)
        for i, size in placed.items():
            cp_sizes[i] = size
        for group in micro_batch.groups:
            _pack(group, lengths, budget)
        micro_batches.append(micro_batch)
    if not micro_batches:  # an empty batch: one micro-batch of empty groups
        micro_batches.append(MicroBatch([Group(1, r) for r in range(num_ranks)]))
    return Schedule(micro_batches, cp_sizes)
