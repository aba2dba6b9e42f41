"""The public conformance kit (cp_handler.testing): our handlers and the example backend pass it, and it fails
handlers that are wrong (negative controls: each must fail the case it breaks, and only report, never hang)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S

from cp_handler import LocalContextParallelHandler, MagiAttnContextParallelHandler, TEContextParallelHandler
from cp_handler.testing import CHECKS, VARIANTS, check_handler

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


class LocalRollWithoutHalo(LocalContextParallelHandler):
    """Wrong: rolls each rank's shard alone (the token that crosses a rank boundary is lost)."""

    def roll_tensor(self, tensor, shifts=-1, dims=-1):
        rolled = torch.roll(tensor, shifts, dims)
        return rolled, rolled.sum()


class LocalIgnoringWindows(LocalContextParallelHandler):
    """Wrong: drops the sliding window (attends to every earlier key)."""

    def attend(self, call):
        import dataclasses

        return super().attend(dataclasses.replace(call, mask=dataclasses.replace(call.mask, window=None)))


class LocalWithoutAgreement(LocalContextParallelHandler):
    """Wrong for the disagreement check: never compares the ranks' calls."""

    def __init__(self, **kwargs):
        super().__init__(check_ranks=False, **kwargs)


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


def test_transformer_engine_and_magiattention_pass_through_their_fakes():
    """bf16 (TE refuses fp32 under CP). The TE fake models sliding windows for bshd / sbhd only, so the window
    runs there; every case either handler refuses is NOT-SUPPORTED with its reason (e.g. TE: windows with p2p,
    chunks, soft-caps, sinks; Magi: sbhd, windows, MLA)."""
    bf16, no_window = [torch.bfloat16], [v for v in VARIANTS if v != "window"]
    reports = [check_handler(FakeTE, dtypes=bf16, variants=no_window, world_sizes=(2, 4), timeout_s=HANG_GUARD_S),
               check_handler(FakeTE, dtypes=bf16, variants=["window"], formats=["bshd", "sbhd"],
                             checks=["attention"], world_sizes=(2,), timeout_s=HANG_GUARD_S),
               check_handler(FakeMagi, dtypes=bf16, world_sizes=(2,), timeout_s=HANG_GUARD_S)]
    for report in reports:
        counts = report.counts()
        assert report.ok and counts["NOT RUN"] == 0 and counts["PASS"] > 0, report.table()
    te_window = {(r.comm_type, r.status) for r in reports[1].results}
    assert ("all_gather", "PASS") in te_window and ("p2p", "NOT-SUPPORTED") in te_window, reports[1].table()


def test_the_local_handler_passes_every_case():
    report = check_handler(LocalContextParallelHandler, world_sizes=(2, 4), timeout_s=HANG_GUARD_S)
    assert report.ok, report.table()
    counts = report.counts()
    assert counts["FAIL"] == counts["NOT RUN"] == counts["NOT-SUPPORTED"] == 0, report.table()
    # every comm type (a2a+p2p at cp 4 only), format and check ran
    per_world = {2: 3 * 3 * (len(CHECKS) - 1 + len(VARIANTS)), 4: 4 * 3 * (len(CHECKS) - 1 + len(VARIANTS))}
    assert counts["PASS"] == sum(per_world.values()), counts


@pytest.mark.parametrize("handler, checks, broken", [
    (LocalRollWithoutHalo, ["roll"], "roll"),
    (LocalIgnoringWindows, ["attention"], "attention [window]"),
    (LocalWithoutAgreement, ["disagreement"], "disagreement"),
])
def test_a_wrong_handler_fails_the_case_it_breaks(handler, checks, broken):
    report = check_handler(handler, comm_types=["all_gather"], formats=["bshd", "thd"], checks=checks,
                           world_sizes=(2,), variants=["causal", "window"], timeout_s=HANG_GUARD_S)
    failed = {f"{r.check} [{r.variant}]" if r.variant else r.check for r in report.results if r.status == "FAIL"}
    assert not report.ok and failed == {broken}, report.table()
    assert "PASS" not in {r.status for r in report.results if (r.check == broken or broken.startswith(r.check))
                          and (not r.variant or r.variant in broken)}


def test_the_example_backend_passes_and_declares_what_it_does_not_run():
    """examples/custom_backend.py: a third-party backend in one file, selected by config, through the kit's CLI."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "custom_backend.py")], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 FAIL" in done.stdout and "0 NOT RUN" in done.stdout, done.stdout
    refused = [line for line in done.stdout.splitlines() if "NOT-SUPPORTED" in line and "attention" in line]
    assert refused and all("[softcap]" in line or "[sinks]" in line for line in refused), done.stdout
    assert len(EXAMPLES.joinpath("custom_backend.py").read_text().splitlines()) <= 150


def test_the_command_line_exits_non_zero_on_a_wrong_answer():
    args = [sys.executable, "-m", "cp_handler.testing", "test_conformance:LocalIgnoringWindows", "--comm-types", "p2p",
            "--formats", "bshd", "--world-sizes", "2", "--checks", "attention", "--variants", "window"]
    env = {**os.environ, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{ROOT}"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT, env=env)
    assert done.returncode == 1 and "FAIL          cp=2 p2p bshd float32 attention [window]" in done.stdout, \
        done.stdout + done.stderr


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"check_handler: formats \['bhsd'\] not among"):
        check_handler(LocalContextParallelHandler, formats=["bhsd"])
    with pytest.raises(ValueError, match=r"world_sizes \[1\]: a CP group has at least 2 ranks"):
        check_handler(LocalContextParallelHandler, world_sizes=(1,))
    with pytest.raises(TypeError, match=r"handler_cls=<class 'int'> is not a ContextParallelHandler subclass"):
        check_handler(int)
