"""Process groups for CP training, built with ``torch.distributed.device_mesh``.

Rank order follows Megatron-LM: CP is the inner (faster-varying) dimension, DP the outer one, so
the ranks of one CP group are adjacent (on one node, when they fit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DataContextParallelGroups:
    """The ``(dp, cp)`` mesh of a run and its groups."""

    mesh: DeviceMesh
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup

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


def build_dp_cp_groups(context_parallel_size: int, device_type: str = "cpu") -> DataContextParallelGroups:
    """Split the default group's ranks into ``world / cp`` data-parallel replicas of CP groups.

    Needs an initialised default process group.

    Raises:
        ValueError: world size not a multiple of ``context_parallel_size`` (before any collective).
    """
    world = dist.get_world_size()
    check_world_divisible(world, context_parallel_size)
    mesh = init_device_mesh(
        device_type, (world // context_parallel_size, context_parallel_size), mesh_dim_names=("dp", "cp")
    )
    return DataContextParallelGroups(mesh, mesh.get_group("cp"), mesh.get_group("dp"))
