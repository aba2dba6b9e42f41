"""The public conformance kit of the handler contract: does a backend give the single-process answer?

    from cp_handler.testing import check_handler
    report = check_handler(MyHandler, comm_types=["p2p"], formats=["bshd", "thd"])
    print(report.table()); assert report.ok

or from a shell: ``python -m cp_handler.testing my_package.module:MyHandler`` (or ``path/to/file.py:MyHandler``;
exit status 1 when it did not pass; ``--quick`` for a first look, ``--help`` for every option). It starts CPU ranks
(gloo) per CP size and checks every public method of the contract, forward and backward, against a float64
single-process reference on the same inputs (:mod:`.checks`): ``dispatch`` and ``combine``, ``roll_tensor``, the
rotary methods each alone, ``core_attn`` for each attention variant (:data:`VARIANTS`) called twice on one handler;
on bshd, sbhd and packed documents (thd), short and long sequences (:data:`~.cases.LENGTHS`), in float32, bfloat16
and float16 (the output in the input's dtype); and that calls the contract refuses are refused by name on every
rank. Each case is PASS, FAIL, NOT-SUPPORTED (refused at a refusal point, by name, on every rank) or NOT RUN; the
report names the method, rank, tokens and heads of every wrong tensor, and says what it did not check.
docs/backends.md, "Is it right? The conformance kit".

Layer 8 (applications, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from .cases import LENGTHS, VARIANTS, Variant
from .kit import CHECKS, assert_conforms, check_handler
from .report import CaseResult, ConformanceReport, report_json

__all__ = ["CHECKS", "LENGTHS", "VARIANTS", "CaseResult", "ConformanceReport", "Variant", "assert_conforms",
           "check_handler", "report_json"]
