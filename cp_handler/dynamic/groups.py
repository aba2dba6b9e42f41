"""Group pool for dynamic CP: every aligned power-of-two group over the DP x CP ranks, built once.

For each size ``g`` (2, 4, ... up to the largest power of two <= world) the aligned blocks
``[k*g, (k+1)*g)`` are the rows of a ``(world / g, g)`` DeviceMesh; where ``g`` does not divide the
world size, the aligned blocks that fit are made with ``new_group``. Size 1 needs no group (a
cp=1 handler). Every rank must build the pool (group creation is collective); each rank keeps
its own groups, looked up by ``(size, first rank)``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


class GroupPool:
    def __init__(self, device_type: str = "cpu"):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.groups: dict[int, dist.ProcessGroup] = {}
        size = 2
        while size <= self.world:
            if self.world % size == 0:
                mesh = init_device_mesh(device_type, (self.world // size, size), mesh_dim_names=("block", "cp"))
                self.groups[size] = mesh.get_group("cp")
            else:
                for first in range(0, self.world - size + 1, size):
                    group = dist.new_group(list(range(first, first + size)))
                    if first <= self.rank < first + size:
                        self.groups[size] = group
            size *= 2

    def group(self, size: int, first: int) -> dist.ProcessGroup | None:
        """This rank's group of ``size`` starting at rank ``first`` (``None`` for size 1).

        Raises:
            KeyError: this rank is not in that block, or no such aligned group exists.
        """
        if not first <= self.rank < first + size or first % size:
            raise KeyError(f"rank {self.rank} is not in the aligned group (size={size}, first={first})")
        if size == 1:
            return None
        return self.groups[size]
