"""``check_handler``: run the handler contract on spawned gloo ranks and report each case.

Per world size the kit spawns the ranks once (CPU, gloo; a process-group timeout turns a hang into a failure),
builds a handler per case as the library does (the class's ``check_config``, then ``from_config`` with a
``ContextParallelConfig``, the CP groups, the attention shape and, for thd, ``cu_seqlens``; ``"a2a+p2p"`` with
levels ``[2, world / 2]``) and runs the checks of :mod:`.cases` against the float64 single-process reference.
Cases that end in an error other than a refusal may leave the ranks' collectives out of step: the rest of that
world size is then reported ``NOT RUN``.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import CP_COMM_TYPES, QKV_FORMATS
from ..handlers.base import ContextParallelHandler
from ..launch import start_method
from . import cases

CHECKS = ("layout", "roll", "rope", "attention", "disagreement", "bad_input")
"""Every check of the kit, in the order it runs them (``check_handler(checks=...)`` picks among them)."""
STATUSES = ("PASS", "FAIL", "NOT-SUPPORTED", "NOT RUN")


@dataclass(frozen=True)
class CaseResult:
    """One case: where it ran, what it checked, ``status`` (one of :data:`STATUSES`) and why."""

    world: int
    comm_type: str
    qkv_format: str
    dtype: str
    check: str
    variant: str
    status: str
    detail: str = ""


@dataclass
class ConformanceReport:
    """Every case of one :func:`check_handler` run; ``ok``: no case failed."""

    handler: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(r.status == "FAIL" for r in self.results)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def table(self) -> str:
        """One line per case (failures first, then refusals), and the counts."""
        order = {s: i for i, s in enumerate(("FAIL", "NOT RUN", "NOT-SUPPORTED", "PASS"))}
        lines = [f"conformance of {self.handler}:"]
        for r in sorted(self.results, key=lambda r: order[r.status]):
            where = f"cp={r.world} {r.comm_type} {r.qkv_format} {r.dtype} {r.check}" + \
                (f" [{r.variant}]" if r.variant else "")
            lines.append(f"  {r.status:<13} {where}" + (f": {r.detail}" if r.detail else ""))
        lines.append("  " + ", ".join(f"{n} {s}" for s, n in self.counts().items()))
        return "\n".join(lines)


def _rank_main(rank, environ, world, init_file, handler_cls, plan, out_file, timeout_s) -> None:
    from ..groups import build_dp_cp_groups, destroy_process_groups

    os.environ.clear()  # the caller's environment (a rank forked from the server would keep the server's)
    os.environ.update(environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results, broken = [], None
    groups = {sizes: build_dp_cp_groups(world, "cpu", list(sizes) if sizes else None)
              for sizes in {cases.Case(comm_type, "bshd", torch.float32, world).levels for comm_type, *_ in plan}}
    try:
        for comm_type, fmt, dtype_name, check, variant in plan:
            row = dict(world=world, comm_type=comm_type, qkv_format=fmt, dtype=dtype_name, check=check,
                       variant=variant or "")
            if broken is not None:
                results.append(dict(row, status="NOT RUN", detail=broken))
                continue
            case = cases.Case(comm_type, fmt, getattr(torch, dtype_name), world)
            status, detail, error = _run_case(handler_cls, case, groups[case.levels], check, variant)
            statuses = [None] * world
            dist.all_gather_object(statuses, (status, detail, error))
            status, detail = _agree(statuses)
            if any(e for _, _, e in statuses):
                broken = f"an earlier case ({check} {comm_type} {fmt}) raised an error; the ranks may be out of step"
            results.append(dict(row, status=status, detail=detail))
    finally:
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
        destroy_process_groups()


def _agree(statuses) -> tuple[str, str]:
    """One status for the case from every rank's: a failure anywhere fails it; a refusal counts only if every
    rank refused (one rank refusing alone is a failure: the others went on into the call)."""
    kinds = {s for s, _, _ in statuses}
    details = [f"rank {i}: {d}" for i, (s, d, _) in enumerate(statuses) if s != "PASS" and d]
    if kinds == {"PASS"}:
        return "PASS", ""
    if kinds == {"NOT-SUPPORTED"}:
        return "NOT-SUPPORTED", statuses[0][1]
    if "FAIL" not in kinds:
        details.insert(0, "some ranks refused the case and others ran it")
    return "FAIL", "; ".join(details)[:600]


def _run_case(handler_cls, case, groups, check, variant_name) -> tuple[str, str, bool]:
    """``(status, detail, errored)`` of one case on this rank (errored: an exception other than a refusal)."""
    variant = cases.VARIANTS[variant_name or "causal"]
    try:
        handler = cases.build(handler_cls, case, groups, variant)
    except cases.REFUSALS as err:
        return "NOT-SUPPORTED", f"{type(err).__name__}: {err}", False
    try:
        if check in ("disagreement", "bad_input"):
            return _expect_refusal(handler, case, disagree=check == "disagreement")
        failure = {"layout": lambda: cases.check_layout(handler, case, groups.cp_group),
                   "roll": lambda: cases.check_roll(handler, case, groups.cp_group),
                   "rope": lambda: cases.check_rope(handler, case),
                   "attention": lambda: cases.check_attention(handler, case, variant, groups.cp_group)}[check]()
    except cases.REFUSALS as err:
        return "NOT-SUPPORTED", f"{type(err).__name__}: {err}", False
    except Exception as err:  # noqa: BLE001 - reported as the case's failure
        return "FAIL", f"{type(err).__name__}: {err} ({_where(err)})", True
    return ("PASS", "", False) if failure is None else ("FAIL", failure, False)


def _expect_refusal(handler, case, disagree: bool) -> tuple[str, str, bool]:
    """The call must be refused by name on this rank (every rank, as :func:`_agree` checks) before any collective:
    ``disagree``: rank 0 passes a window of 4 and the others 5; else q has 4 heads and k / v 3."""
    variant = cases.VARIANTS["window" if disagree else "causal"]
    if disagree and dist.get_rank() == 0:
        variant = cases.Variant("window", variant.mask, window_size=(3, 0))
    heads = variant.heads if disagree else (4, 3)
    shape = {"bshd": (2, 8 * case.world), "sbhd": (8 * case.world, 2), "thd": (sum(case.lengths),)}[case.qkv_format]
    q, k, v = (torch.randn(*shape, n, 8, dtype=case.dtype) for n in (heads[0], heads[1], heads[1]))
    local = [handler.dispatch(t, case.seq_dim) for t in (q, k, v)]
    try:
        handler.core_attn(cases.attn_module(variant, None), *local, attn_mask_type="causal")
    except cases.REFUSALS as err:
        return "PASS", f"refused: {type(err).__name__}: {str(err)[:200]}", False
    what = "ranks passing different windows" if disagree else "q with 4 heads and k / v with 3"
    return "FAIL", f"{what} ran without a refusal", False


def _where(err: Exception) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def check_handler(handler_cls, *, comm_types=None, formats=QKV_FORMATS, dtypes=(torch.float32,),
                  variants=tuple(cases.VARIANTS), world_sizes=(2, 4), checks=CHECKS,
                  timeout_s: float = 120.0, progress: bool = True) -> ConformanceReport:
    """Run the handler contract on CPU ranks (gloo; forked from a server that imported torch once, as
    :func:`~cp_handler.launch.launch` starts them) and report every case.

    Args:
        handler_cls: a :class:`~cp_handler.ContextParallelHandler` subclass (importable by the spawned ranks: at
            module level, or in ``__main__`` behind ``if __name__ == "__main__"``); built through its
            ``check_config`` / ``from_config`` (module doc).
        comm_types: the ``cp_comm_type`` values to run (default: every one of ``CP_COMM_TYPES``; ``"a2a+p2p"``
            only at world sizes of 4 and more, with levels ``[2, world / 2]``).
        formats: ``qkv_format`` values; dtypes: input dtypes (float32, float64, bfloat16, float16).
        variants: names in :data:`~.cases.VARIANTS` for the attention check.
        world_sizes: CP sizes, one spawn each; checks: names in :data:`CHECKS`.
        timeout_s: the process group's timeout (a hang becomes a failure after it).
        progress: one line on stderr as each CP size starts (its ranks and cases take 5-30 s on 2 CPU cores).

    Returns:
        A :class:`ConformanceReport`: per case PASS, FAIL (a wrong answer, an error, or a call that should have
        been refused and was not), NOT-SUPPORTED (the handler refused the case by name on every rank: declared),
        NOT RUN. ``report.ok`` is False when any case failed.

    Raises:
        TypeError: ``handler_cls`` not a ContextParallelHandler subclass.
        ValueError: an unknown comm type, format, variant or check, or a world size below 2.
    """
    if not (isinstance(handler_cls, type) and issubclass(handler_cls, ContextParallelHandler)):
        raise TypeError(f"check_handler: handler_cls={handler_cls!r} is not a ContextParallelHandler subclass")
    comm_types = list(comm_types or CP_COMM_TYPES)
    for name, given, known in (("comm_types", comm_types, CP_COMM_TYPES), ("formats", formats, QKV_FORMATS),
                               ("variants", variants, tuple(cases.VARIANTS)), ("checks", checks, CHECKS)):
        if unknown := [g for g in given if g not in known]:
            raise ValueError(f"check_handler: {name} {unknown} not among {list(known)}")
    if bad := [w for w in world_sizes if not isinstance(w, int) or w < 2]:
        raise ValueError(f"check_handler: world_sizes {bad}: a CP group has at least 2 ranks")
    report = ConformanceReport(f"{handler_cls.__module__}.{handler_cls.__qualname__}")
    method = start_method()  # CPU: ranks forked from a server that imported torch once (cp_handler.launch)
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__, handler_cls.__module__])
    for world in world_sizes:
        plan = [(ct, fmt, str(dt).removeprefix("torch."), check, variant)
                for ct in comm_types if ct != "a2a+p2p" or world >= 4 for fmt in formats for dt in dtypes
                for check in checks for variant in (variants if check == "attention" else [None])]
        if progress:  # its ranks and cases take 5-30 s on 2 CPU cores
            print(f"cp_handler.testing: {report.handler} at cp={world}: {len(plan)} cases on {world} spawned ranks",
                  file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "results.json")
            try:
                args = (dict(os.environ), world, os.path.join(tmp, "init"), handler_cls, plan, out_file, timeout_s)
                mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method=method)
                failure = None
            except Exception as err:  # noqa: BLE001 - a rank that died: its cases are reported, not raised
                failure = f"a rank died: {str(err).strip().splitlines()[-1][:300]}"
            rows = json.load(open(out_file)) if os.path.exists(out_file) else []
        report.results += [CaseResult(**row) for row in rows]
        for ct, fmt, dt, check, variant in plan[len(rows):]:
            report.results.append(CaseResult(world, ct, fmt, dt, check, variant or "", "FAIL" if failure else
                                             "NOT RUN", failure or ""))
    return report


def assert_conforms(handler_cls, **kwargs) -> ConformanceReport:
    """:func:`check_handler`, raising ``AssertionError`` with the report's table when a case failed (for a
    backend's own pytest suite); returns the report."""
    report = check_handler(handler_cls, **kwargs)
    if not report.ok:
        raise AssertionError(report.table())
    return report


def report_json(report: ConformanceReport) -> str:
    return json.dumps({"handler": report.handler, "results": [asdict(r) for r in report.results]}, indent=1)
