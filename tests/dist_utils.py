"""Run a function on N spawned CPU ranks (gloo). One helper for every multi-rank test.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each rank with
the default process group initialised. An exception in any rank fails the test with that rank's
traceback; the other ranks are terminated (``torch.multiprocessing.spawn``), and a collective that
waits on a dead peer times out after ``TIMEOUT`` instead of hanging the suite.

``device="cuda"`` (the GPU test mode, ``pytest -m gpu``): each rank takes GPU ``rank % n_gpus``;
with at least one GPU per rank the group is NCCL, otherwise (ranks sharing a GPU: NCCL refuses
them) gloo with every collective staged through host memory by :mod:`host_staging`.
``stage_through_host=True`` stages on CPU too (the harness's own test).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import tempfile

import conftest
import host_staging
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_handler import destroy_process_groups

TIMEOUT = datetime.timedelta(seconds=conftest.HANG_GUARD_S)
STACKS_ENV = "CP_HANDLER_TEST_STACKS_S"
"""Seconds after which (and every as many after) each rank prints every thread's Python stack (unset: never)."""


def _backend(rank: int, world_size: int, device: str, stage_through_host: bool) -> str:
    if device == "cuda":
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(rank % gpus)
        if world_size <= gpus:
            return "nccl"
        stage_through_host = True
    if stage_through_host:
        host_staging.install(force=device == "cpu")
    return "gloo"


def _worker(rank: int, fn, world_size: int, init_file: str, args: tuple, device: str, stage: bool) -> None:
    # A native crash (SIGABRT/SIGSEGV in gloo or ATen) prints every thread's C++ stack: it is how the
    # teardown race that destroy_process_groups() fixes was found.
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    if os.environ.get(STACKS_ENV):  # scripts/gpu_check.py: a stalled rank shows where it waits
        faulthandler.dump_traceback_later(float(os.environ[STACKS_ENV]), repeat=True)
    torch.set_num_threads(1)
    conftest.load()  # the suite's rules in this rank too (no deadline)
    dist.init_process_group(
        _backend(rank, world_size, device, stage), init_method=f"file://{init_file}", rank=rank,
        world_size=world_size, timeout=TIMEOUT,
    )
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_process_groups()
    # A rank that passed ends here, without interpreter finalisation: a gloo worker thread still releasing a
    # Python tensor then can no longer abort the process ("terminate called without an active exception",
    # seen ~1 run in 30 even after destroy_process_groups()). spawn takes exit code 0 as success.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


CONNECT_FAILURES = ("connectFullMesh failed",)
"""gloo errors of connection set-up on loopback (seen once in a CI-like run: a peer closed the socket while
``new_group`` connected its full mesh, no rank had raised). A launch that fails with one of them, and
nothing else, is started once more; any other failure, assertions included, fails at once."""


def run_distributed(fn, world_size: int, *args, device: str = "cpu", stage_through_host: bool = False) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; raise if any rank fails."""
    for attempt in range(2):
        try:
            with tempfile.TemporaryDirectory() as tmp:
                init_file = os.path.join(tmp, "init")
                mp.spawn(_worker, args=(fn, world_size, init_file, args, device, stage_through_host),
                         nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as err:
            if attempt or not any(text in str(err) for text in CONNECT_FAILURES):
                raise


def new_cp_group(ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A CP group over ``ranks`` (default: all), distinct from the default group."""
    return dist.new_group(ranks if ranks is not None else list(range(dist.get_world_size())))


class GatherSumGrad(torch.autograd.Function):
    """All-gather along dim 0 (list form, equal shapes); backward reduce-scatters, as K/V gathers
    need when every rank's queries use every rank's keys."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        parts = [p.contiguous() for p in grad.chunk(dist.get_world_size(ctx.group))]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None
