"""Start the ranks of a job: spawn them (torch elastic, as torchrun does) or run as one under torchrun.

Spawning goes through ``torch.distributed.launcher.elastic_launch`` so that a crashed rank or
Ctrl-C stops every rank (the elastic agent terminates the group) instead of leaving peers hanging
in a collective.
"""

from __future__ import annotations

import logging
import os
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def _describe(failure) -> str:
    """The failing rank's error and traceback, from the error file that ``@record`` wrote."""
    message = failure.message
    if isinstance(message, dict):
        return (message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")).rstrip()
    return str(message) or f"exit code {failure.exitcode}"


def under_torchrun() -> bool:
    """True when this process is one rank started by torchrun (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(entrypoint, nproc: int, *args, program: str = "cp-train") -> dict:
    """Run ``entrypoint(*args)`` on ``nproc`` ranks; returns ``{rank: return value}``. ``program``
    names the command in failure messages.

    Raises:
        SystemExit: a rank failed (the message names it and its error) or the run was interrupted.
    """
    if under_torchrun():
        return {int(os.environ["RANK"]): entrypoint(*args)}
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we report failures below
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"{program}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn",
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise SystemExit(f"{program}: rank {rank} failed; all ranks stopped.\n{_describe(failure)}") from None
    except (KeyboardInterrupt, SignalException):
        raise SystemExit(f"{program}: interrupted; all ranks stopped.") from None
