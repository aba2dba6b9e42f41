"""Dynamic CP scheduler: sequences of a global batch -> micro-batches of CP groups, each sequence's group size
and pattern chosen from one cost model.

Pure Python and torch on the CPU (no process groups), so it is unit-testable and fast. The shape of a schedule:

* a **micro-batch** splits the ``R`` ranks into disjoint groups of contiguous ranks, of the allowed sizes
  (:func:`group_sizes`: by default every size that divides ``R`` and every power of two up to it; ``"powers_of_two"``
  alone as Megatron-LM's dynamic CP builds them); every rank has a group in every micro-batch (possibly empty), and
  all ranks see the same number of micro-batches;
* a **group** runs its sequences at its size, as one or more **packs** one after another (thd batches of at most
  ``max_seqlen_per_dp_cp_rank`` padded tokens per rank: the memory budget); packs only communicate inside their
  group, so groups of one micro-batch run independently and the micro-batch ends when its slowest group does.

Algorithm (balance the cost model's time: :mod:`.workload`, :mod:`.cost_model`, or with ``cp_comm_type="auto"``
:class:`~cp_handler.auto.workload.PatternWorkload`, whose cost at a size is its fastest pattern's, communication
included, and at size 1 the sequence alone on one rank, nothing communicated):

1. the cost of every sequence at every allowed size (:func:`~.bound.cost_matrix`: one vectorised call) and its smallest
   size whose padded share fits the budget (at least ``min_dynamic_context_parallel_size``);
2. the **lower bound** (:func:`~.bound.makespan_bound`): the smallest ``T`` at which every sequence has a size that
   fits, finishes within ``T``, and all of them together occupy at most ``R x T`` rank-milliseconds (each at its size of
   least rank-time among those within ``T``); no schedule is faster. Each sequence takes the size the bound
   gives it (a short one stays on one rank when communication would cost more than splitting saves: local);
   sequences of one size form a class;
3. micro-batches, as several plans, keeping the first within 2% of the bound (else the best): **shelves** (the
   split sequences' classes share micro-batches as below, with their left-over ranks in groups of the smallest
   class; the smallest class's sequences then fill every group's idle time up to its micro-batch's time, longest
   first, and what is left runs after on every rank), **shared** (classes into micro-batches first-fit decreasing,
   as many per micro-batch as fit the ranks one group each), and **alone first** (a class that keeps every rank
   busy within 1% runs in its own micro-batch, the others shared);
4. a shared micro-batch's groups are apportioned to its classes by their work: the fewest groups per class that
   hold it at a target load per rank (largest class first, counting the room bigger groups have spare for smaller
   sequences), at the smallest target, not below its longest sequence's time, whose groups fit the ranks; ranks
   left over become groups of the largest size that fits; laid out largest first;
5. longest processing time first: each sequence (by decreasing cost) goes to the group, among those at least its
   size, where it would finish first (a bigger group runs it faster; the cost model decides whether that pays); as
   sequences are whole, the apportionment is then refined a few times (the slowest group's class weighed up) and
   the best fill kept; finally each group's sequences are packed first-fit.

The pattern of each sequence is the workload's at the sequence's size (:attr:`Schedule.comm_types`, from the
workload's ``comm_types(lengths, sizes)``; ``None`` for a workload that prices one pattern). Cost per step: the
cost matrix, the bound's bisection (vectorised), sorting, and ``O(n log R)`` heap operations per fill: a 1,024-
document batch schedules in milliseconds (docs/dynamic_cp.md). Quality: within 2% of the bound at 1,024 documents
on three length mixes and 6-64 ranks; batches of a few documents per rank are further from it (docs/dynamic_cp.md).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ..core.layout import padded_length
from .bound import SIZE_RULES, cost_matrix, cp_size_for, group_sizes, makespan_bound
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
    comm_types: list[str | None] = field(default_factory=list)
    """The pattern the workload prices each sequence with at its size (``None`` at size 1, or for a workload of one
    pattern)."""
    bound: float = 0.0
    """The lower bound on the makespan (:func:`makespan_bound`)."""

    def for_rank(self, rank: int) -> list[Group]:
        """This rank's group in every micro-batch (the same count on every rank)."""
        return [mb.group_of(rank) for mb in self.micro_batches]

    @property
    def makespan(self) -> float:
        """Sum over micro-batches of the slowest group's cost."""
        return sum(mb.time for mb in self.micro_batches)

    def groups(self) -> list[tuple[int, int]]:
        """Every ``(size, first rank)`` of a group of two or more ranks, in first-use order (the process groups
        :class:`~.groups.GroupPool` must hold for this schedule)."""
        return list(dict.fromkeys((g.size, g.first) for mb in self.micro_batches for g in mb.groups if g.size > 1))


def _class_batches(sizes: list[int], num_ranks: int) -> list[list[int]]:
    """Classes (sizes) into micro-batches, first-fit decreasing: each class into the first micro-batch whose
    classes leave room for one group of it."""
    batches: list[list[int]] = []
    for size in sorted(sizes, reverse=True):
        for batch in batches:
            if sum(batch) + size <= num_ranks:
                batch.append(size)
                break
        else:
            batches.append([size])
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


def _apportion(classes: list[int], work: dict[int, float], num_ranks: int, fillers: list[int],
               floor: float = 0.0) -> list[int]:
    """Group sizes of one micro-batch, largest first: the counts of :func:`_group_counts` at the smallest target
    load whose groups fit the ranks (bisection between ``work / ranks`` and the largest ``work / size`` of a class,
    where one group per class fits; at least ``floor``, the longest sequence's time: no more groups than keep the
    class busy that long); ranks left over become groups of the largest of ``fillers`` (the rule's sizes up to the
    largest allowed, 1 among them) that fits: below the smallest allowed size such a group stays empty."""
    def ranks_needed(target):
        return sum(c * n for c, n in _group_counts(classes, work, target).items())

    low = max(sum(work[c] for c in classes) / num_ranks, floor)
    high = max(low, max(work[c] / c for c in classes))
    if ranks_needed(low) > num_ranks:
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (low, middle) if ranks_needed(middle) <= num_ranks else (middle, high)
        low = high
    out = [c for c, n in _group_counts(classes, work, low).items() for _ in range(n)]
    free = num_ranks - sum(out)
    while free:
        size = max(s for s in fillers if s <= free)
        out.append(size)
        free -= size
    return sorted(out, reverse=True)


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


def _fill(order: list[int], at_least: list[int], costs: list[list[float]], index_of: dict[int, int],
          group_sizes_: list[int]) -> tuple[MicroBatch, dict[int, int]]:
    """LPT over the groups of one micro-batch (see module doc, step 5)."""
    groups, heaps, first = [], {}, 0
    for size in group_sizes_:
        groups.append(Group(size, first))
        heaps.setdefault(size, []).append((0.0, len(groups) - 1))
        first += size
    present = sorted(heaps)
    placed = {}
    for i in order:
        best, row = None, costs[i]
        for size in present:
            if size < at_least[i]:
                continue
            load, index = heaps[size][0]
            finish = load + row[index_of[size]]
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
PLAN_TOLERANCE = 0.02
"""The plans (module doc, step 3) stop at the first within this of the bound."""
REFINE_TOLERANCE = 0.01
"""Refining stops once the slowest group is within this of the micro-batch's lower bound: every rank equally busy,
or its slowest sequence on the largest group it may take there."""


def _balanced_fill(order, classes, work, at_least, costs, index_of, num_ranks, fillers, floor=True):
    """LPT over the apportioned groups; the fluid apportionment ignores that sequences are whole, so
    while the slowest group's class can take more groups, weigh it up and keep the best fill."""
    weights, best = dict(work), None
    top = index_of[max(classes)] + 1
    longest = max(min(costs[i][index_of[at_least[i]]:top]) for i in order)
    bound = max(sum(work[c] for c in classes) / num_ranks, longest)
    for _ in range(REFINE_STEPS if len(classes) > 1 else 1):
        micro_batch, placed = _fill(order, at_least, costs, index_of,
                                    _apportion(classes, weights, num_ranks, fillers, longest if floor else 0.0))
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
                       min_dynamic_context_parallel_size: int = 1, workload=None,
                       max_dynamic_context_parallel_size: int | None = None,
                       sizes_rule: str = SIZE_RULES[0]) -> Schedule:
    """Schedule one global batch (module doc).

    Args:
        lengths: tokens of each sequence (>= 1).
        num_ranks: DP x CP ranks (>= 1).
        max_seqlen_per_dp_cp_rank: padded tokens of one rank in one pack (the memory budget).
        min_dynamic_context_parallel_size: smallest CP group size (one of :func:`group_sizes`).
        workload: ``cost(seq_len, cp)`` of one sequence on one rank of a group of ``cp`` (default
            :class:`Workload`, ``L^2 / cp``; :class:`~.cost_model.CostModel` for a measured GPU;
            :class:`~cp_handler.auto.workload.PatternWorkload` for the pattern too).
        max_dynamic_context_parallel_size: largest CP group size (default: the largest size of the rule,
            ``num_ranks`` unless ``"powers_of_two"``); equal to the minimum and to what the longest sequence needs,
            every sequence runs at that one size: static CP.
        sizes_rule: one of :data:`SIZE_RULES` (:func:`group_sizes`).

    Raises:
        ValueError: a bad argument, or a sequence that cannot fit even on the largest group.
    """
    budget = max_seqlen_per_dp_cp_rank
    if budget < 1:
        raise ValueError(f"max_seqlen_per_dp_cp_rank={budget} must be >= 1")
    sizes = group_sizes(num_ranks, min_dynamic_context_parallel_size, max_dynamic_context_parallel_size, sizes_rule)
    fillers = group_sizes(num_ranks, 1, sizes[-1], sizes_rule)
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence length must be >= 1")
    workload = workload or Workload()
    smallest = [cp_size_for(n, budget, sizes) for n in lengths]
    index_of = {c: j for j, c in enumerate(sizes)}
    matrix = cost_matrix(workload, lengths, sizes)
    bound, chosen = makespan_bound(matrix, sizes, [index_of[c] for c in smallest], num_ranks)
    at_least = [sizes[j] for j in chosen.tolist()]
    costs = matrix.tolist()
    own = [costs[i][index_of[c]] for i, c in enumerate(at_least)]
    by_class: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-own[i], i)):
        by_class.setdefault(at_least[i], []).append(i)
    work = {c: sum(own[i] for i in members) * c for c, members in by_class.items()}

    def plan(alone_first: bool, floor: bool = True) -> list[tuple[MicroBatch, dict[int, int]]]:
        fills, shared = [], []
        for c in sorted(by_class, reverse=True):  # a class that keeps every rank busy alone may run alone
            alone = _fill(by_class[c], at_least, costs, index_of, _apportion([c], work, num_ranks, fillers)) \
                if alone_first else None
            if alone is not None and alone[0].time <= (1 + REFINE_TOLERANCE) * work[c] / num_ranks:
                fills.append(alone)
            else:
                shared.append(c)
        for classes in _class_batches(shared, num_ranks):
            order = sorted((i for c in classes for i in by_class[c]), key=lambda i: (-own[i], i))
            fills.append(_balanced_fill(order, classes, work, at_least, costs, index_of, num_ranks, fillers, floor))
        return fills

    def shelves(floor: bool = True) -> list[tuple[MicroBatch, dict[int, int]]]:
        """The split sequences' micro-batches first (their classes shared, as :func:`plan`), their idle ranks then
        filled with the smallest class up to each micro-batch's time; what is left of it runs alone after."""
        small = min(by_class)
        fills = []
        below = [s for s in fillers if s <= small]  # ranks the split ones leave: groups of the smallest class
        for classes in _class_batches([c for c in by_class if c != small], num_ranks):
            order = sorted((i for c in classes for i in by_class[c]), key=lambda i: (-own[i], i))
            fills.append(_balanced_fill(order, classes, work, at_least, costs, index_of, num_ranks, below, floor))
        rooms = [(group.cost - micro_batch.time, k, g) for k, (micro_batch, _) in enumerate(fills)
                 for g, group in enumerate(micro_batch.groups) if group.size >= small]
        heapq.heapify(rooms)  # the group with the most room under its micro-batch's time first
        left = []
        for i in by_class[small]:  # longest first
            if not rooms:
                left.append(i)
                continue
            minus_room, k, g = rooms[0]
            micro_batch, placed = fills[k]
            group = micro_batch.groups[g]
            cost = costs[i][index_of[group.size]]
            if cost > -minus_room:
                left.append(i)
                continue
            group.sequences.append(i)
            group.cost += cost
            placed[i] = group.size
            heapq.heapreplace(rooms, (minus_room + cost, k, g))
        if left:
            work_left = {small: sum(own[i] for i in left) * small}
            fills.append(_fill(left, at_least, costs, index_of, _apportion([small], work_left, num_ranks, fillers)))
        return fills

    tries = [lambda: plan(False), lambda: plan(True), lambda: plan(False, floor=False)]
    if len(by_class) > 1:
        tries = [shelves, *tries, lambda: shelves(floor=False)]
    def makespan(fills) -> float:
        return sum(micro_batch.time for micro_batch, _ in fills)

    fills = None
    for attempt in tries:  # the first plan within the tolerance of the bound, else the best
        candidate = attempt()
        if fills is None or makespan(candidate) < makespan(fills):
            fills = candidate
        if makespan(fills) <= (1 + PLAN_TOLERANCE) * bound:
            break
    micro_batches, cp_sizes = [], list(at_least)
    for micro_batch, placed in fills:
        for i, size in placed.items():
            cp_sizes[i] = size
        for group in micro_batch.groups:
            _pack(group, lengths, budget)
        micro_batches.append(micro_batch)
    if not micro_batches:  # an empty batch: one micro-batch of empty groups
        micro_batches.append(MicroBatch([Group(1, r) for r in range(num_ranks)]))
    picks = workload.comm_types(lengths, cp_sizes) if hasattr(workload, "comm_types") else [None] * len(lengths)
    comm_types = [pick if c > 1 else None for pick, c in zip(picks, cp_sizes, strict=True)]
    return Schedule(micro_batches, cp_sizes, comm_types, bound)
