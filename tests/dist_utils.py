"""Run a function on N spawned CPU ranks (gloo). One helper for every multi-rank test.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each rank with
the default process group initialised. An exception in any rank fails the test with that rank's
traceback; the other ranks are terminated (``torch.multiprocessing.spawn``), and a collective that
waits on a dead peer times out after ``TIMEOUT`` instead of hanging the suite.

``device="cuda"`` (the GPU test mode, ``pytest -m gpu``): each rank takes GPU ``rank % n_gpus``;
with at least one GPU per rank the group is NCCL, otherwise (ranks sharing a GPU: NCCL refuses
them) gloo with every collective staged through host memory by :mod:`host_staging`.
``stage_through_host=True`` stages on CPU too (the harness's own test).

Start method: on CPU the ranks are forked from one server process that imported torch, cp_handler,
transformers and hypothesis once per pytest session (``forkserver`` with :data:`PRELOAD`): a rank starts in
~0.1 s instead of re-importing them (5-15 s per launch on the 2-core CI machine, the largest share of the suite's
time). Every rank is still a fresh process (nothing leaks from one test to the next); ``sys.path`` and the
working directory come from the launching process as with ``spawn``, and so does the environment (passed to
:func:`_worker`, which the server would otherwise keep from its own start). ``device="cuda"`` keeps ``spawn``:
the GPU pass runs on a 16-core machine, and a start method no GPU has run stays out of it.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import os
import sys
import tempfile
import time
import traceback

import conftest
import host_staging
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_handler import destroy_process_groups
from cp_handler.runtime import forking
from cp_handler.runtime.launch import lost_peer

TIMEOUT = datetime.timedelta(seconds=conftest.HANG_GUARD_S)
RANK_IMPORTS = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
                "transformers.models.mistral.modeling_mistral", "transformers.models.qwen2.modeling_qwen2")
"""What the suite's ranks import most (timed per rank on 2026-12-05: 1,668 s of the suite's rank time went to imports,
torch._dynamo 343 s in 244 ranks, torch.distributed.tensor 276 s in 202, the Llama modules 200 s): imported once by
the fork server instead. Not transformers' and TRL's trainers (123 s in 30 ranks): they load pyarrow, whose jemalloc
starts a background thread, and a process with another thread is not one to fork from."""
PEER_GONE_DELAY_S = 5.0
"""A rank whose collective failed because a peer exited waits this long before failing: spawn reports the first
failure it sees and terminates the rest, and the peer's own error is the one that says what went wrong."""
STACKS_ENV = "CP_HANDLER_TEST_STACKS_S"
"""Seconds after which (and every as many after) each rank prints every thread's Python stack (unset: never)."""
PRELOAD = ["torch", "torch.distributed", "hypothesis", "pytest", "transformers", "cp_handler", "cp_handler.testing.kit",
           "cp_handler.training", "cp_handler.cli.args", "conftest", "host_staging", "dist_utils", "gpt_reference",
           "torch._inductor.compile_fx", *RANK_IMPORTS]
"""Modules the fork server imports once (a module that fails to import there is skipped by multiprocessing and
imported by the rank itself, as under ``spawn``). A rank imports its test module (its function's home) and what that
imports: pytest, cp_handler.training and cp_handler.cli.args were the most of it, inductor's in the compiled tests
(2026-12-06's profile). Nothing here starts a thread (the server forks: a rank would inherit a lock a thread held):
``datasets`` does (pyarrow's, checked), so it and TRL are left to the ranks that train through them."""


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


def _worker(rank: int, fn, world_size: int, init_file: str, args: tuple, device: str, stage: bool,
            environ: dict[str, str]) -> None:
    forking.freeze_inherited_objects()  # forked from the server: no garbage collection copies its heap
    os.environ.clear()  # the launching process's environment, as a spawned rank would have it
    os.environ.update(environ)
    # A native crash (SIGABRT/SIGSEGV in gloo or ATen) prints every thread's C++ stack: it is how the
    # teardown race that destroy_process_groups() fixes was found.
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    faulthandler.enable()  # ... and the Python stack of the thread that crashed (the call that met the crash)
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
    except RankFailure as failure:  # spawn reports an Exception's traceback to the parent
        raise AssertionError(f"rank {rank}: {failure.report}") from None
    except Exception as err:
        _wait_if_a_peer_failed(err)
        raise
    finally:
        destroy_process_groups()
    # A rank that passed ends here, without interpreter finalisation: a gloo worker thread still releasing a
    # Python tensor then can no longer abort the process ("terminate called without an active exception",
    # seen ~1 run in 30 even after destroy_process_groups()). spawn takes exit code 0 as success.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wait_if_a_peer_failed(err: Exception) -> None:
    if lost_peer(err):  # a consequence: the failing peer's report goes first
        time.sleep(PEER_GONE_DELAY_S)


class RankFailure(BaseException):
    """A failure inside a hypothesis-driven body run on every rank (:func:`fails_fast`), carried past hypothesis.

    Hypothesis replays a failing example in the failing rank alone (to report it); the replay's collectives
    meet the other ranks' next example: a gloo size mismatch ("576 vs 12") or a hang, and the assertion that
    failed is never shown (the thd GPU case of 2026-11-27). Not an ``Exception``, it passes through hypothesis
    at once; :func:`_worker` turns it back into the rank's error."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


def fails_fast(body):
    """Decorate a ``@given`` body that runs on every rank: its first failure ends the rank at once with the
    example and traceback (:class:`RankFailure`) instead of a replay the other ranks do not make."""

    @functools.wraps(body)
    def wrapped(*args, **kwargs):
        try:
            return body(*args, **kwargs)
        except Exception as err:
            _wait_if_a_peer_failed(err)
            example = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            raise RankFailure(f"{body.__name__}({example}) failed:\n{traceback.format_exc()}") from None

    return wrapped


CONNECT_FAILURES = ("connectFullMesh failed",)
"""gloo errors of connection set-up on loopback (seen once in a CI-like run: a peer closed the socket while
``new_group`` connected its full mesh, no rank had raised). A launch that fails with one of them, and
nothing else, is started once more; any other failure, assertions included, fails at once."""


def start_fork_server() -> None:
    """Start this process's fork server with :data:`PRELOAD` (idempotent). A process has one server, and the modules
    it preloads are the list set when it starts: the suite starts it itself, before any test, so that a test that
    starts ranks by another route first (the conformance kit, ``launch`` in this process: each sets its own, shorter
    list) does not leave every later rank of this worker to import transformers, hypothesis and the rest again (one
    of the two workers did, the kit's file running first: 2026-12-06's profile of the suite)."""
    forking.start_fork_server(PRELOAD)  # tests/ on the server's path: PRELOAD's helpers (conftest, dist_utils) too


def run_distributed(fn, world_size: int, *args, device: str = "cpu", stage_through_host: bool = False) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; raise if any rank fails."""
    start_method = "spawn" if device == "cuda" else "forkserver"
    if start_method == "forkserver":
        start_fork_server()
    for attempt in range(2):
        try:
            with tempfile.TemporaryDirectory() as tmp:
                init_file = os.path.join(tmp, "init")
                mp.start_processes(_worker, nprocs=world_size, join=True, start_method=start_method,
                                   args=(fn, world_size, init_file, args, device, stage_through_host,
                                         dict(os.environ)))
            return
        except mp.ProcessRaisedException as err:
            if attempt or not any(text in str(err) for text in CONNECT_FAILURES):
                raise


def computed_once(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` computed on rank 0 and sent to every rank (``broadcast_object_list``: tensors pickled,
    bits kept). For the single-process reference of a parallel test: its inputs are the same on every rank, so one
    rank computes it for all instead of each of N ranks sharing the machine's cores computing it again."""
    box = [fn(*args, **kwargs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
