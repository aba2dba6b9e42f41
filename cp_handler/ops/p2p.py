"""Point-to-point exchange on a CP group, addressed by rank *within the group*.

A thin layer over ``torch.distributed.batch_isend_irecv``: every call posts all its sends and
receives at once (so neighbours never deadlock on ordering) and returns a handle to wait on.
Tags keep concurrent streams apart (e.g. K/V and dK/dV in the backward ring) on backends that
match messages by tag (gloo); NCCL orders them by stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import batch_isend_irecv


@dataclass
class PendingRecv:
    """Receives in flight: :meth:`wait` completes every op and returns the received tensors."""

    works: list
    buffers: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.buffers


def exchange(
    group: dist.ProcessGroup,
    sends: list[tuple[torch.Tensor, int, int]],
    recvs: list[tuple[torch.Tensor, int, int]],
) -> PendingRecv:
    """Start sending ``(tensor, group_rank, tag)`` and receiving into ``(buffer, group_rank, tag)``."""
    ops, buffers = [], []  # loops, not comprehensions: each of those is a Python call (the hot path)
    for t, p, tag in sends:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, p), group, tag))
    for b, p, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, b, dist.get_global_rank(group, p), group, tag))
        buffers.append(b)
    return PendingRecv(batch_isend_irecv(ops), buffers)


class RingComm:
    """Send to the next rank of the group and receive from the previous one (a ring)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.next_rank = (self.rank + 1) % self.size
        self.prev_rank = (self.rank - 1) % self.size

    def send_recv(self, tensor: torch.Tensor, tag: int = 0) -> PendingRecv:
        """Start passing ``tensor`` one step along the ring; ``wait()[0]`` is the one received.

        K and V go stacked in one tensor (one message per peer and step).
        """
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)  # recv writes densely
        return exchange(self.group, [(tensor, self.next_rank, tag)], [(buffer, self.prev_rank, tag)])
