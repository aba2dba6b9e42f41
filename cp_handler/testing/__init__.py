"""The public conformance kit of the handler contract: does a backend give the single-process answer?

    from cp_handler.testing import check_handler
    report = check_handler(MyHandler, comm_types=["p2p"], formats=["bshd", "thd"])
    print(report.table()); assert report.ok

or from a shell: ``python -m cp_handler.testing my_package.module:MyHandler`` (exit status 1 on a failed case).
It spawns CPU ranks (gloo) per CP size and checks, against a float64 single-process reference on the same inputs:
dispatch / combine inverse and dispatch's gradient for every format; ``roll_tensor`` values and gradient; RoPE at
global positions; ``core_attn``'s output and the q / k / v (and sinks) gradients for each variant (causal, full,
MHA / GQA / MQA, sliding window, chunks, soft-cap, sinks, MLA value widths) on bshd, sbhd and packed documents
(thd, an empty document included); and that ranks passing different windows, and k / v heads that do not divide
q's, are refused by name on every rank. Each case is PASS, FAIL, NOT-SUPPORTED (the handler refused it by name on
every rank: what it declares it does not run) or NOT RUN. docs/backends.md, "Writing a backend".
"""

from .cases import VARIANTS, Variant
from .kit import CHECKS, CaseResult, ConformanceReport, assert_conforms, check_handler

__all__ = ["CHECKS", "VARIANTS", "CaseResult", "ConformanceReport", "Variant", "assert_conforms", "check_handler"]
