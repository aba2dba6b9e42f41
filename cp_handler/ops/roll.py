"""``torch.roll`` in global token order for zigzag-sharded tensors, with point-to-point exchange.

Semantics (Megatron-LM ``roll_tensor``): ``y[i] = x[i - shift]`` in global order, and the
``|shift|`` positions that would wrap around the sequence end are zero. With the zigzag layout
each local chunk needs ``|shift|`` tokens of its global neighbour chunk, which lives on this rank
or one other; only those boundary slices travel, only inside the CP group.
The map is linear and its adjoint is the roll by ``-shift``, which is the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import zigzag_chunk_ids, zigzag_chunk_owner
from .p2p import exchange


def _boundary(chunk: torch.Tensor, shift: int) -> torch.Tensor:
    """The slice of ``chunk`` (seq on dim 0) that its neighbour needs."""
    k = abs(shift)
    return chunk[:k] if shift < 0 else chunk[-k:]


def _roll_chunk(chunk: torch.Tensor, incoming: torch.Tensor, shift: int) -> torch.Tensor:
    k = abs(shift)
    return torch.cat([chunk[k:], incoming]) if shift < 0 else torch.cat([incoming, chunk[:-k]])


def zigzag_roll_local(x: torch.Tensor, shift: int, seq_dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Non-differentiable roll of the local zigzag shard ``x``; ``0 < |shift| <= chunk length``."""
    front = x.movedim(seq_dim, 0)
    if group is None or dist.get_world_size(group) == 1:
        return _roll_chunk(front, torch.zeros_like(_boundary(front, shift)), shift).movedim(0, seq_dim)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    step = -1 if shift > 0 else 1  # offset of the neighbour chunk whose tokens flow into a chunk
    halves = front.chunk(2)
    incoming, sends, recvs = [], [], []
    for half, chunk_id in enumerate(zigzag_chunk_ids(rank, cp)):
        incoming.append(_incoming(halves, chunk_id + step, cp, rank, shift, recvs, tag=chunk_id))
        consumer = chunk_id - step
        if 0 <= consumer < 2 * cp and zigzag_chunk_owner(consumer, cp)[0] != rank:
            sends.append((_boundary(halves[half], shift), zigzag_chunk_owner(consumer, cp)[0], consumer))
    exchange(group, sends, recvs).wait()
    rolled = [_roll_chunk(h, inc, shift) for h, inc in zip(halves, incoming, strict=True)]
    return torch.cat(rolled).movedim(0, seq_dim)


def _incoming(halves, source: int, cp: int, rank: int, shift: int, recvs: list, tag: int) -> torch.Tensor:
    """Boundary tokens of global chunk ``source`` for a chunk of this rank: zeros past the sequence
    ends, a local slice, or a buffer registered in ``recvs`` to receive from the owner."""
    like = _boundary(halves[0], shift)
    if not 0 <= source < 2 * cp:
        return torch.zeros_like(like)
    owner, owner_half = zigzag_chunk_owner(source, cp)
    if owner == rank:
        return _boundary(halves[owner_half], shift)
    buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
    recvs.append((buffer, owner, tag))
    return buffer


class _Roll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, seq_dim, group):
        ctx.shift, ctx.seq_dim, ctx.group = shift, seq_dim, group
        return zigzag_roll_local(x, shift, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return zigzag_roll_local(grad, -ctx.shift, ctx.seq_dim, ctx.group), None, None, None


def zigzag_roll(x: torch.Tensor, shift: int, seq_dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable global roll of a zigzag shard (see module doc). ``group=None`` means cp=1."""
    if shift == 0:
        return x
    chunk_len = x.shape[seq_dim] // (2 if group is not None and dist.get_world_size(group) > 1 else 1)
    if abs(shift) > chunk_len:
        raise ValueError(
            f"roll_tensor shifts={shift}: |shifts| must be <= the zigzag chunk length {chunk_len} "
            "(seq_len / (2 * cp))"
        )
    return _Roll.apply(x, shift, seq_dim, group)
