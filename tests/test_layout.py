"""Zigzag layout index arithmetic (no processes): bshd is one document of ZigzagDocs."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from cp_handler.core.layout import ZigzagDocs


def test_positions_cp2():
    # S=8, cp=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    layout = ZigzagDocs.uniform(8, 2)
    assert layout.positions(0).tolist() == [0, 1, 6, 7]
    assert layout.positions(1).tolist() == [2, 3, 4, 5]


@given(cp=st.sampled_from([1, 2, 3, 4, 8]), chunk=st.integers(1, 5))
def test_shard_and_gather_are_inverse(cp, chunk):
    seq_len = 2 * cp * chunk
    layout = ZigzagDocs.uniform(seq_len, cp)
    shards = torch.cat([layout.dispatch_index(r) for r in range(cp)])  # every rank's tokens, rank by rank
    assert sorted(shards.tolist()) == list(range(seq_len))
    assert torch.equal(shards[layout.gathered_index(real_only=True)], torch.arange(seq_len))
    for r in range(cp):
        assert torch.equal(layout.dispatch_index(r), layout.positions(r))
