"""``cp_comm_type="auto"``: each pattern's predicted time from a cost profile, and the pick.

:func:`predict` prices one pattern for one call (:class:`~.pattern_work.AttnCase`) on a profile: compute is the
profile's compute fit of the slowest rank's plan; each collective is ``latency + bytes / bandwidth`` on the
profile's links for the group (the inner level of ``a2a+p2p`` on the links of a group of its size); the overlapped
transfers hide under their slots of compute by the profile's ``overlap``; a measured profile then applies the
pattern's fit to its own calls (:class:`~.profile.PatternFit`)::

    modelled = compute + exposed + ring - overlap * hidden
    total = scale * modelled + fixed + per_element * (q, k, v elements the pattern copies on the rank)
            + per_packed_element * (thd only: the query-side elements its kernels run over)

(``exposed``: the collectives nothing overlaps, the all-to-alls, all_gather's first gathers and last
reduce-scatter; ``ring``: the overlapped ones, the ring's K/V and dK/dV and all_gather's other chunks; ``hidden``:
per slot of the pattern's schedule (:class:`~.pattern_work.Slot`: a ring step, the backward's head and tail of the
local step, a KV-head chunk), the transfers in flight under it up to its compute, summed: measured on emulated
links, ``cp-bench --modes links``). :func:`choose_comm_type` returns the fastest candidate, ties going
to the earlier one in :data:`~cp_handler.core.comm_types.CP_COMM_TYPES` order (``p2p`` first). The inputs are
the same on every rank of a CP group (shapes, documents, the group's sizes, one profile), and so is the pick; the
handler's agreement check compares it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.patterns import PATTERNS
from .pattern_work import AttnCase, pattern_work
from .profile import CostProfile


@dataclass(frozen=True)
class Prediction:
    """One pattern's predicted milliseconds for one rank, forward + backward of one attention layer."""

    comm_type: str
    compute_ms: float
    comm_ms: float
    total_ms: float


def predict(comm_type: str, case: AttnCase, profile: CostProfile, dtype: str) -> Prediction:
    """The :class:`Prediction` of ``comm_type`` for ``case`` on ``profile`` with inputs of ``dtype`` (a torch dtype
    name, e.g. ``"bfloat16"``).

    Raises:
        ValueError: the profile does not cover the group or the dtype (:meth:`~.profile.CostProfile.check`
            names it), or the pattern cannot run the case (``a2a+p2p`` without two levels).
    """
    work = pattern_work(comm_type, case)
    group = profile.group(case.cp)
    if dtype not in group.compute:
        raise ValueError(f"cost profile {profile.name!r} has compute fits for {sorted(group.compute)}, not {dtype}")
    compute = sum(group.compute[dtype].ms(step) for step in work.steps)
    load = [0.0] * len(work.slots)  # the transfers in flight under each slot of compute
    exposed = 0.0
    for t in work.transfers:
        links = profile.group(t.group_size).links if t.inner else group.links
        ms = links[t.kind].ms(t.nbytes)
        if t.slot is None:
            exposed += ms
        else:
            load[t.slot] += ms
    ring = sum(load)
    hidden = sum(min(ms, slot.share * compute) for ms, slot in zip(load, work.slots, strict=True))
    total = compute + exposed + ring - profile.overlap * hidden
    fit = group.patterns.get(comm_type)
    return Prediction(comm_type, compute, ring + exposed,
                      fit.ms(total, work.elements, work.packed_elements) if fit is not None else total)


def candidates(case: AttnCase, runs: tuple[str, ...] | list[str] = tuple(PATTERNS)) -> list[str]:
    """The patterns "auto" chooses among for ``case``: those of ``runs`` that can run it (every pattern runs every
    head count; ``a2a+p2p`` needs two levels of at least two ranks each)."""
    out = []
    for name in PATTERNS:
        if name not in runs:
            continue
        if PATTERNS[name].hierarchical and (case.hierarchical is None or min(case.hierarchical) < 2):
            continue
        out.append(name)
    return out


@dataclass(frozen=True)
class AutoChoice:
    """What "auto" picked, and every candidate's prediction (in
    :data:`~cp_handler.core.comm_types.CP_COMM_TYPES` order)."""

    comm_type: str
    predictions: tuple[Prediction, ...]

    def describe(self) -> str:
        """One log line: the pick, then each candidate's predicted milliseconds."""
        times = ", ".join(f"{p.comm_type} {p.total_ms:.3g} ms" for p in self.predictions)
        return f"cp_comm_type='auto' -> {self.comm_type!r} (predicted per layer fwd+bwd: {times})"


def choose_comm_type(case: AttnCase, profile: CostProfile, dtype: str,
                     runs: tuple[str, ...] | list[str] = tuple(PATTERNS)) -> AutoChoice:
    """The fastest of :func:`candidates` by :func:`predict` (module doc).

    Raises:
        ValueError: no candidate (``runs`` empty of runnable patterns), or what :func:`predict` raises.
    """
    names = candidates(case, runs)
    if not names:
        raise ValueError(f"cp_comm_type='auto': none of {list(runs)} can run this call (cp={case.cp}, "
                         f"levels {case.hierarchical})")
    predictions = tuple(predict(name, case, profile, dtype) for name in names)
    best = min(predictions, key=lambda p: p.total_ms)  # min keeps the first of equal times: CP_COMM_TYPES order
    return AutoChoice(best.comm_type, predictions)
