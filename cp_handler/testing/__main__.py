"""``python -m cp_handler.testing MODULE:CLASS``: the conformance kit from a shell (exit 1 when a case fails)."""

from __future__ import annotations

import importlib
import sys

import torch

from ..cli.flag_names import FlagParser
from ..config import CP_COMM_TYPES, QKV_FORMATS
from .cases import VARIANTS
from .kit import CHECKS, check_handler, report_json


def main(argv: list[str] | None = None) -> int:
    p = FlagParser(prog="python -m cp_handler.testing", description=__doc__)
    p.add_argument("handler", help="MODULE:CLASS of a ContextParallelHandler subclass (MODULE importable)")
    p.add_argument("--comm-types", nargs="+", choices=CP_COMM_TYPES, default=list(CP_COMM_TYPES))
    p.add_argument("--formats", nargs="+", choices=QKV_FORMATS, default=list(QKV_FORMATS))
    p.add_argument("--dtypes", nargs="+", choices=["float32", "float64", "bfloat16", "float16"], default=["float32"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    p.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    p.add_argument("--json", metavar="FILE", help="also write every case as JSON")
    args = p.parse_args(argv)
    module, sep, name = args.handler.partition(":")
    if not sep or not name:
        p.error(f"handler {args.handler!r}: expected MODULE:CLASS")
    try:
        handler_cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        p.error(f"handler {args.handler!r}: {err}")
    try:
        report = check_handler(handler_cls, comm_types=args.comm_types, formats=args.formats,
                               dtypes=[getattr(torch, d) for d in args.dtypes], variants=args.variants,
                               world_sizes=args.world_sizes, checks=args.checks)
    except (TypeError, ValueError) as err:  # an argument the kit refuses (named)
        p.error(str(err))
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(report_json(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
