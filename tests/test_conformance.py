"""The public conformance kit (cp_handler.testing): correct handlers pass it (ours, the example, a blockwise ring
emulation, a backend with its own layout) and every planted bug fails it, naming the culprit (tests/
conformance_backends.py: each must FAIL, and only report, never hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import commands
import pytest
import torch
from conformance_backends import CULPRITS, PLANTED, BlockwiseRing, Contiguous, GQATrueDivide
from conftest import HANG_GUARD_S

from cp_handler import LocalContextParallelHandler, MagiAttnContextParallelHandler, TEContextParallelHandler
from cp_handler.testing import CHECKS, VARIANTS, check_handler

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{ROOT}"}


def _use_backend_fakes():
    import test_backends_fake

    if test_backends_fake.FAKES not in sys.path:
        test_backends_fake.use_fakes()  # tests/fakes on the path, the CUDA / NCCL requirements lifted


class FakeTE(TEContextParallelHandler):
    """The Transformer Engine handler over the TE fake of tests/fakes (the release it models: 2.20.2)."""

    def __init__(self, **kwargs):
        _use_backend_fakes()
        super().__init__(**kwargs)


class FakeMagi(MagiAttnContextParallelHandler):
    """The MagiAttention handler over its fake (tests/fakes)."""

    def __init__(self, **kwargs):
        _use_backend_fakes()
        super().__init__(**kwargs)


def kit_command(*args):
    """``python -m cp_handler.testing *args`` from the checkout's root (tests/commands.py: without the interpreter's
    start)."""
    return commands.run("cp_handler.testing.__main__", args, env=ENV, timeout=HANG_GUARD_S, cwd=str(ROOT))


def _failures(report) -> str:
    return "\n".join(r.detail for r in report.results if r.status == "FAIL")


def test_transformer_engine_and_magiattention_pass_through_their_fakes():
    """bf16 (TE refuses fp32 under CP). The TE fake models sliding windows for bshd / sbhd only, so the windows run
    there; every case either handler refuses is NOT-SUPPORTED with its reason (e.g. TE: windows with p2p, chunks,
    soft-caps, sinks; Magi: sbhd, windows, MLA)."""
    bf16, windows = [torch.bfloat16], ["window", "window_two_sided"]
    reports = [check_handler(FakeTE, dtypes=bf16, variants=[v for v in VARIANTS if v not in windows],
                             world_sizes=(2, 4), timeout_s=HANG_GUARD_S, progress=False),
               check_handler(FakeTE, dtypes=bf16, variants=windows, formats=["bshd", "sbhd"], checks=["attention"],
                             world_sizes=(2,), lengths=["short"], timeout_s=HANG_GUARD_S, progress=False),
               check_handler(FakeMagi, dtypes=bf16, world_sizes=(2,), timeout_s=HANG_GUARD_S, progress=False)]
    for report in reports:
        counts = report.counts()
        assert report.ok and counts["NOT RUN"] == 0 and counts["PASS"] > 0, report.table()
    te_window = {(r.comm_type, r.status) for r in reports[1].results if r.variant == "window"}
    assert ("all_gather", "PASS") in te_window and ("p2p", "NOT-SUPPORTED") in te_window, reports[1].table()


def test_the_local_handler_passes_every_case():
    """Every comm type, format, dtype, length, check and variant at cp 2; at cp 3 and 4 in float32 (cp 3: odd,
    a2a+p2p left out by the kit's rule); the kit's largest size, cp 8, for the ring and the two-level pattern in
    bfloat16 (a2a+p2p's only run in a dtype other than float32)."""
    reports = [check_handler(LocalContextParallelHandler, world_sizes=(2,), timeout_s=HANG_GUARD_S, progress=False),
               check_handler(LocalContextParallelHandler, world_sizes=(3, 4), dtypes=[torch.float32],
                             timeout_s=HANG_GUARD_S, progress=False),
               check_handler(LocalContextParallelHandler, world_sizes=(8,), comm_types=["p2p", "a2a+p2p"],
                             formats=["bshd", "thd"], dtypes=[torch.bfloat16], lengths=["short"], checks=["attention"],
                             variants=["causal", "window"], timeout_s=HANG_GUARD_S, progress=False)]
    for report in reports:
        counts = report.counts()
        assert report.ok and counts["FAIL"] == counts["NOT RUN"] == counts["NOT-SUPPORTED"] == 0, report.table()
    # per comm type and format: the first dtype's short cases (3 layout checks, every variant, 2 refusal checks)
    # and long cases (no refusal checks), then each further dtype's short cases and its long causal attention
    checks, variants = len(CHECKS) - 3, len(VARIANTS)
    per_format = lambda dtypes: (checks + variants + 2) + (checks + variants) * dtypes + (dtypes - 1)  # noqa: E731
    assert reports[0].counts()["PASS"] == 3 * 3 * per_format(3), reports[0].counts()  # no a2a+p2p at cp 2
    assert reports[1].counts()["PASS"] == (3 + 4) * 3 * per_format(1), reports[1].counts()  # cp 3: no a2a+p2p
    assert reports[2].counts()["PASS"] == 2 * 2 * 2, reports[2].counts()


@pytest.mark.parametrize("handler", list(PLANTED), ids=lambda c: c.__name__)
def test_a_planted_bug_fails_the_kit_and_its_failure_names_the_culprit(handler):
    words, narrowing = PLANTED[handler]
    kwargs = {**dict(world_sizes=(2,), dtypes=[torch.float32], timeout_s=HANG_GUARD_S, progress=False), **narrowing}
    report = check_handler(handler, **kwargs)
    assert not report.ok, report.table()
    assert words in _failures(report) or words in report.table(), report.table()
    assert report.counts()["NOT RUN"] == 0, report.table()  # a crash on every rank: the kit goes on
    named, not_named = CULPRITS.get(handler, ((), ()))
    failures = _failures(report)
    assert all(word in failures for word in named), failures
    assert not any(word in failures for word in not_named), failures


def test_correct_backends_of_other_shapes_pass():
    """A blockwise ring emulation with a log-sum-exp merge, and a backend with its own contiguous layout (thd
    refused at construction): both pass at cp 2 and 3 with the long lengths."""
    for handler, refused in ((BlockwiseRing, {"softcap", "sinks"}), (Contiguous, {"softcap", "sinks"})):
        report = check_handler(handler, world_sizes=(2, 3), dtypes=[torch.float32, torch.bfloat16],
                               timeout_s=HANG_GUARD_S, progress=False)
        assert report.ok, report.table()
        not_supported = {r.variant for r in report.results if r.status == "NOT-SUPPORTED" and r.qkv_format != "thd"}
        assert not_supported == refused, report.table()
    assert all(r.status == "NOT-SUPPORTED" for r in report.results if r.qkv_format == "thd"), report.table()


def test_the_example_backend_passes_and_declares_what_it_does_not_run():
    """examples/custom_backend.py: a third-party backend in one file, selected by config, through the kit."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "custom_backend.py")], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout and "0 FAIL" in done.stdout and "0 NOT RUN" in done.stdout, done.stdout
    refused = [line for line in done.stdout.splitlines() if line.strip().startswith("NOT-SUPPORTED")]
    assert len(refused) == 2 and all("[softcap]" in line or "[sinks]" in line for line in refused), done.stdout
    assert len(EXAMPLES.joinpath("custom_backend.py").read_text().splitlines()) <= 150


def test_the_command_line_takes_a_file_reports_the_culprit_and_what_it_did_not_check(tmp_path):
    """A file path, ``--quick``, the failure lines, the narrowing shown, the JSON, exit status 1."""
    out = tmp_path / "report.json"
    args = ["tests/conformance_backends.py:GQATrueDivide", "--quick", "--formats", "bshd", "--variants", "causal",
            "mha", "--lengths", "short", "--json", str(out)]
    done = kit_command(*args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL          cp=2 all_gather bshd float32 short attention [causal]: every rank: core_attn raised " \
           "TypeError" in done.stdout, done.stdout
    assert "inside the backend's attend: a crash, not a refusal" in done.stdout, done.stdout
    for narrowed in ("formats sbhd, thd: not asked for", "lengths long: not asked for",
                     "cp sizes 3, 4, 5, 6, 7, 8: not asked for", "dtypes float16, float64: not asked for",
                     "comm types p2p, a2a, a2a+p2p: the class does not run them", "the mixer methods"):
        assert narrowed in done.stdout, done.stdout
    assert "cp_handler.testing: cp=2 all_gather bshd float32 short:" in done.stderr, done.stderr  # progress
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["counts"]["FAIL"] > 0 and report["not_checked"], report["counts"]
    assert {r["variant"]: r["status"] for r in report["results"] if r["check"] == "attention"
            and r["dtype"] == "float32"} == {"causal": "FAIL", "mha": "PASS"}, report["results"]


def test_help_explains_every_option_and_the_statuses():
    done = kit_command("--help")
    assert done.returncode == 0, done.stderr
    for word in ("--comm-types", "--formats", "--dtypes", "--lengths", "--variants", "--world-sizes", "--checks",
                 "--quick", "--timeout", "--verbose", "--json", "PASS", "FAIL", "NOT-SUPPORTED", "NOT RUN",
                 "FILE.py:CLASS", "default"):
        assert word in done.stdout, (word, done.stdout)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"check_handler: formats \['bhsd'\] not among"):
        check_handler(LocalContextParallelHandler, formats=["bhsd"])
    with pytest.raises(ValueError, match=r"world_sizes \[1, 9\]: a CP group of the kit has 2 to 8 ranks"):
        check_handler(LocalContextParallelHandler, world_sizes=(1, 9))
    with pytest.raises(ValueError, match=r"check_handler: lengths is empty"):
        check_handler(LocalContextParallelHandler, lengths=[])
    with pytest.raises(TypeError, match=r"handler_cls=<class 'int'> is not a ContextParallelHandler subclass"):
        check_handler(int)
    done = kit_command("no/such/file.py:X")
    assert done.returncode == 2 and "no file 'no/such/file.py'" in done.stderr, done.stderr
    assert GQATrueDivide.cp_comm_types == ("all_gather",)
