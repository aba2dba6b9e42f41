"""The conformance kit's report: every case's status, and what the run did not check.

Statuses (:data:`STATUSES`): ``PASS``; ``FAIL`` (a wrong tensor, an error, a call that should have been refused
and ran, a refusal outside a refusal point or on some ranks only); ``NOT-SUPPORTED`` (the handler refused the case
at a refusal point, by name, on every rank: what it declares it does not run); ``NOT RUN`` (a rank died or hung
before the case). A report passes (``ok``) when no case failed and, for every comm type it ran, at least one causal
attention case passed (at some CP size, format and dtype): a backend that refuses everything does not pass.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

STATUSES = ("PASS", "FAIL", "NOT-SUPPORTED", "NOT RUN")
NOT_COVERED = (
    "CUDA ranks and GPU kernels (the kit runs CPU ranks over gloo; docs/testing.md lists the GPU runs)",
    "the collectives a backend issues and their bytes (its cost, not its answer)",
    "torch.compile (core_attn as one operator under Inductor: tests/test_compile.py for our handlers)",
    "per-layer cp_comm_type lists and cp_comm_type='auto' (each pattern is checked on its own)",
    "the mixer methods (causal_conv1d, gated_delta_rule, ssd_scan, selective_scan)",
    "head counts other than 4 query heads with 4, 2 or 1 KV heads, and head dims other than 8 (12 for MLA values)",
    "query rows that see no key (no variant masks a query's own position; the contract's answer there is zero)",
)
"""Parts of the contract the kit does not check, printed with every report."""


@dataclass(frozen=True)
class CaseResult:
    """One case: where it ran, what it checked, ``status`` (one of :data:`STATUSES`) and why (one line per rank
    and wrong tensor)."""

    world: int
    comm_type: str
    qkv_format: str
    dtype: str
    length: str
    check: str
    variant: str
    status: str
    detail: str = ""

    @property
    def where(self) -> str:
        return f"cp={self.world} {self.comm_type} {self.qkv_format} {self.dtype} {self.length} {self.check}" + \
            (f" [{self.variant}]" if self.variant else "")


@dataclass
class ConformanceReport:
    """Every case of one :func:`~.kit.check_handler` run and what it did not check (``not_checked``: one line each,
    the flags or declarations that left it out, then :data:`NOT_COVERED`)."""

    handler: str
    results: list[CaseResult] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(r.status == "FAIL" for r in self.results) and any(r.status == "PASS" for r in self.results)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def table(self, verbose: bool = False) -> str:
        """Failures (every wrong tensor, per rank), the cases not run, the refusals grouped by reason, the passes
        counted (``verbose``: one line each), what was not checked, the counts."""
        lines = [f"conformance of {self.handler}: {'passed' if self.ok else 'FAILED'}"]
        for status in ("FAIL", "NOT RUN"):
            for r in (r for r in self.results if r.status == status):
                detail = r.detail.splitlines() or [""]
                lines.append(f"  {status:<13} {r.where}" + (f": {detail[0]}" if detail[0] else ""))
                lines += [f"                  {d}" for d in detail[1:]]
        refused = defaultdict(list)
        for r in (r for r in self.results if r.status == "NOT-SUPPORTED"):
            refused[(r.check, r.variant, _reason(r.detail))].append(r)
        for (check, variant, reason), rs in refused.items():
            lines.append(f"  NOT-SUPPORTED {check}" + (f" [{variant}]" if variant else "") +
                         f" in {len(rs)} case{'s' if len(rs) > 1 else ''} ({_dims(rs)}): {reason}")
        passed = [r for r in self.results if r.status == "PASS"]
        if verbose:
            lines += [f"  PASS          {r.where}" for r in passed]
        elif passed:
            lines.append(f"  PASS          {len(passed)} cases ({_dims(passed)})")
        if self.not_checked:
            lines.append("  not checked:")
            lines += [f"    - {line}" for line in self.not_checked]
        lines.append("  " + ", ".join(f"{n} {s}" for s, n in self.counts().items()))
        return "\n".join(lines)


def _reason(detail: str) -> str:
    return detail.split("rank 0: ", 1)[-1].splitlines()[0] if detail else ""


def _dims(results: list[CaseResult]) -> str:
    """The CP sizes, comm types, formats, dtypes and lengths a group of cases spans."""
    parts = []
    for name, key in (("cp", "world"), ("", "comm_type"), ("", "qkv_format"), ("", "dtype"), ("", "length")):
        values = sorted({getattr(r, key) for r in results}, key=str)
        parts.append((f"{name} " if name else "") + ", ".join(str(v) for v in values))
    return "; ".join(parts)


def report_json(report: ConformanceReport) -> str:
    """The report as JSON: the handler, ``ok``, the counts, every case and what was not checked."""
    return json.dumps({"handler": report.handler, "ok": report.ok, "counts": report.counts(),
                       "results": [asdict(r) for r in report.results], "not_checked": report.not_checked}, indent=1)
