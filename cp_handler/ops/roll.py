"""``torch.roll`` in global token order for zigzag-sharded documents, with point-to-point exchange.

Semantics (Megatron-LM ``roll_tensor``, per document for thd): ``y[p] = x[p - shift]`` inside each
document, and zero where ``p - shift`` falls outside the document's real tokens (so the last token
of a document gets zero for ``shift = -1``) and at padding slots. With the zigzag layout each local
chunk needs ``|shift|`` tokens of its neighbour chunk in the same document, which lives on this
rank or one other; only those boundary slices travel, batched over documents, inside the CP group.
The map is linear and its adjoint is the roll by ``-shift`` with the same rule: that is the backward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs, zigzag_chunk_ids
from .p2p import exchange


def _chunk_ids(layout: ZigzagDocs, rank: int) -> tuple[int, ...]:
    return zigzag_chunk_ids(rank, layout.size) if layout.size > 1 else (0,)


def _docs(layout: ZigzagDocs) -> list[int]:
    """The documents with rows (a zero-length document has none, sends and receives nothing)."""
    return [i for i in range(layout.num_docs) if layout.chunk(i)]


def _boundary_rows(layout: ZigzagDocs, half: int, shift: int) -> torch.Tensor:
    """Local rows of ``half``'s chunk that its neighbour needs: head (shift < 0) or tail, per document."""
    k, parts = abs(shift), []
    for i in _docs(layout):
        start = layout.local_offsets[i] + half * layout.chunk(i)
        parts.append(torch.arange(start, start + k) if shift < 0 else torch.arange(start + layout.chunk(i) - k,
                                                                                  start + layout.chunk(i)))
    return torch.cat(parts)


@functools.lru_cache(maxsize=64)
def roll_plan(layout: ZigzagDocs, rank: int, shift: int):
    """Index of every output row into ``cat([local, incoming_half0, incoming_half1, zero_row])``,
    plus ``(half, peer, tag)`` of what to send and receive. ``|shift| <= min chunk`` (checked by caller)."""
    k, ids, docs = abs(shift), _chunk_ids(layout, rank), _docs(layout)
    n_docs = len(docs)
    step = 1 if shift < 0 else -1  # a chunk's tokens come from chunk (id + step)
    local, zero = layout.local_len, layout.local_len + len(ids) * n_docs * k
    index, sends, recvs = [], [], []
    for half, chunk_id in enumerate(ids):
        for nb, target in ((chunk_id + step, recvs), (chunk_id - step, sends)):
            if layout.size > 1 and 0 <= nb < 2 * layout.size:
                owner, owner_half = (nb, 0) if nb < layout.size else (2 * layout.size - 1 - nb, 1)
                target.append((half, owner, owner_half, chunk_id if target is recvs else nb))
    for j, i in enumerate(docs):
        c, off = layout.chunk(i), layout.local_offsets[i]
        for half, chunk_id in enumerate(ids):
            target = torch.arange(chunk_id * c, (chunk_id + 1) * c)  # document positions of these rows
            source = target - shift
            valid = (target < layout.lengths[i]) & (source >= 0) & (source < layout.lengths[i])
            same = torch.div(source, c, rounding_mode="floor") == chunk_id
            in_chunk = source - chunk_id * c
            neighbour = in_chunk - c if shift < 0 else in_chunk + k
            rows = torch.where(same, off + half * c + in_chunk, local + (half * n_docs + j) * k + neighbour)
            index.append(torch.where(valid, rows, zero))
    return torch.cat(index), sends, recvs


def _incoming(front, layout, rank, shift, recvs):
    """Boundary slices for each half: received, copied from this rank's other half, or zeros."""
    k, n_docs = abs(shift), len(_docs(layout))
    halves = [front.new_zeros((n_docs * k, *front.shape[1:])) for _ in _chunk_ids(layout, rank)]
    posted = []
    for half, owner, owner_half, tag in recvs:
        if owner == rank:
            halves[half] = front.index_select(0, _boundary_rows(layout, owner_half, shift).to(front.device))
        else:
            posted.append((halves[half], owner, tag))
    return halves, posted


def zigzag_roll_local(x: torch.Tensor, shift: int, seq_dim: int, group, layout: ZigzagDocs) -> torch.Tensor:
    """Non-differentiable roll of the local zigzag shard ``x`` (see module doc)."""
    rank = 0 if layout.size == 1 else dist.get_rank(group)
    front = x.movedim(seq_dim, 0)
    index, sends, recvs = roll_plan(layout, rank, shift)
    halves, posted = _incoming(front, layout, rank, shift, recvs)
    outgoing = [(front.index_select(0, _boundary_rows(layout, half, shift).to(x.device)), peer, tag)
                for half, peer, _, tag in sends if peer != rank]
    if outgoing or posted:
        exchange(group, outgoing, posted).wait()
    source = torch.cat([front, *halves, front.new_zeros((1, *front.shape[1:]))])
    return source.index_select(0, index.to(x.device)).movedim(0, seq_dim)


class _Roll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, seq_dim, group, layout):
        ctx.args = (seq_dim, group, layout)
        ctx.shift = shift
        return zigzag_roll_local(x, shift, seq_dim, group, layout)

    @staticmethod
    def backward(ctx, grad):
        return zigzag_roll_local(grad, -ctx.shift, *ctx.args), None, None, None, None


def zigzag_roll(x: torch.Tensor, shift: int, seq_dim: int, group, layout: ZigzagDocs) -> torch.Tensor:
    """Differentiable per-document roll of a zigzag shard (see module doc).

    Raises:
        ValueError: ``|shift|`` larger than the smallest chunk (``padded document / (2 cp)``).
    """
    if shift == 0:
        return x
    smallest = min(layout.chunk(i) for i in _docs(layout))
    if layout.size > 1 and abs(shift) > smallest:
        raise ValueError(
            f"roll_tensor shifts={shift}: |shifts| must be <= the zigzag chunk length {smallest} "
            "(padded document length / (2 * cp))"
        )
    return _Roll.apply(x, shift, seq_dim, group, layout)
