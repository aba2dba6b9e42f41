"""What a dynamic CP schedule may use and the best it can do: the group sizes (:func:`group_sizes`), the smallest that
fits a sequence (:func:`cp_size_for`), every sequence's cost at every size (:func:`cost_matrix`), and the lower bound
on the makespan that counts compute and transfer through that cost (:func:`makespan_bound`), from which
:func:`~.scheduler.schedule_sequences` takes each sequence's size.
"""

from __future__ import annotations

import math

import torch

from ..core.layout import padded_length

SIZE_RULES = ("divisors_and_powers_of_two", "divisors", "powers_of_two")
"""The group sizes a schedule may use (:func:`group_sizes`; the first is the default)."""


def group_sizes(num_ranks: int, min_size: int = 1, max_size: int | None = None,
                rule: str = "divisors_and_powers_of_two") -> list[int]:
    """The group sizes a schedule of ``num_ranks`` may use, ascending: ``"divisors"``, every size that divides
    ``num_ranks`` (12 ranks: 1, 2, 3, 4, 6, 12); ``"powers_of_two"``, 1, 2, 4, ... up to ``num_ranks`` (12 ranks: 1,
    2, 4, 8; a group of 8 leaves 4 ranks to smaller groups), as Megatron-LM's dynamic CP; the default, both (12 ranks:
    1, 2, 3, 4, 6, 8, 12: a group inside one node of 8 GPUs, or over all 12). ``min_size`` and ``max_size`` (default:
    the largest) must be among them.

    Raises:
        ValueError: ``num_ranks`` < 1, an unknown ``rule``, or ``min_size`` / ``max_size`` not among the sizes or
            out of order (the message lists the sizes).
    """
    if rule not in SIZE_RULES:
        raise ValueError(f"group sizes rule {rule!r}: one of {list(SIZE_RULES)}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    divisors = {d for d in range(1, num_ranks + 1) if num_ranks % d == 0} if rule != "powers_of_two" else set()
    powers = {1 << k for k in range(num_ranks.bit_length())} if rule != "divisors" else set()
    every = sorted(divisors | powers)
    largest = every[-1] if max_size is None else max_size
    what = {"divisors": "divisors of", "powers_of_two": "powers of two up to"}.get(
        rule, "divisors of and powers of two up to")
    for name, value in (("min_dynamic_context_parallel_size", min_size),
                        ("max_dynamic_context_parallel_size", largest)):
        if value not in every:
            raise ValueError(f"{name}={value} must be one of the group sizes {every} ({what} the {num_ranks} ranks)")
    if largest < min_size:
        raise ValueError(f"max_dynamic_context_parallel_size={largest} must be >= "
                         f"min_dynamic_context_parallel_size={min_size}")
    return [c for c in every if min_size <= c <= largest]


def cp_size_for(seq_len: int, budget: int, sizes: list[int]) -> int:
    """The smallest of ``sizes`` (ascending) whose per-rank padded share of the sequence fits ``budget``.

    Raises:
        ValueError: the sequence does not fit even on the largest size.
    """
    for size in sizes:
        if padded_length(seq_len, size) // size <= budget:
            return size
    raise ValueError(f"a sequence of {seq_len} tokens does not fit: max_seqlen_per_dp_cp_rank={budget} on at most "
                     f"{sizes[-1]} ranks holds {sizes[-1] * budget} tokens (with padding to 2*cp)")


def cost_matrix(workload, lengths: list[int], sizes: list[int]) -> torch.Tensor:
    """``(len(lengths), len(sizes))`` float64: ``workload.cost(n, c)`` of every sequence at every size, in one
    vectorised call where the workload has ``costs(lengths, sizes)`` (:class:`Workload`, :class:`~.cost_model.
    CostModel`, :class:`~cp_handler.auto.workload.PatternWorkload`), else one call per pair."""
    if hasattr(workload, "costs"):
        return workload.costs(lengths, sizes)
    return torch.tensor([[workload.cost(n, c) for c in sizes] for n in lengths], dtype=torch.float64)


def makespan_bound(costs: torch.Tensor, sizes: list[int], smallest, num_ranks: int) -> tuple[float, torch.Tensor]:
    """The lower bound on any schedule's makespan, and the size index each sequence takes at it.

    ``T`` is feasible when every sequence ``i`` has a size ``j >= smallest[i]`` with ``costs[i, j] <= T``, and the
    least rank-time ``sizes[j] * costs[i, j]`` of each sequence among those sizes, summed, is at most
    ``num_ranks * T``. Any schedule's makespan ``M`` is feasible (each sequence ran at one size within ``M``; the ranks
    were busy at most ``num_ranks * M``), so the smallest feasible ``T`` (bisection, relative 1e-9) bounds it
    below; the sizes returned are each sequence's least rank-time size within it (ties: the smaller size).

    Args:
        costs: :func:`cost_matrix`. sizes: the allowed sizes, ascending. smallest: ``n`` ints (a list or an int64
            tensor), each sequence's smallest size index that fits the budget.
    """
    n, m = costs.shape
    if n == 0:
        return 0.0, torch.zeros(0, dtype=torch.long)
    allowed = torch.arange(m)[None, :] >= torch.as_tensor(smallest, dtype=torch.long)[:, None]
    costs = costs.masked_fill(~allowed, math.inf)
    area = costs * torch.tensor(sizes, dtype=torch.float64)[None, :]

    def load(t: float) -> tuple[float, torch.Tensor]:
        within = area.masked_fill(costs > t, math.inf)
        best, index = within.min(dim=1)  # min keeps the first of equal values: the smaller size
        return best.sum().item(), index

    low = costs.min(dim=1).values.max().item()  # the slowest sequence at its fastest size
    least, index = area.min(dim=1)  # every sequence at its least rank-time size: feasible from here up
    high = max(low, costs.gather(1, index[:, None]).max().item(), least.sum().item() / num_ranks)
    if load(low)[0] <= num_ranks * low:
        high = low
    while high - low > 1e-9 * high:
        middle = (low + high) / 2
        if load(middle)[0] <= num_ranks * middle:
            high = middle
        else:
            low = middle
    return high, load(high)[1]
