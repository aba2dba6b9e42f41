"""Causal tiling of block plans on CPU (blocks.tile_causal): the same score pairs, query starts
non-decreasing (the forward copies a block that starts past every row written), and attention
through tiled plans equal to SDPA, for blocks longer than one tile (the pattern tests use short
sequences that never tile). Tolerance: fp32 atol = rtol = 4e-6 * cp, as test_attn_patterns."""

import pytest
import torch
from attn_reference import single_process_attention, zigzag_shard
from dist_utils import new_cp_group, run_distributed

from cp_handler.ops.all_gather import all_gather_attn
from cp_handler.ops.blocks import CPU_CAUSAL_TILE, LseRows, tile_causal
from cp_handler.ops.ring import ring_attn


def pairs(blocks):
    out = set()
    for q, k, causal in blocks:
        for i in range(q.start, q.stop):
            for j in range(k.start, k.stop):
                if not causal or j - k.start <= i - q.start:
                    out.add((i, j))
    return out


@pytest.mark.parametrize("n", [1, CPU_CAUSAL_TILE, CPU_CAUSAL_TILE + 1, 3 * CPU_CAUSAL_TILE - 5,
                               8 * CPU_CAUSAL_TILE + 3])
def test_tiling_keeps_exactly_the_causal_pairs(n):
    block = [(slice(10, 10 + n), slice(40, 40 + n), True), (slice(10, 10 + n), slice(0, 40), False)]
    tiled = tile_causal(block)
    assert pairs(tiled) == pairs(block)
    assert all(q.stop - q.start <= CPU_CAUSAL_TILE for q, _, causal in tiled if causal)
    starts = [q.start for q, _, _ in tiled[:-1]]  # the last block is the unsplit full one
    assert starts == sorted(starts)


def _long_worker(rank, world, algorithm):
    g = torch.Generator().manual_seed(0)
    s = 2 * world * 263  # causal local blocks of 263 rows: three levels of halving, a remainder
    q, k, v, dout = (torch.randn(1, 2, s, 32, generator=g, dtype=torch.float64) for _ in range(4))
    want = single_process_attention(q, k, v, dout, causal=True)
    local = [zigzag_shard(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    out = algorithm(*local, group=new_cp_group(), causal=True, scale=32**-0.5)[0]
    out.backward(zigzag_shard(dout, 2, rank, world))
    tol = 4e-6 * world
    torch.testing.assert_close(out, zigzag_shard(want[0], 2, rank, world), atol=tol, rtol=tol)
    for t, ref in zip(local, want[2:], strict=True):
        torch.testing.assert_close(t.grad, zigzag_shard(ref, 2, rank, world), atol=tol, rtol=tol)


@pytest.mark.parametrize("algorithm", [ring_attn, all_gather_attn])
def test_tiled_plans_match_single_process(algorithm):
    run_distributed(_long_worker, 2, algorithm)


def test_lse_rows_copies_each_range_once():
    """``LseRows``: a range's rows come back contiguous and equal to the slice, the same tensor on every
    request (the ring's steps share one copy per range), a different range its own."""
    lse = torch.randn(2, 3, 10)
    lse_rows = LseRows(lse)
    first = lse_rows(slice(4, 9))
    assert first.is_contiguous() and torch.equal(first, lse[:, :, 4:9])
    assert lse_rows(slice(4, 9)) is first and lse_rows(slice(0, 4)) is not first
