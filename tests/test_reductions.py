"""The deterministic mode's sums over a process group in one order (``cp_handler/runtime/reductions.py``): the
ordered sum (tensor parallelism's row-wise outputs above 2 TP ranks) and the ordered reduce-scatter (with sequence
parallelism) are ``torch.equal`` to the sum in rank order computed in one process, at every buffer size. Negative
control: gloo's all-reduce over 4 ranks gives the same elements other bits in buffers of other sizes.

Tolerances: none (bitwise).
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed


def _ordered_sum_worker(rank, world):
    from cp_handler.runtime.reductions import ordered_sum_over_group

    parts = torch.randn(world, 65536, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 65536)
    want = parts[0].clone()
    for part in parts[1:]:
        want += part
    group = dist.group.WORLD
    for n in (7, 4096, 65536):
        assert torch.equal(ordered_sum_over_group(parts[rank, :n], group), want[:n]), n
    short, long = parts[rank, :4096].clone(), parts[rank].clone()
    dist.all_reduce(short)
    dist.all_reduce(long)
    assert not torch.equal(short, long[:4096])  # the control: gloo's all-reduce adds by the buffer's size


def test_ordered_sum_is_the_same_bits_whatever_the_buffer_size():
    """Why the mode adds TP partial sums itself above 2 ranks: over 4 ranks gloo's all-reduce gives the same
    elements other bits in a buffer of 4096 than in one of 65536 (1332 of 4096 differ, measured), so a row-wise
    projection's output would change with the tokens a CP rank holds; ``ordered_sum_over_group`` gives
    ``((p0 + p1) + p2) + p3`` at every size (``torch.equal`` to the sum computed in one process)."""
    run_distributed(_ordered_sum_worker, 4)


def _ordered_reduce_scatter_worker(rank, world):
    from cp_handler.runtime.reductions import ordered_reduce_scatter

    parts = torch.randn(world, 2, 64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 96)
    want = parts[0].clone()
    for part in parts[1:]:
        want += part
    for tokens in (8, 64):  # each rank's chunk: rows [rank * tokens / world, ...) of the sum, at every size
        mine = parts[rank, :, :tokens].clone().requires_grad_()
        got = ordered_reduce_scatter(mine, dist.group.WORLD, 1)
        step = tokens // world
        assert torch.equal(got, want[:, rank * step:(rank + 1) * step]), tokens
        got.backward(torch.full_like(got, float(rank + 1)))  # the adjoint: every rank's chunk gradient, gathered
        assert torch.equal(mine.grad, torch.cat([torch.full_like(got, float(r + 1)) for r in range(world)], 1))
    with pytest.raises(ValueError, match="does not split over 4 ranks"):
        ordered_reduce_scatter(parts[rank, :, :6], dist.group.WORLD, 1)


def test_ordered_reduce_scatter_is_the_sum_in_rank_order():
    """Sequence parallelism in the deterministic mode: ``ordered_reduce_scatter`` gives each of 4 ranks its chunk of
    ``((p0 + p1) + p2) + p3`` (``torch.equal`` to the sum in one process) at every buffer size, its backward the
    all-gathered gradient; a dim the group does not split is refused."""
    run_distributed(_ordered_reduce_scatter_worker, 4)
