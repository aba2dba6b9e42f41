"""Every collective the CP algorithms issue goes through here, so communication can be counted.

Wrappers over torch.distributed (``all_gather_single`` / ``reduce_scatter_single`` under their
torch 2.13 names, the older ``*_into_tensor`` / ``*_tensor`` before; looked up at each call, so a
test harness that wraps ``torch.distributed`` sees every collective), plus :func:`count_comms`:

    with count_comms() as counter:
        out, _ = ring_attn(...); out.backward(g)
    counter.ops     # Counter({"send": 3, "recv": 3, ...})
    counter.bytes_sent

``bytes_sent`` is the algorithmic volume that leaves this rank with a bandwidth-optimal
implementation: all-gather ``(n-1) * input``, reduce-scatter and all-to-all ``(n-1)/n * input``,
p2p the sent tensor. Expected volumes per pattern: docs/communication.md.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    """Collective calls by kind and bytes sent by this rank."""

    ops: Counter = field(default_factory=Counter)
    bytes_sent: int = 0

    def record(self, op: str, nbytes: float) -> None:
        self.ops[op] += 1
        self.bytes_sent += int(nbytes)


_active: list[CommCounter] = []


@contextlib.contextmanager
def count_comms():
    """Count the collectives issued inside the block (this rank only)."""
    counter = CommCounter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


def record(op: str, nbytes: float) -> None:
    for counter in _active:
        counter.record(op, nbytes)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's ``inp`` along dim 0 into ``out``."""
    if _active:  # counting (the hot path tests the list: no call)
        record("all_gather", inp.nbytes * (dist.get_world_size(group) - 1))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Sum ``inp`` over ranks and keep this rank's dim-0 slice in ``out``."""
    if _active:  # counting (the hot path tests the list: no call)
        size = dist.get_world_size(group)
        record("reduce_scatter", inp.nbytes * (size - 1) / size)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, inp, group=group, async_op=async_op)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False,
                      output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None):
    """All-to-all along dim 0: equal splits, or rows per rank in ``*_split_sizes`` (uneven).
    Bytes sent: every split but this rank's own."""
    if _active:  # counting (the hot path tests the list: no call)
        _record_all_to_all(inp, group, input_split_sizes)
    return dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def _record_all_to_all(inp: torch.Tensor, group, input_split_sizes: list[int] | None) -> None:
    """Record an all-to-all of ``inp`` (:func:`all_to_all_single`'s count; called only while counting)."""
    size = dist.get_world_size(group)
    if input_split_sizes is None:
        sent = inp.nbytes * (size - 1) / size
    else:
        row = inp[0].nbytes if inp.shape[0] else 0
        sent = row * (sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)])
    record("all_to_all", sent)


def batch_isend_irecv(ops: list[dist.P2POp]) -> list:
    """Post point-to-point ops together; records one ``send``/``recv`` per op."""
    if _active:  # counting (the hot path tests the list: no call)
        for op in ops:
            is_send = op.op in (dist.isend, dist.send)
            record("send" if is_send else "recv", op.tensor.nbytes if is_send else 0)
    return dist.batch_isend_irecv(ops) if ops else []


class _AllToAll(torch.autograd.Function):
    """Differentiable :func:`all_to_all_single` along dim 0; its backward is the reverse all-to-all.
    ``_AllToAll.apply(x, group, send_splits, recv_splits)`` is :func:`all_to_all` without its frame (the Ulysses
    hot path calls it so)."""

    @staticmethod
    def forward(ctx, x, group, send_splits, recv_splits):
        ctx.args = (group, send_splits, recv_splits)
        out = x.new_empty((x.shape[0] if recv_splits is None else sum(recv_splits), *x.shape[1:]))
        x = x.contiguous()
        if _active:  # all_to_all_single inline (the hot path: no call unless counting)
            _record_all_to_all(x, group, send_splits)
        dist.all_to_all_single(out, x, recv_splits, send_splits, group=group, async_op=False)
        return out

    @staticmethod
    def backward(ctx, grad):
        group, send_splits, recv_splits = ctx.args
        return _AllToAll.apply(grad, group, recv_splits, send_splits), None, None, None


def all_to_all(x: torch.Tensor, group, send_splits: list[int] | None = None,
               recv_splits: list[int] | None = None) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 (the one the Ulysses attention and the MoE token exchange
    share): equal splits, or ``send_splits`` / ``recv_splits`` rows per rank. Counted like every
    collective here (``torch.distributed.nn.functional.all_to_all_single`` would do the same job but
    bypass :func:`count_comms`)."""
    return _AllToAll.apply(x, group, send_splits, recv_splits)


class _GatherSummed(torch.autograd.Function):
    """Differentiable all-gather along dim 0 whose backward sums every rank's gradient of each part into its
    owner (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous(), group)
        return out.unflatten(0, (size, x.shape[0]))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.flatten(0, 1).contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        reduce_scatter_single(out, grad, ctx.group)
        return out, None


def all_gather_summed(x: torch.Tensor, group) -> torch.Tensor:
    """``(n, ...)`` per rank -> ``(size, n, ...)``, every rank's in rank order; the backward is a reduce-scatter (each
    rank gets the sum over the ranks of its part's gradient: the adjoint when every rank computes with all the
    parts, as the state passing of the token mixers and cp-bench's gather-the-sequence baseline do)."""
    return _GatherSummed.apply(x, group)
