"""``python -m cp_handler.testing MODULE:CLASS`` (or ``FILE.py:CLASS``): the conformance kit from a shell.

Exit status 0 when the handler passed (no case failed, and attention passed for every comm type it ran), 1 when
it did not, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

from ..cli.flag_names import FlagParser
from ..runtime.config import CP_COMM_TYPES, QKV_FORMATS
from .cases import LENGTHS, VARIANTS
from .kit import CHECKS, DTYPES, MAX_WORLD, check_handler
from .report import report_json

QUICK = dict(world_sizes=[2], dtypes=["float32", "bfloat16"])
"""What ``--quick`` narrows (the report lists what it left out)."""
EPILOG = """statuses:
  PASS           the handler gave the reference's answer (forward and backward) within the dtype's tolerance
  FAIL           a wrong tensor (the report names the method, rank, tokens and heads), an error, a call that
                 should have been refused and ran, a refusal outside a refusal point or on some ranks only; also
                 a comm type where every causal attention case was refused
  NOT-SUPPORTED  refused by name (ValueError / NotImplementedError from a raise statement of the backend, not
                 one Python or torch raised from a bug) on every rank at a refusal point: building
                 the handler (check_config, cp_comm_types) or core_attn's pre-flight (unsupported_variant,
                 check_call), before the backend's attend ran
  NOT RUN        a rank died or hung before the case

The report ends with what was not checked: what the options or the class's declarations left out, and the parts
of the contract the kit does not cover. docs/backends.md, "Is it right? The conformance kit"."""


def load_handler(spec: str):
    """The class named by ``MODULE:CLASS`` or ``FILE.py:CLASS`` (a file's folder goes first on ``sys.path``, and
    on ``PYTHONPATH`` for the ranks, and the file is imported under its stem).

    Raises:
        ValueError: no ``:CLASS``; the module or file not found; no such class.
    """
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"handler {spec!r}: expected MODULE:CLASS or FILE.py:CLASS")
    if module.endswith(".py") or os.sep in module:
        if not os.path.isfile(module):
            raise ValueError(f"handler {spec!r}: no file {module!r}")
        folder = os.path.dirname(os.path.abspath(module))
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
        module = os.path.splitext(os.path.basename(module))[0]
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise ValueError(f"handler {spec!r}: cannot import {module!r}: {err}") from err
    except AttributeError as err:
        raise ValueError(f"handler {spec!r}: {module!r} has no {name!r}") from err


def main(argv: list[str] | None = None) -> int:
    p = FlagParser(prog="python -m cp_handler.testing", description=__doc__, epilog=EPILOG,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("handler", help="MODULE:CLASS (importable) or FILE.py:CLASS of a ContextParallelHandler subclass")
    p.add_argument("--comm-types", nargs="+", choices=CP_COMM_TYPES, default=None,
                   help="the cp_comm_type values to run (default: every one the class declares in cp_comm_types)")
    p.add_argument("--formats", nargs="+", choices=QKV_FORMATS, default=list(QKV_FORMATS),
                   help="qkv_format values (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                   help="input dtypes; the refusal checks run in the first, long lengths every check there and "
                        "attention's first variant in the others (default: float32 "
                        "bfloat16 float16)")
    p.add_argument("--lengths", nargs="+", choices=LENGTHS, default=list(LENGTHS),
                   help="length profiles: short (8 * cp tokens a row; thd documents 13, 0, 6, 21) and long (262 "
                        "tokens a rank and row, rows past 512 tokens, odd zigzag chunks; thd several hundred a rank) "
                        "(default: %(default)s)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="attention variants (default: all: %(default)s)")
    p.add_argument("--world-sizes", nargs="+", type=int, default=None,
                   help=f"CP sizes, 2 to {MAX_WORLD}, one start of the ranks each (default: 2 4)")
    p.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS),
                   help="checks (default: all: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a first look: cp 2 and float32 / bfloat16 only, unless --world-sizes / --dtypes say "
                        "otherwise (the report lists what it left out)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds the ranks wait in a collective before a hang is a failure (default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="one line per passing case too")
    p.add_argument("--json", metavar="FILE", help="also write the report (every case, what was not checked) as JSON")
    args = p.parse_args(argv)
    try:
        handler_cls = load_handler(args.handler)
    except ValueError as err:
        p.error(str(err))
    world_sizes = args.world_sizes or (QUICK["world_sizes"] if args.quick else [2, 4])
    dtypes = args.dtypes or (QUICK["dtypes"] if args.quick else ["float32", "bfloat16", "float16"])
    try:
        report = check_handler(handler_cls, comm_types=args.comm_types, formats=args.formats,
                               dtypes=[getattr(torch, d) for d in dtypes], variants=args.variants,
                               world_sizes=world_sizes, checks=args.checks, lengths=args.lengths,
                               timeout_s=args.timeout)
    except (TypeError, ValueError) as err:  # an argument the kit refuses (named)
        p.error(str(err))
    print(report.table(verbose=args.verbose))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report_json(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
