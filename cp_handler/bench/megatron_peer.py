"""Megatron-LM's dynamic-CP scheduler as a benchmark peer, when megatron-core is installed.

Only its scheduler module is loaded (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``,
found inside the installed package), with the megatron modules it imports at module level
(``megatron.core``, its ``parallel_state`` and ``rerun_state_machine``) replaced by empty stand-ins
while it loads, so neither megatron.core's package initialisation nor a process group is needed.
Nothing of it is copied here. Its ``BalancedCPScheduler.next_hdp_group`` forms one
group (a barrier-free phase) at a time, as its ``get_groups_and_subsamples`` does; the makespan is
the sum over groups of the busiest GPU's estimated time (its own ``L^2 / cp`` estimate).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

SCHEDULER_FILE = Path("pipeline_parallel") / "hybrid_cp_schedule.py"


def load_balanced_cp_scheduler():
    """``(BalancedCPScheduler class, None)``, or ``(None, reason)`` when megatron-core is absent or differs."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, "megatron-core is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / SCHEDULER_FILE
    if not path.exists():
        return None, f"megatron-core has no {SCHEDULER_FILE}"
    stand_ins = {name: types.ModuleType(name) for name in ("megatron", "megatron.core", "megatron.core.parallel_state",
                                                           "megatron.core.rerun_state_machine")}
    stand_ins["megatron.core"].parallel_state = stand_ins["megatron.core.parallel_state"]
    stand_ins["megatron.core.rerun_state_machine"].RerunDataIterator = object
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("_megatron_hybrid_cp", path))
        module.__spec__.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any failure means: no peer, say why
        return None, f"loading {path} failed: {err!r}"
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    scheduler = getattr(module, "BalancedCPScheduler", None)
    return (scheduler, None) if scheduler else (None, f"{path} has no BalancedCPScheduler")


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def megatron_makespan(scheduler_cls, lengths: list[int], num_ranks: int, max_seq_len_per_rank: int) -> float:
    """Sum over Megatron's groups of the busiest GPU's estimated time (``L^2 / cp`` units)."""
    scheduler = scheduler_cls(max_seq_len_per_rank, _Group(num_ranks))
    remaining = sorted(enumerate(lengths), key=lambda x: x[1], reverse=True)
    makespan = 0.0
    while remaining:
        _, remaining, exec_times, _ = scheduler.next_hdp_group(remaining, scheduler.get_total_workload, num_ranks)
        makespan += max(exec_times)
    return makespan


def megatron_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001
        return os.environ.get("MEGATRON_CORE_VERSION")
