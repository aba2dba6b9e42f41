"""Group pool for dynamic CP: the process group of every ``(size, first rank)`` a schedule uses, built the first
time a schedule needs it and kept for the run.

A schedule's groups are contiguous blocks of ranks of any allowed size (:func:`~.scheduler.group_sizes`), not
only aligned powers of two, so the pool builds them as schedules ask (``dist.new_group`` over the block). Group
creation is collective over the world: every rank computes the same schedule from the same lengths and calls
:meth:`GroupPool.prepare` with it, so every rank creates the same new groups in the same order. At most
``sum over sizes c of (world - c + 1)`` groups exist (7 at 4 ranks with sizes 2 and 4); size 1 needs none (a cp=1
handler).
"""

from __future__ import annotations

import torch.distributed as dist


class GroupPool:
    def __init__(self):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.groups: dict[tuple[int, int], dist.ProcessGroup] = {}

    def prepare(self, schedule) -> None:
        """Build the groups of ``schedule`` (:meth:`~.scheduler.Schedule.groups`) not built yet: on every rank, with
        the same schedule (collective)."""
        for size, first in schedule.groups():
            if (size, first) not in self.groups:
                self.groups[(size, first)] = dist.new_group(list(range(first, first + size)))

    def group(self, size: int, first: int) -> dist.ProcessGroup | None:
        """This rank's group of ``size`` starting at rank ``first`` (``None`` for size 1).

        Raises:
            KeyError: this rank is not in that block, or no schedule prepared it (:meth:`prepare`).
        """
        if not first <= self.rank < first + size:
            raise KeyError(f"rank {self.rank} is not in the group of {size} ranks from rank {first}")
        if size == 1:
            return None
        if (size, first) not in self.groups:
            raise KeyError(f"no group of {size} ranks from rank {first}: GroupPool.prepare(schedule) builds a "
                           "schedule's groups, on every rank")
        return self.groups[(size, first)]
