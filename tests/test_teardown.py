"""``destroy_process_groups()`` leaves no gloo thread behind: the groups a ParallelLayout builds
(through DeviceMesh, whose meshes refer to each other) are freed while Python is alive, so no gloo
worker can take the GIL during interpreter shutdown (a rank aborting with "terminate called without
an active exception", ~1 spawned run in 30 before; see docs/testing.md). Linux: counts /proc/self/task.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_handler import ParallelLayout, destroy_process_groups


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(rank, world, init_file):
    torch.set_num_threads(1)
    torch.ones(8, 8) @ torch.ones(8, 8)  # start any lazily created math threads before counting
    before = _threads()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups = ParallelLayout(world_size=world, context_parallel_size=2).build("cpu")
    total = torch.ones(1)
    dist.all_reduce(total, group=groups.groups["cp"])
    assert total.item() == 2
    del groups, total
    during = _threads()
    destroy_process_groups()
    assert during > before and _threads() == before, (before, during, _threads())


def test_destroy_process_groups_joins_gloo_threads():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(4, os.path.join(tmp, "init")), nprocs=4, join=True)
