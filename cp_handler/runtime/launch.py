"""Start the ranks of a job: spawn them (torch elastic, as torchrun does) or run as one under torchrun.

Spawning goes through ``torch.distributed.launcher.elastic_launch`` so that a crashed rank or
Ctrl-C stops every rank (the elastic agent terminates the group) instead of leaving peers hanging
in a collective. A rank that is alive but makes no progress (frozen, deadlocked, stuck in a
collective) is caught by a watchdog: every rank touches a heartbeat file after each step
(:func:`heartbeat`); when one has not for ``timeout`` seconds, the launcher kills it, which ends the
job, and names that rank. Under torchrun the process groups' own timeout (the same ``timeout``) ends
a collective that waits on a dead peer, and :func:`init_process_group_bounded` ends a rendezvous that
does not complete (a peer that never comes, a port held by a program that never answers).

Start-up: on a machine without CUDA the ranks are forked, nothing imported again (:mod:`.forking`); with CUDA they
are spawned (the start method GPU runs were made with). The launching process's environment and the heartbeat folder
are passed to every rank explicitly (:func:`_rank_entry`: a rank forked from a server would keep the server's).

Why our own watchdog and not ``torch.distributed.elastic.timer`` (``FileTimerServer`` / ``expires``): that kills each
rank whose own timer expires, so every rank waiting in a collective on a stalled one expires too and the failure names
no cause; ours kills and names the rank that stalled (a stopped or dead process before the ranks that only wait on
it), and covers the time before the first step.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .forking import fork_server_from_here, freeze_inherited_objects, start_fork_server, start_method
from .groups import destroy_process_groups


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a job, as torchrun (or :func:`launch`) puts it in the environment."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1


def rank_env() -> RankEnv | None:
    """The one reader of the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``): ``None`` when this process was not started as one rank of a job."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
                   int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def is_first_rank() -> bool:
    """Rank 0 of the job, or a process that is no rank at all (the launcher)."""
    env = rank_env()
    return env is None or env.rank == 0


def _describe(failure) -> str:
    """The failing rank's error and traceback, from the error file that ``@record`` wrote."""
    message = failure.message
    if isinstance(message, dict):
        return (message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")).rstrip()
    return str(message) or f"exit code {failure.exitcode}"


# What a rank raises when a peer died under it (gloo / NCCL / the store): a consequence, not the cause.
_PEER_LOST = ("DistNetworkError", "DistBackendError", "DistStoreError", "remote worker", "Connection closed by peer",
              "Connection reset by peer")


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is what a rank raises when a peer died under it (:data:`_PEER_LOST`): a consequence, not
    the cause."""
    return any(marker in f"{type(err).__name__}: {err}" for marker in _PEER_LOST)


def root_failure(failures: dict) -> tuple:
    """``(rank, failure)`` of the failure that caused the others: the earliest one that is not a rank
    losing its connection to a dead peer (under load, the peer's own error can be recorded later
    than the survivors'); the earliest of all when every one is a lost connection."""
    def key(item):
        rank, failure = item
        lost = any(marker in _describe(failure) for marker in _PEER_LOST)
        return lost, failure.timestamp, rank

    return min(failures.items(), key=key)


HEARTBEAT_ENV = "CP_HANDLER_HEARTBEAT_DIR"


def heartbeat() -> None:
    """Record that this rank made progress (a file per rank holding its pid, in the launcher's
    heartbeat folder; nothing when not started by :func:`launch`)."""
    folder = os.environ.get(HEARTBEAT_ENV)
    if folder:
        with open(os.path.join(folder, f"rank{(rank_env() or RankEnv(0, 1)).rank}"), "w") as f:
            f.write(str(os.getpid()))


class Watchdog(threading.Thread):
    """Kills the first rank whose heartbeat is older than ``timeout`` seconds; ``stalled`` names it."""

    def __init__(self, folder: str, nproc: int, timeout: float):
        super().__init__(daemon=True)
        self.folder, self.nproc, self.timeout = folder, nproc, timeout
        self.stalled: int | None = None
        self.done = threading.Event()

    def run(self) -> None:
        started = time.time()
        while not self.done.wait(min(1.0, self.timeout / 4)):
            beats = {rank: self._last_beat(rank, started) for rank in range(self.nproc)}
            stale = [rank for rank, last in beats.items() if time.time() - last > self.timeout]
            if stale:
                # A rank waiting in a collective on the stalled one goes stale too, possibly first (its last
                # heartbeat a moment older), or dies of the process group's timeout (the same --timeout): blame a
                # stopped process (stale or not yet) first, then a dead one, else the oldest heartbeat.
                states = {rank: self._state(rank) for rank in range(self.nproc)}
                stopped = [rank for rank in range(self.nproc) if rank not in stale and states[rank] in "Tt"]
                self.stalled = min(stale + stopped, key=lambda rank: (0 if states[rank] in "Tt" else 1 if
                                                                       states[rank] in "ZX" else 2, beats[rank]))
                self._kill(self.stalled)
                return

    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}")

    def _last_beat(self, rank: int, started: float) -> float:
        return os.path.getmtime(self._path(rank)) if os.path.exists(self._path(rank)) else started

    def _pid(self, rank: int) -> int | None:
        try:
            with open(self._path(rank)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _state(self, rank: int) -> str:
        """Linux: the process's state letter (``/proc/PID/stat``), ``"X"`` when gone, ``"?"`` when unknown."""
        pid = self._pid(rank)
        if pid is None:
            return "?"
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "X"

    def _kill(self, rank: int) -> None:
        pid = self._pid(rank)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # already gone: the elastic agent ends the job either way


class RendezvousError(RuntimeError):
    """A rank could not join the process group (reported as one line, not a traceback)."""


def init_process_group_bounded(backend: str, timeout: float, program: str = "cp-train", **kwargs) -> None:
    """``torch.distributed.init_process_group`` (env:// rendezvous) that ends within ``timeout``
    seconds: the collective timeout is ``timeout``, and if the rendezvous itself has not completed by
    then (e.g. ``MASTER_PORT`` held by a program that accepts connections and never answers), this
    process prints which address it waited for and exits with status 1.

    Raises:
        RendezvousError: the rendezvous failed (e.g. ``MASTER_PORT`` already in use), naming the address.
    """
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    rank = (rank_env() or RankEnv(0, 1)).rank
    done = threading.Event()

    def give_up() -> None:
        if not done.wait(timeout):
            print(f"{program}: rank {rank} could not join the process group in {timeout:g} s (--timeout): the "
                  f"rendezvous at MASTER_ADDR:MASTER_PORT = {address} did not complete (a rank missing, or the port "
                  "held by another program)", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=give_up, daemon=True, name="cp-handler-rendezvous").start()
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError derive from RuntimeError
        in_use = "EADDRINUSE" in str(err) or "address already in use" in str(err).lower()
        reason = "the port is already in use; choose a free one (torchrun --master-port)" if in_use else err
        raise RendezvousError(f"{program}: rank {rank} could not join the process group at MASTER_ADDR:MASTER_PORT "
                              f"= {address}: {reason}") from None
    finally:
        done.set()


def under_torchrun() -> bool:
    """True when this process is one rank started by torchrun (or another env:// launcher)."""
    return rank_env() is not None


@contextlib.contextmanager
def rank_session(program: str = "cp-train", timeout: float | None = None, device_type: str | None = None,
                 threads: int | None = None):
    """This process as one rank of the job (under :func:`launch` or torchrun), inside the block; yields its
    device. The one place a rank starts: the device (``cuda:LOCAL_RANK`` when ``device_type`` is ``"cuda"``,
    or ``None`` and CUDA is available; else the CPU with ``threads`` threads, default the cores divided by
    the ranks on this node), the default process group (NCCL on CUDA, gloo on CPU; with ``timeout`` seconds
    the rendezvous is bounded and it is the collectives' timeout, :func:`init_process_group_bounded`), a
    first :func:`heartbeat`; on exit :func:`~cp_handler.runtime.groups.destroy_process_groups`.

    Raises:
        RendezvousError: the rendezvous failed (``timeout`` given).
    """
    env = rank_env() or RankEnv(0, 1)
    cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    backend, options = ("nccl", {"device_id": device}) if cuda else ("gloo", {})
    if timeout:
        init_process_group_bounded(backend, timeout, program, **options)
    else:
        dist.init_process_group(backend, **options)
    heartbeat()
    try:
        yield device
    finally:
        destroy_process_groups()


ELASTIC_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
               "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
               "OMP_NUM_THREADS")
"""What torch elastic sets for each rank (besides ``TORCHELASTIC_*``): it wins over the launching process's value."""


def _rank_entry(environ: dict[str, str], heartbeat_dir: str, entrypoint, *args):
    """A rank's first call: the launching process's environment ``environ`` (a forked rank would otherwise keep the
    server's, from the server's start) with what torch elastic set for this rank on top, and the heartbeat folder;
    its stdout joined to stderr (ranks report through the launcher, which alone writes stdout); then
    ``entrypoint(*args)``. The objects a forked rank inherited are kept out of garbage collection
    (:func:`freeze_inherited_objects`)."""
    freeze_inherited_objects()
    own = {k: v for k, v in os.environ.items() if k in ELASTIC_ENV or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(own)
    os.environ[HEARTBEAT_ENV] = heartbeat_dir
    # stdout is the launcher's (cp-generate's text): a rank's own output and native chatter (torch 2.10's gloo prints
    # "[Gloo] Rank 0 is connected to 1 peer ranks") go to stderr
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return _cause_first(entrypoint, *args)


PEER_LOST_GRACE_S = 3.0
"""Seconds a rank whose error says a peer is gone waits before it fails (:func:`_cause_first`)."""


def _cause_first(entrypoint, *args):
    """``entrypoint(*args)``; a rank whose error is a lost peer (:data:`_PEER_LOST`) waits :data:`PEER_LOST_GRACE_S`
    before it fails. The agent (torch elastic's, torchrun's) reports the ranks that have failed when it sees the first
    one and stops the others: the rank whose error caused the rest must end first. A peer learns of it when that rank
    closes its process group, before the rank has exited: without the wait a fast survivor was reported alone ("rank 0
    failed": Connection closed by peer) and the cause, rank 1's error, was lost (tests/test_cli.py)."""
    try:
        return entrypoint(*args)
    except Exception as err:
        if lost_peer(err):
            time.sleep(PEER_LOST_GRACE_S)
        raise


def _preload(entrypoint_module: str, preload: tuple[str, ...]) -> list[str]:
    return ["torch", "torch.distributed", __name__, entrypoint_module, *preload]


def launch(entrypoint, nproc: int, *args, program: str = "cp-train", timeout: float | None = None,
           preload: tuple[str, ...] = ()) -> dict:
    """Run ``entrypoint(*args)`` on ``nproc`` ranks; returns ``{rank: return value}``. ``program``
    names the command in failure messages; ``timeout`` (seconds) arms the watchdog (see module doc); ``preload``:
    modules the ranks import once, before they start: the fork server's besides torch and ``entrypoint``'s module
    (the first launch of a process starts the server; later launches reuse it), or this process's when the ranks
    are forked from it (a module that starts a thread makes it start them from the server instead).

    Raises:
        SystemExit: a rank failed or stalled (the message names it and its error) or the run was interrupted.
    """
    if under_torchrun():
        try:
            return {rank_env().rank: _cause_first(entrypoint, *args)}
        except RendezvousError as err:
            raise SystemExit(str(err)) from None
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we report failures below
    method = start_method()
    if method == "fork":
        for module in preload:  # inherited by every rank: imported once instead of once per rank
            importlib.import_module(module)
        method = start_method()
    if method == "fork" and fork_server_from_here():
        method = "forkserver"  # served by a fork of this process made before any thread starts (module doc)
    elif method in ("fork", "forkserver"):
        method = "forkserver"
        start_fork_server(_preload(entrypoint.__module__, preload))  # the first launch's modules: a server stays
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"{program}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method=method,
    )
    with tempfile.TemporaryDirectory(prefix=f"{program}-heartbeat-") as folder:
        watchdog = Watchdog(folder, nproc, timeout) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            return elastic_launch(config, _rank_entry)(dict(os.environ), folder, entrypoint, *args)
        except ChildFailedError as err:
            if watchdog and watchdog.stalled is not None:
                raise SystemExit(f"{program}: rank {watchdog.stalled} made no progress for {timeout:g} s (--timeout); "
                                 "it was killed and all ranks stopped.") from None
            rank, failure = root_failure(err.failures)
            raise SystemExit(f"{program}: rank {rank} failed; all ranks stopped.\n{_describe(failure)}") from None
        except (KeyboardInterrupt, SignalException):
            raise SystemExit(f"{program}: interrupted; all ranks stopped.") from None
        finally:
            if watchdog:
                watchdog.done.set()
