"""Zigzag layout index arithmetic (no processes): positions, shard/unshard are exact inverses."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from cp_handler.layout import zigzag_positions, zigzag_shard, zigzag_unshard


def test_positions_cp2():
    # S=8, cp=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


@given(cp=st.sampled_from([1, 2, 3, 4, 8]), chunk=st.integers(1, 5), seq_dim=st.integers(0, 2))
def test_shard_unshard_inverse(cp, chunk, seq_dim):
    shape = [3, 2, 4]
    shape[seq_dim] = 2 * cp * chunk
    x = torch.arange(torch.tensor(shape).prod().item()).view(shape)
    shards = [zigzag_shard(x, seq_dim, r, cp) for r in range(cp)]
    for r, shard in enumerate(shards):
        positions = zigzag_positions(shape[seq_dim], r, cp)
        assert torch.equal(shard, x.index_select(seq_dim, positions))
    assert torch.equal(zigzag_unshard(torch.cat(shards, seq_dim), seq_dim, cp), x)
