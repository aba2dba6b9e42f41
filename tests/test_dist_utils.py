"""The multi-rank harness itself: a failure in one rank's hypothesis-driven body is reported, not hung on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import fails_fast, run_distributed
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st


def _worker(rank, world):
    @settings(max_examples=6, derandomize=True, phases=[Phase.explicit, Phase.generate])
    @given(n=st.integers(1, 50))
    @example(n=3)
    @example(n=4)
    @fails_fast
    def body(n):
        total = torch.tensor([float(n)])
        dist.all_reduce(total)  # every example is a collective: a rank's lone replay would meet the next example
        assert not (rank == 1 and n == 4), "injected failure"
        assert total.item() == n * world

    body()


def test_a_rank_failing_inside_hypothesis_ends_the_run_with_its_example():
    """Without ``fails_fast``, hypothesis replays ``n=4`` on rank 1 alone and its all_reduce meets rank 0's next
    example: a hang (the thd GPU case of 2026-11-27 aborted on a gloo size mismatch or stalled)."""
    with pytest.raises(mp.ProcessRaisedException, match=r"(?s)rank 1: body\(n=4\) failed.*injected failure"):
        run_distributed(_worker, 2)
