"""Process groups for CP training, built with ``torch.distributed.device_mesh``.

Rank order follows Megatron-LM: CP is the inner (faster-varying) dimension, DP the outer one, so
the ranks of one CP group are adjacent (on one node, when they fit).
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .config import check_hierarchical_sizes
from .parallel_layout import ParallelGroups, ParallelLayout

logger = logging.getLogger("cp_handler")


@dataclass
class DataContextParallelGroups:
    """The ``(dp, cp)`` mesh of a run and its groups."""

    mesh: DeviceMesh
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    hierarchical_cp_groups: list[dist.ProcessGroup] = field(default_factory=list)
    """This rank's group at each hierarchical CP level, inner (adjacent ranks) first; empty if flat."""

    @property
    def cp_size(self) -> int:
        return self.mesh["cp"].size()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()


def check_world_divisible(world_size: int, context_parallel_size: int) -> None:
    """Raises ValueError unless ``world_size`` is a multiple of ``context_parallel_size``."""
    if world_size % context_parallel_size:
        raise ValueError(
            f"world size {world_size} is not a multiple of context_parallel_size={context_parallel_size}: "
            "ranks are laid out as data-parallel replicas of whole CP groups"
        )


def hierarchical_level_ranks(world_size: int, sizes: list[int]) -> list[list[list[int]]]:
    """For each level (inner first), the rank lists of its groups, with CP levels laid out inside
    data-parallel replicas: level 0 varies fastest (adjacent ranks), the last level slowest.

    Pure arithmetic (no processes), for logs and tests; the groups are built by DeviceMesh.
    """
    check_world_divisible(world_size, math.prod(sizes))
    levels = []
    for level, size in enumerate(sizes):
        stride = math.prod(sizes[:level])
        groups = []
        for base in range(world_size):
            if (base // stride) % size == 0:
                groups.append([base + i * stride for i in range(size)])
        levels.append(sorted(groups))
    return levels


def build_dp_cp_groups(
    context_parallel_size: int,
    device_type: str = "cpu",
    hierarchical_context_parallel_sizes: list[int] | None = None,
) -> DataContextParallelGroups:
    """Split the default group's ranks into ``world / cp`` data-parallel replicas of CP groups,
    and, with ``hierarchical_context_parallel_sizes`` (any number of levels, inner first, product
    = cp), the groups of each level; rank 0 logs them as ``HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``.
    The ``tp = pp = ep = 1`` case of :class:`~cp_handler.runtime.parallel_layout.ParallelLayout`.

    Needs an initialised default process group; every rank must call it.

    Raises:
        ValueError: world size not a multiple of ``context_parallel_size``, or level sizes whose
            product is not ``context_parallel_size`` (before any collective).
    """
    world = dist.get_world_size()
    check_world_divisible(world, context_parallel_size)
    sizes = hierarchical_context_parallel_sizes
    if sizes is not None:
        check_hierarchical_sizes(sizes, context_parallel_size)
    built = ParallelLayout(world, context_parallel_size=context_parallel_size,
                           hierarchical_context_parallel_sizes=sizes).build(device_type)
    return data_context_parallel_groups(built)


def data_context_parallel_groups(built: ParallelGroups) -> DataContextParallelGroups:
    """The dp x cp view of a :meth:`ParallelLayout.build` (tp = pp = 1); rank 0 logs the
    hierarchical CP levels as ``HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``."""
    sizes = built.layout.hierarchical_context_parallel_sizes
    if sizes is not None and dist.get_rank() == 0:
        levels = hierarchical_level_ranks(built.layout.world_size, list(sizes))
        described = "; ".join(f"level {i} (size {sizes[i]}): {ranks}" for i, ranks in enumerate(levels))
        logger.info("HIERARCHICAL_CONTEXT_PARALLEL_GROUPS %s", described)
    return DataContextParallelGroups(built.meshes["attention"], built.groups["cp"], built.groups["dp"],
                                     built.hierarchical_cp_groups)


def destroy_process_groups() -> None:
    """End a distributed run: ``torch.distributed.destroy_process_group()``, then free the groups.

    ``destroy_process_group`` drops torch's own references, but a ``DeviceMesh`` and the mesh it was
    unflattened from refer to each other, so the groups built through one (every
    :class:`ParallelLayout` build) stay alive, with their gloo worker threads, until the garbage
    collector runs. Left to interpreter shutdown, a worker thread that is still releasing the last
    reference to a Python tensor of a finished collective takes the GIL while Python finalises,
    and the process aborts ("terminate called without an active exception", seen ~1 run in 30 of a
    dp=2 x cp=2 evaluation). Collecting here runs the groups' destructors, which join those threads
    with the GIL released, while the interpreter is alive. Call it where you would call
    ``destroy_process_group()``; nothing of ``torch.distributed`` may be used afterwards.
    """
    dist.destroy_process_group()
    gc.collect()
