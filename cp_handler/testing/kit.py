"""``check_handler``: run the handler contract on CPU ranks and report each case.

Per CP size the kit starts the ranks once (CPU, gloo, forked from a server that imported torch once; a
process-group timeout turns a hang into a failure), builds a handler per case as the library does (the class's
``check_config``, then ``from_config`` with a ``ContextParallelConfig``, the CP groups, the attention shape and,
for thd, ``cu_seqlens``; ``"a2a+p2p"`` with levels ``[2, world / 2]``) and runs the checks of :mod:`.checks`.

A refusal is a ``ValueError`` or ``NotImplementedError`` raised at one of the contract's refusal points, before
the backend's ``attend`` runs: building the handler (``check_config``, the class's ``cp_comm_types``, its
constructor) or the pre-flight of ``core_attn`` (``unsupported_variant``, ``check_call``), and the same on every
rank. Anything else is a failure: another error type, an error inside ``attend`` or in a layout method, a refusal
on some ranks only. After a case that raised on every rank the kit builds fresh process groups and goes on; a rank
that died or hung leaves the rest of its CP size ``NOT RUN``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..handlers.base import ContextParallelHandler
from ..runtime.config import AUTO, CP_COMM_TYPES, QKV_FORMATS
from ..runtime.forking import freeze_inherited_objects, start_fork_server, start_method
from . import cases, checks
from .report import NOT_COVERED, CaseResult, ConformanceReport

CHECKS = ("layout", "roll", "rope", "attention", "disagreement", "bad_input")
"""Every check of the kit, in the order it runs them (``check_handler(checks=...)`` picks among them)."""
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WORLD = 8
"""The largest CP size the kit runs (ranks on CPU)."""
PLAIN_CAUSAL = ("causal", "mha", "mqa")
"""The variants of plain causal attention (GQA 2:1, MHA, MQA): every comm type a backend declares runs one of them
in some case, or the report fails (a backend that refuses everything does not pass)."""
REFUSAL_CHECKS = ("disagreement", "bad_input")
"""Checks that expect a refusal: run once per comm type and format (short lengths, the first dtype)."""


def _rank_main(rank, environ, world, init_file, handler_cls, plan, out_file, timeout_s, progress) -> None:
    from ..runtime.groups import build_dp_cp_groups, destroy_process_groups

    freeze_inherited_objects()  # a forked rank: no collection copies the server's heap
    os.environ.clear()  # the caller's environment (a rank forked from the server would keep the server's)
    os.environ.update(environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    levels = sorted({cases.Case(comm_type, "bshd", torch.float32, world).levels for comm_type, *_ in plan}, key=str)

    def new_groups():
        return {sizes: build_dp_cp_groups(world, "cpu", list(sizes) if sizes else None) for sizes in levels}

    results, groups, failed = [], new_groups(), 0
    try:
        for i, (comm_type, fmt, dtype_name, length, check, variant) in enumerate(plan):
            case = cases.Case(comm_type, fmt, getattr(torch, dtype_name), world, length)
            status, detail, error = _run_case(handler_cls, case, groups[case.levels], check, variant)
            statuses = [None] * world
            dist.all_gather_object(statuses, (status, detail, error))
            status, detail = _agree(statuses)
            failed += status == "FAIL"
            results.append(dict(world=world, comm_type=comm_type, qkv_format=fmt, dtype=dtype_name, length=length,
                                check=check, variant=variant or "", status=status, detail=detail))
            if any(e for _, _, e in statuses):  # an error on every rank: fresh groups, nothing left in flight
                groups = new_groups()
            if progress and rank == 0 and (i + 1 == len(plan) or plan[i + 1][:4] != plan[i][:4]):
                print(f"cp_handler.testing: cp={world} {comm_type} {fmt} {dtype_name} {length}: {i + 1}/{len(plan)} "
                      f"cases, {failed} failed", file=sys.stderr, flush=True)
    finally:
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
        destroy_process_groups()


def _agree(statuses) -> tuple[str, str]:
    """One status for the case from every rank's: a failure anywhere fails it; a refusal counts only if every
    rank refused (one rank refusing alone is a failure: the others went on into the call). The detail: one line
    per rank and wrong tensor (``every rank:`` when the ranks say the same)."""
    kinds = {s for s, _, _ in statuses}
    if kinds == {"PASS"}:
        return "PASS", ""
    if kinds == {"NOT-SUPPORTED"}:
        return "NOT-SUPPORTED", f"rank 0: {statuses[0][1][0]}"
    texts = [tuple(d) for _, d, _ in statuses]
    if len(set(texts)) == 1:
        lines = [f"every rank: {line}" for line in texts[0]]
    else:
        lines = [f"rank {i}: {line}" for i, (s, d, _) in enumerate(statuses) if s != "PASS" for line in d]
    if "FAIL" not in kinds:
        lines.insert(0, "some ranks refused the case and others built or ran it (a refusal is the same on every rank)")
    return "FAIL", "\n".join(lines[:24] + ([f"(+{len(lines) - 24} more lines)"] if len(lines) > 24 else []))


def _run_case(handler_cls, case, groups, check, variant_name) -> tuple[str, list[str], bool]:
    """``(status, detail lines, errored)`` of one case on this rank (errored: an exception other than a refusal)."""
    variant = cases.VARIANTS[variant_name or "causal"]
    built = None
    try:
        handler = cases.build(handler_cls, case, groups, variant)
    except Exception as err:  # noqa: BLE001 - a crash while building is the case's failure
        built = ("NOT-SUPPORTED", [f"{type(err).__name__}: {err}"], False) if cases.is_refusal(err) else \
            ("FAIL", [f"building the handler raised {checks.error_text(err)}: a crash, not a refusal"
                      f"{checks.not_a_refusal(err)}"], True)
    if checks.any_rank(built is not None, dist.group.WORLD):  # no rank goes on into the checks' collectives alone
        return built or ("PASS", [], False)  # built here, not everywhere: :func:`_agree` fails it, naming the ranks
    try:
        if check in REFUSAL_CHECKS:
            failures = checks.expect_refusal(handler, case, disagree=check == "disagreement")
        else:
            run = {"layout": checks.check_layout, "roll": checks.check_roll, "rope": checks.check_rope}.get(check)
            # the kit's own collectives on the world group: never interleaved with the handler's on its CP group
            failures = run(handler, case, dist.group.WORLD) if run else \
                checks.check_attention(handler, case, variant, dist.group.WORLD)
    except checks.Refused as err:
        return "NOT-SUPPORTED", [str(err)], False
    except checks.Crashed as err:
        return "FAIL", [str(err)], True
    except Exception as err:  # noqa: BLE001 - reported as the case's failure
        return "FAIL", [f"{check} check: the handler raised {checks.error_text(err)}"], True
    return ("FAIL", failures, False) if failures else ("PASS", [], False)


def _plan(world, comm_types, formats, dtypes, lengths, checks_, variants) -> list[tuple]:
    """The cases of one CP size, grouped by comm type, format, dtype and length (one progress line per group)."""
    plan = []
    for ct in comm_types:
        if ct == "a2a+p2p" and (world < 4 or world % 2):
            continue
        for fmt in formats:
            for i, dt in enumerate(dtypes):
                for length in lengths:
                    for check in checks_:
                        if check in REFUSAL_CHECKS and (i > 0 or length != lengths[0]):
                            continue
                        if length == "long" and i > 0 and check != "attention":
                            continue
                        later = length == "long" and i > 0  # a further dtype's long lengths: one variant
                        for variant in (variants[:1] if later else variants) if check == "attention" else [None]:
                            plan.append((ct, fmt, dt, length, check, variant))
    return plan


def _not_checked(handler_cls, requested: dict, asked_comm_types) -> list[str]:
    """What the run leaves out, by flag or declaration (:class:`~.report.ConformanceReport`'s ``not_checked``)."""
    declared = tuple(handler_cls.cp_comm_types)
    lines = []
    if undeclared := [c for c in CP_COMM_TYPES if c not in declared]:
        lines.append(f"comm types {', '.join(undeclared)}: the class does not run them (cp_comm_types={declared})")
    if asked_comm_types is not None and (dropped := [c for c in asked_comm_types if c not in declared]):
        lines.append(f"comm types {', '.join(dropped)} asked for and not declared by the class: not run")
    run = requested["comm_types"]
    if narrowed := [c for c in CP_COMM_TYPES if c in declared and c not in run]:
        lines.append(f"comm types {', '.join(narrowed)}: declared, not asked for (comm_types / --comm-types)")
    if "a2a+p2p" in run and (odd := [w for w in requested["world_sizes"] if w < 4 or w % 2]):
        lines.append(f"a2a+p2p at cp {', '.join(map(str, odd))}: its levels [2, cp / 2] need an even CP size >= 4")
    if AUTO in declared:
        lines.append("cp_comm_type='auto': it picks one of the patterns per call; each pattern is checked on its own")
    for name, every, flag in (("formats", QKV_FORMATS, "formats"), ("dtypes", DTYPES, "dtypes"),
                              ("lengths", cases.LENGTHS, "lengths"), ("variants", tuple(cases.VARIANTS), "variants"),
                              ("checks", CHECKS, "checks"),
                              ("cp sizes", tuple(range(2, MAX_WORLD + 1)), "world_sizes")):
        if left := [str(v) for v in every if v not in requested[flag]]:
            lines.append(f"{name} {', '.join(left)}: not asked for ({flag} / --{flag.replace('_', '-')})")
    if "roll" in requested["checks"] and "long" not in requested["lengths"]:
        lines.append("roll_tensor shifts of 2 and 3 (both ways): they run at long lengths (a short thd document's "
                     "zigzag chunk may hold one token)")
    if "attention" in requested["checks"] and not set(PLAIN_CAUSAL) & set(requested["variants"]):
        lines.append(f"that each comm type runs plain causal attention in some case: none of {', '.join(PLAIN_CAUSAL)} "
                     "asked for (variants / --variants)")
    dtypes = requested["dtypes"]
    if len(dtypes) > 1 and "long" in requested["lengths"]:
        lines.append(f"long lengths in {', '.join(dtypes[1:])}: attention in its first variant only "
                     f"({requested['variants'][0]}); every check and variant in the first dtype ({dtypes[0]})")
    if len(dtypes) > 1 and any(c in REFUSAL_CHECKS for c in requested["checks"]):
        lines.append(f"the refusal checks (disagreement, bad_input) in {', '.join(dtypes[1:])}: first dtype only")
    return lines + list(NOT_COVERED)


def check_handler(handler_cls, *, comm_types=None, formats=QKV_FORMATS, dtypes=DEFAULT_DTYPES,
                  variants=tuple(cases.VARIANTS), world_sizes=(2, 4), checks=CHECKS, lengths=cases.LENGTHS,
                  timeout_s: float = 120.0, progress: bool = True) -> ConformanceReport:
    """Run the handler contract on CPU ranks (gloo; forked from a server that imported torch once, as
    :func:`~cp_handler.runtime.launch.launch` starts them) and report every case (module doc; docs/backends.md).

    Args:
        handler_cls: a :class:`~cp_handler.ContextParallelHandler` subclass (importable by the ranks: at module
            level, or in ``__main__`` behind ``if __name__ == "__main__"``); built through its ``check_config`` /
            ``from_config``.
        comm_types: the ``cp_comm_type`` values to run (default: every pattern the class declares in its
            ``cp_comm_types``; others asked for are listed as not run; ``"a2a+p2p"`` at even CP sizes of 4 and
            more, with levels ``[2, world / 2]``).
        formats: ``qkv_format`` values. dtypes: input dtypes (default float32, bfloat16, float16; the output must
            have the input's dtype; tolerances per dtype in :mod:`.compare`).
        variants: names in :data:`~.cases.VARIANTS` for the attention check.
        world_sizes: CP sizes from 2 to 8, one start of the ranks each. checks: names in :data:`CHECKS`.
        lengths: names in :data:`~.cases.LENGTHS` (long lengths: every check in the first dtype, attention's
            first variant in the others).
        timeout_s: the process group's timeout (a hang becomes a failure after it).
        progress: a line on stderr as each group of cases ends (comm type, format, dtype, length).

    Returns:
        A :class:`~.report.ConformanceReport` (statuses in :mod:`.report`); ``report.ok`` is False when a case
        failed, or when no case passed.

    Raises:
        TypeError: ``handler_cls`` not a ContextParallelHandler subclass.
        ValueError: an unknown comm type, format, dtype, length, variant or check, or a CP size outside 2-8.
    """
    if not (isinstance(handler_cls, type) and issubclass(handler_cls, ContextParallelHandler)):
        raise TypeError(f"check_handler: handler_cls={handler_cls!r} is not a ContextParallelHandler subclass")
    dtype_names = [str(d).removeprefix("torch.") for d in dtypes]
    asked = None if comm_types is None else list(comm_types)
    for name, given, known in (("comm_types", asked or [], CP_COMM_TYPES), ("formats", formats, QKV_FORMATS),
                               ("dtypes", dtype_names, DTYPES), ("lengths", lengths, cases.LENGTHS),
                               ("variants", variants, tuple(cases.VARIANTS)), ("checks", checks, CHECKS)):
        if unknown := [g for g in given if g not in known]:
            raise ValueError(f"check_handler: {name} {unknown} not among {list(known)}")
        if not given and name != "comm_types":
            raise ValueError(f"check_handler: {name} is empty: name at least one of {list(known)}")
    if bad := [w for w in world_sizes if isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= MAX_WORLD]:
        raise ValueError(f"check_handler: world_sizes {bad}: a CP group of the kit has 2 to {MAX_WORLD} ranks")
    run = [c for c in (asked if asked is not None else CP_COMM_TYPES) if c in handler_cls.cp_comm_types]
    requested = dict(comm_types=run, formats=list(formats), dtypes=dtype_names, lengths=list(lengths),
                     variants=list(variants), checks=list(checks), world_sizes=list(world_sizes))
    report = ConformanceReport(f"{handler_cls.__module__}.{handler_cls.__qualname__}",
                               not_checked=_not_checked(handler_cls, requested, asked))
    method = start_method()  # CPU: ranks forked from a server that imported torch once (cp_handler.runtime.forking)
    if method == "forkserver":
        start_fork_server(["torch", "torch.distributed", "torch._dynamo", __name__, handler_cls.__module__])
    for world in world_sizes:
        plan = _plan(world, run, formats, dtype_names, list(lengths), list(checks), list(variants))
        if not plan:
            continue
        if progress:
            print(f"cp_handler.testing: {report.handler} at cp={world}: {len(plan)} cases on {world} ranks",
                  file=sys.stderr, flush=True)
        report.results += _run_world(handler_cls, world, plan, timeout_s, progress, method)
    report.results += _nothing_passed(report.results, "attention" in checks)
    return report


def _run_world(handler_cls, world, plan, timeout_s, progress, method) -> list[CaseResult]:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.json")
        try:
            args = (dict(os.environ), world, os.path.join(tmp, "init"), handler_cls, plan, out_file, timeout_s,
                    progress)
            mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method=method)
            failure = None
        except Exception as err:  # noqa: BLE001 - a rank that died: its cases are reported, not raised
            failure = f"a rank died: {str(err).strip().splitlines()[-1][:300]}"
        rows = json.load(open(out_file)) if os.path.exists(out_file) else []
    results = [CaseResult(**row) for row in rows]
    for i, (ct, fmt, dt, length, check, variant) in enumerate(plan[len(rows):]):
        results.append(CaseResult(world, ct, fmt, dt, length, check, variant or "",
                                  "FAIL" if failure and i == 0 else "NOT RUN", failure or ""))
    return results


def _nothing_passed(results: list[CaseResult], attention: bool) -> list[CaseResult]:
    """A failure per comm type where causal attention ran and no case of it passed at any CP size, format, dtype or
    head layout (:data:`PLAIN_CAUSAL`; without the attention check: where no case passed): a backend that refuses
    everything does not pass. A run narrowed away from those variants says so in the report's "not checked" list."""
    out = []
    for ct in dict.fromkeys(r.comm_type for r in results):
        mine = [r for r in results if r.comm_type == ct]
        if attention:
            mine = [r for r in mine if r.check == "attention" and r.variant in PLAIN_CAUSAL]
        if not mine or any(r.status in ("PASS", "FAIL", "NOT RUN") for r in mine):
            continue
        sizes = ", ".join(str(w) for w in dict.fromkeys(r.world for r in mine))
        why = (f"no causal attention case passed at cp {sizes}: every one was refused (a backend runs causal "
               "attention in at least one CP size, format, dtype and head layout of each comm type it declares)"
               if attention else f"no case passed at cp {sizes}: every case was refused")
        out.append(CaseResult(mine[0].world, ct, "-", "-", "-", "contract", "", "FAIL", why))
    return out


def assert_conforms(handler_cls, **kwargs) -> ConformanceReport:
    """:func:`check_handler`, raising ``AssertionError`` with the report's table when it did not pass (for a
    backend's own pytest suite); returns the report."""
    report = check_handler(handler_cls, **kwargs)
    if not report.ok:
        raise AssertionError(report.table())
    return report
