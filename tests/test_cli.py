"""cp-train end to end: parity with one process (per step, any length; a real bug fails it), flag
rules checked before any rank starts, data errors in one line, a crashed or frozen rank stops the
run, atomic metrics, progress lines, thd packing of several documents per sequence."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import commands
import pytest
import torch
from conftest import HANG_GUARD_S

from cp_handler.cli.args import build_parser, parse

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
"""torchrun on a free port (--standalone): test files run side by side (make test's workers)."""

SMALL = ["--steps", "6", "--seq-len", "128", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--max-corpus-bytes", "2000000"]


PLUGINS = {"CP_HANDLER_PLUGINS": "faulty_backends",
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "plugins"),
                                          os.environ.get("PYTHONPATH", "")])}
"""Loads tests/plugins/faulty_backends.py (faulty backends for the failure tests) into cp-train's ranks."""


def cp_train(*flags, env=None):
    """cp-train with ``flags`` and this environment updated by ``env``, as a shell runs it, less the interpreter's
    start (tests/commands.py)."""
    return commands.run("cp_handler.cli.train", flags, {**os.environ, **(env or {})}, timeout=HANG_GUARD_S)


def cp_generate(*flags, env=None):
    """cp-generate with ``flags``, as :func:`cp_train` runs cp-train."""
    return commands.run("cp_handler.cli.generate", flags, {**os.environ, **(env or {})}, timeout=HANG_GUARD_S)


def cp_train_process(*flags, env=None):
    """cp-train as its own interpreter (``python -m cp_handler.cli.train``): the entry point itself."""
    return subprocess.run(
        [sys.executable, "-m", "cp_handler.cli.train", *flags], capture_output=True, text=True,
        timeout=HANG_GUARD_S, env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("layout", [["--nproc", "2", "--cp-size", "2"], ["--nproc", "4", "--cp-size", "2"]])
def test_check_parity_passes_and_metrics_written(tmp_path, layout):
    out = tmp_path / "metrics.json"
    result = cp_train_process(*layout, *SMALL, "--check-parity", "--metrics-out", str(out))  # the entry point
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["cp_size"] == 2 and metrics["world_size"] == int(layout[1])
    assert len(metrics["steps"]) == 6 and metrics["parity"]["passed"]
    assert len(metrics["peak_memory_bytes_per_rank"]) == metrics["world_size"]
    assert metrics["steps"][-1]["loss"] < metrics["steps"][0]["loss"]


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_thd_packing_parity_on_small_documents(tmp_path, comm_type):
    rng = random.Random(0)
    for i in range(300):  # lengths 1..600 bytes: several documents in every 128-token sequence
        (tmp_path / f"doc{i:03d}.txt").write_bytes(bytes(rng.randrange(32, 127) for _ in range(rng.choice(
            [1, 2, 5, 30, 90, 600]))))
    result = cp_train("--nproc", "2", "--packing", "thd", "--data", str(tmp_path), "--cp-comm-type", comm_type,
                      *SMALL[:-2], "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "packing thd" in result.stderr and "parity passed" in result.stderr


def test_eval_at_another_cp_degree(tmp_path):
    out = tmp_path / "metrics.json"
    result = cp_train("--nproc", "4", "--cp-size", "2", "--eval-cp-size", "4", "--eval-every", "3",
                      "--check-eval-cp", *SMALL, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval-cp check passed" in result.stderr
    metrics = json.loads(out.read_text())
    assert [r["step"] for r in metrics["steps"] if "eval_loss" in r] == [3, 6]  # counted from 1
    assert metrics["eval_cp_check"]["passed"] and metrics["eval_cp_check"]["eval_cp_size"] == 4


def test_dynamic_cp_parity(tmp_path):
    out = tmp_path / "metrics.json"
    result = cp_train("--nproc", "4", "--dynamic-cp", "--max-seqlen-per-rank", "256", "--seq-len", "1024",
                      "--steps", "3", "--hidden-size", "64", "--ffn-hidden-size", "128", "--max-corpus-bytes",
                      "2000000", "--check-parity", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dynamic CP over 4 ranks" in result.stderr and "parity passed" in result.stderr
    assert json.loads(out.read_text())["parity"]["passed"]


def test_moe_expert_parallel_parity_and_layout():
    result = cp_train("--nproc", "4", "--cp-size", "4", "--moe-experts", "8", "--expert-parallel-size", "4",
                      *SMALL, "--check-parity", "--print-layout")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp stage 0: experts   [edp][ep][tp] = [[[0], [1], [2], [3]]]" in result.stderr
    assert "8 experts over ep 4" in result.stderr and "parity passed" in result.stderr


def test_recompute_is_bitwise_the_same_training(tmp_path):
    """--recompute re-runs each layer (its ring attention included) in the backward: on CPU the same
    operations in the same order, so the loss curve is bitwise the one without it; and it passes
    --check-parity with MoE layers sharded over ep 2 (the all-to-alls recomputed too)."""
    curves = []
    for name, extra in (("plain", []), ("recompute", ["--recompute", "--check-parity"])):
        out = tmp_path / f"{name}.json"
        result = cp_train("--nproc", "2", *SMALL, "--steps", "3", *extra, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        curves.append([r["loss"] for r in json.loads(out.read_text())["steps"]])
    assert curves[0] == curves[1] and "parity passed" in result.stderr
    result = cp_train("--nproc", "2", "--moe-experts", "4", "--expert-parallel-size", "2", *SMALL, "--steps", "2",
                      "--recompute", "--check-parity")
    assert result.returncode == 0 and "parity passed" in result.stderr, result.stderr[-3000:]


def test_micro_batches_accumulate_to_the_same_training(tmp_path):
    """--micro-batch-size: dp 2 x cp 2, each replica's 2 sequences one at a time; the curve equals the
    one-pass run's within parity's tolerance (only sums are reordered; the no-micro-batch path shares no
    row selection with it), and --check-parity passes; MoE over ep 2 with 2 micro-batches passes parity
    (its reference follows the same micro-batches: the load-balancing loss is per micro-batch)."""
    curves = []
    for name, extra in (("one", []), ("micro", ["--micro-batch-size", "1", "--check-parity"])):
        out = tmp_path / f"{name}.json"
        result = cp_train("--nproc", "4", "--cp-size", "2", "--batch-size", "2", *SMALL, "--steps", "3", *extra,
                          "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        curves.append([r["loss"] for r in json.loads(out.read_text())["steps"]])
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-5, atol=0)
    assert "parity passed" in result.stderr
    result = cp_train("--nproc", "2", "--moe-experts", "4", "--expert-parallel-size", "2", "--batch-size", "4",
                      "--micro-batch-size", "2", *SMALL, "--steps", "2", "--check-parity")
    assert result.returncode == 0 and "parity passed" in result.stderr, result.stderr[-3000:]


def test_hierarchical_parity_and_group_log():
    result = cp_train("--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "2",
                      *SMALL, "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS level 0 (size 2): [[0, 1], [2, 3]]; " \
           "level 1 (size 2): [[0, 2], [1, 3]]" in result.stderr
    assert "parity passed" in result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc", "2", "--seq-len", "1001"], "--seq-len 1001 is not divisible by 2 * --cp-size = 4"),
        (["--nproc", "3", "--cp-size", "2"], "--nproc 3 is not a multiple of --cp-size 2"),
        (["--cp-size", "4"], "--cp-size 4 needs at least 4 ranks, but --nproc defaults to 1 outside torchrun: "
                             "add --nproc 4"),
        (["--nproc", "2", "--cp-comm-type", "ring"], "--cp-comm-type ring is not a valid communication type"),
        (["--nproc", "2", "--backend", "nope"], "--backend nope is not registered"),
        (["--nproc", "2", "--num-heads", "3"], "--hidden-size 128 must be divisible by --num-heads 3 (or set "
                                               "--kv-channels)"),
        (["--nproc", "2", "--cp-comm-type", "p2p,p2p,p2p"],
         "--cp-comm-type has 3 entries but the model has --num-layers 2"),
        (["--nproc", "4", "--eval-cp-size", "3"], "--nproc 4 is not a multiple of --eval-cp-size 3"),
        (["--nproc", "2", "--cp-size", "0"], "--cp-size 0 must be >= 1"),
        (["--nproc", "4", "--cp-size", "2", "--eval-cp-size", "0"], "--eval-cp-size 0 must be >= 1"),
        (["--nproc", "0"], "--nproc 0 must be >= 1"),
        (["--nproc", "2", "--timeout", "0"], "--timeout 0.0 must be a finite number > 0"),
        (["--nproc", "2", "--timeout", "nan"], "--timeout nan must be a finite number > 0"),
        (["--nproc", "2", "--lr", "nan"], "--lr nan must be a finite number > 0"),
        (["--nproc", "2", "--lr", "inf"], "--lr inf must be a finite number > 0"),
        (["--nproc", "2", "--rotary-base", "0"], "--rotary-base 0.0 must be a finite number > 0"),
        (["--nproc", "2", "--clip-grad", "nan"], "--clip-grad nan must be a finite number >= 0"),
        (["--nproc", "2", "--micro-batch-size", "3"], "--micro-batch-size 3 must divide --batch-size 2"),
        (["--nproc", "2", "--dynamic-cp", "--max-seqlen-per-rank", "256", "--micro-batch-size", "1"],
         "--micro-batch-size 1: --dynamic-cp schedules its own micro-batches"),
        (["--nproc", "2", "--lr-warmup-steps", "-1"], "--lr-warmup-steps -1 must be >= 0"),
        (["--nproc", "2", "--min-lr", "1e-4"], "--min-lr 0.0001 needs --lr-decay-style linear or cosine"),
        (["--nproc", "2", "--lr-decay-steps", "10"], "--lr-decay-steps 10 needs --lr-decay-style linear or cosine"),
        (["--nproc", "2", "--lr-decay-style", "cosine", "--lr-warmup-steps", "60"],
         "--lr-decay-steps 50 must be > --lr-warmup-steps 60 (the decay starts after the warm-up; --lr-decay-steps "
         "defaults to --steps)"),
        (["--nproc", "2", "--lr-decay-style", "linear", "--min-lr", "1"], "--min-lr 1.0 must be <= --lr 0.003"),
        (["--nproc", "2", "--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff -1.0 must be a finite number >= 0"),
        (["--nproc", "2", "--batch-size", "-1"], "--batch-size -1 must be >= 1"),
        (["--nproc", "2", "--data", "/no/such/place"], "--data /no/such/place: no such file or folder"),
        (["--nproc", "2", "--hf-config", "/tmp"], "--hf-config /tmp: no config.json in it"),
        (["--nproc", "4", "--cp-size", "2", "--eval-cp-size", "4", "--seq-len", "100"],
         "--seq-len 100 is not divisible by 2 * --eval-cp-size = 8"),
        (["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "2", "--eval-cp-size", "2"],
         "--cp-comm-type a2a+p2p needs --eval-hierarchical-cp-sizes"),
        (["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "3"],
         "--hierarchical-cp-sizes 2 3 multiply to 6, but --cp-size 4"),
        (["--nproc", "4", "--dynamic-cp"], "--dynamic-cp needs --max-seqlen-per-rank N"),
        (["--nproc", "2", "--dynamic-cp", "--max-seqlen-per-rank", "100", "--seq-len", "1024"],
         "a sequence of 1024 tokens does not fit: --max-seqlen-per-rank 100 on at most 2 ranks"),
        (["--nproc", "4", "--dynamic-cp", "--max-seqlen-per-rank", "512", "--cp-size", "2"], "drop --cp-size"),
        (["--nproc", "4", "--dynamic-cp", "--max-seqlen-per-rank", "512", "--min-cp-size", "3"],
         "--min-cp-size 3 must be one of the group sizes [1, 2, 4]"),
        (["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "3"],
         "--hierarchical-cp-sizes 2 3 multiply to 6, but --cp-size 4"),
        (["--nproc", "4", "--hierarchical-cp-sizes", "2", "2"],
         "--hierarchical-cp-sizes 2 2 is used only by a hierarchical --cp-comm-type (a2a+p2p) or by 'auto' (which may "
         "pick one); --cp-comm-type p2p has none: drop it"),
        (["--nproc", "4", "--cp-size", "2", "--moe-experts", "8", "--expert-parallel-size", "8"],
         "--expert-parallel-size 8 must divide dp * cp = 2 * 2 = 4"),
        (["--nproc", "4", "--moe-experts", "6", "--expert-parallel-size", "4"],
         "--moe-experts 6 must be a multiple of --expert-parallel-size 4"),
        (["--nproc", "2", "--expert-parallel-size", "2"], "--expert-parallel-size 2 needs --moe-experts E"),
        (["--nproc", "2", "--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 must lie in"),
        (["--nproc", "2", "--layer-pattern", "LAX", "--num-layers", "3"], "--layer-pattern 'LAX': letters A"),
        (["--nproc", "2", "--layer-pattern", "LLA"], "its length dividing --num-layers 2"),
        (["--nproc", "2", "--loss-chunk-tokens", "-1"], "--loss-chunk-tokens -1 must be >= 0"),
    ],
)
def test_bad_flags_exit_before_training(flags, message, monkeypatch):
    """Checked in the launcher (``parse``), before any rank exists; every error names the flags typed,
    not the library's field names."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse(flags)
    assert message in str(exit_info.value)
    for field in ("context_parallel_size", "hierarchical_context_parallel_sizes", "seq_len", "num_attention_heads",
                  "kv_channels", "world size", "moe_router_topk", "max_seqlen_per_dp_cp_rank"):
        assert field not in str(exit_info.value), str(exit_info.value)


@pytest.mark.parametrize("flags", [
    ["--nproc", "4", "--cp-comm-type", "a2a", "--num-heads", "6", "--num-kv-heads", "3", "--hidden-size", "96"],
    ["--nproc", "4", "--cp-size", "2", "--eval-cp-size", "4", "--cp-comm-type", "a2a", "--num-heads", "6",
     "--num-kv-heads", "6", "--hidden-size", "96"],
    ["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "2", "--num-heads", "3",
     "--num-kv-heads", "3", "--hidden-size", "96"],
])
def test_heads_the_a2a_size_does_not_split_are_accepted(flags, monkeypatch):
    """Heads an all-to-all size does not divide (once refused here) run padded with the local backend
    (cp_handler.ops.ulysses.a2a_head_plan; exactness: tests/test_a2a_uneven_heads.py)."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config, _ = parse(flags)
    assert config.attn_shape.num_heads == int(flags[flags.index("--num-heads") + 1])


def test_a2a_parity_with_heads_the_cp_size_does_not_split():
    """3 heads over an a2a of 2 ranks (padded to 4 heads, 2 per rank): trains with parity."""
    result = cp_train("--nproc", "2", "--cp-comm-type", "a2a", *SMALL, "--num-heads", "3", "--num-kv-heads", "3",
                      "--hidden-size", "96", "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr


def test_help_shows_every_default_and_the_groups():
    text = build_parser().format_help()
    for group in ("layout (ranks and groups):", "context parallelism:", "model:", "data:", "training:", "checks:",
                  "output:"):
        assert group in text
    for default in ("(default: p2p; a2a with --deterministic)", "(default: 512)", "(default: 0.003)",
                    "(default: 300.0)", "(default: auto)"):
        assert default in " ".join(text.split()), default
    assert "same parameters" in text and "loss curves" not in text  # --check-parity as it works today


def test_binary_data_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cases = {"zeros.bin": bytes(4096), "latin1.txt": "caf\xe9 ".encode("latin-1") * 500,
             "controls.txt": bytes(range(1, 32)) * 200}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(SystemExit, match=rf"--data: {re.escape(str(path))} is not text"):
            parse(["--data", str(path), "--seq-len", "8"])
    text = tmp_path / "ok.txt"
    text.write_text("d\u00e9j\u00e0 vu\n\tok\n" * 500, encoding="utf-8")
    parse(["--data", str(text), "--seq-len", "8"])


def test_data_errors_exit_before_any_rank(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 100)
    cases = [(["--data", str(empty)], f"--data ['{empty}']: no files found"),
             (["--data", str(tiny), "--seq-len", "64"],
              f"--data {tiny} has 101 tokens (--max-corpus-bytes 33554432): too few for two sequences of --seq-len 64"),
             (["--data", str(tiny), "--seq-len", "8", "--eval-every", "1", "--eval-batches", "3"],
              "--eval-batches 3 x 2 sequences need 6 held-out sequences")]
    for flags, message in cases:
        result = cp_train("--nproc", "2", *flags)
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
        assert "cp-train: world" not in result.stderr
    result = cp_train("--nproc", "2", "--data", str(tiny), "--seq-len", "8", "--steps", "2", "--hidden-size", "32",
                      "--ffn-hidden-size", "64")  # evaluation off: the small held-out split is no error
    assert result.returncode == 0, result.stderr[-2000:]


def test_check_parity_holds_at_any_length_and_catches_bugs_its_reference_cannot_share():
    """Each step against one process from the same parameters, computed with no cp_handler code
    (cp_handler.training.reference): 200 correct steps pass; a RoPE position off by one on rank 1 fails
    at once, and so does a bug present at every cp (attention scaled by 1.001), which the old reference
    (the same handler at cp=1) shared and passed."""
    tiny = ["--seq-len", "64", "--hidden-size", "32", "--ffn-hidden-size", "64", "--max-corpus-bytes", "2000000"]
    result = cp_train("--nproc", "2", "--steps", "200", *tiny, "--check-parity")
    assert result.returncode == 0 and "parity passed: each of 200 steps" in result.stderr, result.stderr[-2000:]
    for backend in ("rope_bug", "soft_bug"):
        result = cp_train("--nproc", "2", "--steps", "3", *tiny, "--check-parity", "--backend", backend, env=PLUGINS)
        assert result.returncode == 1 and "parity FAILED" in result.stderr, (backend, result.stderr[-2000:])


def test_frozen_rank_ends_the_job_naming_it():
    result = cp_train("--nproc", "2", "--timeout", "8", *SMALL, "--backend", "freeze_rank", env=PLUGINS)
    assert result.returncode != 0
    assert "rank 1 made no progress for 8 s (--timeout); it was killed and all ranks stopped." in result.stderr


def test_metrics_atomic_progress_lines_and_thd_documents(tmp_path):
    out = tmp_path / "m.json"
    out.write_text('{"previous": true}')
    result = cp_train("--nproc", "2", "--packing", "thd", *SMALL, "--log-every", "2", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"cp-train: metrics written to {out}" in result.stderr and json.loads(out.read_text())["steps"]
    assert [line for line in result.stderr.splitlines() if line.startswith("cp-train: step ")][-1].startswith(
        "cp-train: step 6/6 loss")
    assert "\r" not in result.stderr  # no progress bar redrawn into a file
    documents = re.search(r"thd packs ([\d.]+) documents per sequence", result.stderr)
    assert documents and float(documents.group(1)) >= 4  # documents of at most seq_len // 4 tokens
    assert not list(tmp_path.glob(".metrics-*"))


def test_metrics_write_keeps_the_old_file_when_writing_fails(tmp_path):
    from cp_handler.cli.common import write_json_atomically

    out = tmp_path / "m.json"
    write_json_atomically(str(out), {"step": 1})
    with pytest.raises(TypeError):
        write_json_atomically(str(out), {"bad": object()})
    assert json.loads(out.read_text()) == {"step": 1} and not list(tmp_path.glob(".metrics-*"))


def test_one_backend_line_per_job_under_torchrun():
    result = subprocess.run(
        [*TORCHRUN, "-m", "cp_handler.cli.train",
         "--steps", "2", "--seq-len", "64", "--hidden-size", "32", "--ffn-hidden-size", "64"],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("--backend auto picked") == 1


def test_crashed_rank_stops_every_rank():
    result = cp_train("--nproc", "2", *SMALL, "--backend", "fail_rank", env=PLUGINS)
    assert result.returncode != 0
    assert "rank 1 failed; all ranks stopped" in result.stderr
    assert "injected failure on rank 1" in result.stderr


def test_root_failure_is_the_cause_not_the_peer_that_lost_its_connection():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from cp_handler.runtime.launch import root_failure

    def failure(rank, message, timestamp):
        f = ProcessFailure.__new__(ProcessFailure)
        f.local_rank, f.pid, f.exitcode, f.error_file = rank, 0, 1, ""
        f.message, f.timestamp = {"message": message, "extraInfo": {"py_callstack": message}}, timestamp
        return f

    lost = "torch.distributed.DistBackendError: ... typically caused by a remote worker crashing"
    cause = "RuntimeError: injected failure on rank 1"
    assert root_failure({0: failure(0, lost, 10), 1: failure(1, cause, 11)})[0] == 1  # recorded later, still the cause
    assert root_failure({0: failure(0, cause, 12), 1: failure(1, cause, 11)})[0] == 1  # the earliest cause
    assert root_failure({0: failure(0, lost, 12), 1: failure(1, lost, 11)})[0] == 1  # all lost: the earliest


def test_non_finite_loss_stops_the_run_and_fails_parity():
    """A NaN loss stops the run naming the step (it trained on for 2 more steps with parity "passed"
    before: Python's max() skips NaN); parity_result fails on any non-finite value."""
    from cp_handler.training.parity import parity_result

    result = cp_train("--nproc", "2", *SMALL, "--backend", "nan_bug", "--check-parity", env=PLUGINS)
    assert result.returncode != 0 and "step 1: the loss is nan; the run stops" in result.stderr, result.stderr[-2000:]
    good = {"step": 1, "loss": 5.5, "reference_loss": 5.5, "grad_rel_diff": 0.0, "grad_norm": 1.0,
            "reference_grad_norm": 1.0}
    assert parity_result([good], "float32")["passed"]
    nan = dict.fromkeys(good, float("nan"))
    assert not parity_result([good, nan], "float32")["passed"]
    assert not parity_result([good, {**good, "grad_norm": 0.5}], "float32")["passed"]  # another global norm
    assert not parity_result([{**good, "reference_grad_norm": 0.0}], "float32")["passed"]  # not a division by 0


def _silent_listener():
    """A socket that accepts connections and never answers (the port of a hung program)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def test_startup_obeys_timeout_and_a_port_in_use_is_named():
    """Under torchrun (RANK / WORLD_SIZE set), a rendezvous that never completes ends after --timeout
    (it ran on past 120 s before) and a MASTER_PORT already in use is one clear line."""
    listener = _silent_listener()
    port = str(listener.getsockname()[1])
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1"}
    try:
        result = cp_train("--timeout", "5", *SMALL, env={**base, "RANK": "1"})
        assert result.returncode == 1, result.stderr[-2000:]
        assert f"rank 1 could not join the process group in 5 s (--timeout): the rendezvous at MASTER_ADDR:" \
               f"MASTER_PORT = 127.0.0.1:{port} did not complete" in result.stderr
        result = cp_train("--timeout", "5", *SMALL, env={**base, "RANK": "0"})
        assert result.returncode == 1 and f"127.0.0.1:{port}: the port is already in use" in result.stderr, \
            result.stderr[-2000:]
        assert "Traceback" not in result.stderr
    finally:
        listener.close()


def test_metrics_out_unwritable_before_spawn_and_a_full_disk_named(tmp_path, monkeypatch, capsys):
    """--metrics-out that cannot be written is refused before any rank starts; a failed write after
    training (a full disk) names the file and keeps the previous one."""
    import cp_handler.cli.common as common
    import cp_handler.cli.train as train_cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit, match=rf"--metrics-out {re.escape(str(blocker))}/m.json: cannot write in"):
        parse(["--metrics-out", str(blocker / "m.json")])
    out = tmp_path / "m.json"
    out.write_text('{"previous": true}')

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    fake = {"steps": [{"loss": 1.0}], "tokens_per_s_mean": 1.0}
    monkeypatch.setattr(train_cli, "run_training", lambda config: fake)
    monkeypatch.setattr(common, "write_json_atomically", disk_full)
    assert train_cli.main(["--metrics-out", str(out), "--steps", "1"]) == 1
    assert json.loads(out.read_text()) == {"previous": True}
    assert f"could not write --metrics-out {out}: No space left on device; the previous file" in capsys.readouterr().err


def test_no_prefix_of_a_flag_is_taken_for_it_and_the_closest_flag_is_named(monkeypatch, capsys):
    """argparse's prefix matching is off (``--step 5`` was taken as ``--steps 5``, ``--seq`` as ``--seq-len``): a
    flag spelled short or wrong is refused, naming the one meant; the rule holds before any other error."""
    from cp_handler.cli.flag_names import closest_flag

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert build_parser().allow_abbrev is False
    cases = [(["--step", "5"], "unrecognized arguments: --step (did you mean --steps?)"),
             (["--seq=128", "--steps", "2"], "unrecognized arguments: --seq=128 (did you mean --seq-len?)"),
             (["--stpes", "5", "--lrr", "1"], "unrecognized arguments: --stpes --lrr (did you mean --steps for "
                                              "--stpes, --lr for --lrr?)"),
             (["--cp-size", "0", "--bogus-flag"], "unrecognized arguments: --bogus-flag\n"),  # no guess, and first
             (["--steps", "2", "stray"], "unrecognized arguments: stray\n")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            parse(flags)
        assert exit_info.value.code == 2
        assert f"cp-train: error: {message}" in capsys.readouterr().err + "\n"
    known = ["--save", "--save-every", "--seed", "--steps", "--lr", "--lr-warmup-steps"]
    assert closest_flag("--sav", known) == "--save" and closest_flag("--lr-warm", known) == "--lr-warmup-steps"
    assert closest_flag("--zzz", known) is None


def test_resume_of_a_folder_that_holds_no_checkpoint_is_named_before_the_data_is_read(tmp_path, monkeypatch):
    """--resume is checked first: the data is read and hashed (seconds on a 32 MiB corpus) only once the folder
    holds a checkpoint."""
    import cp_handler.cli.args as args_module
    import cp_handler.cli.checkpoint_args as checkpoint_args

    def data_step(*args, **kwargs):
        raise AssertionError("the data was read before --resume was checked")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(args_module, "check_data", data_step)
    monkeypatch.setattr(checkpoint_args, "collect_files", data_step)
    monkeypatch.setattr(checkpoint_args, "data_fingerprint", data_step)
    (tmp_path / "empty").mkdir()
    for folder, rule in (("missing", "no such directory"), ("empty", "no checkpoint")):
        with pytest.raises(SystemExit, match=rf"cp-train: error: --resume {re.escape(str(tmp_path / folder))}: "
                                             f"{rule}"):
            parse(["--nproc", "2", "--resume", str(tmp_path / folder), "--save", str(tmp_path / "out")])


def test_the_log_shows_the_mean_of_the_last_ten_losses_beside_each_step(capsys):
    from cp_handler.training.loop import LOSS_WINDOW, StepProgress

    losses = [5.0, 3.0, 6.0, 2.0, 4.0, 7.0, 1.0, 3.0, 5.0, 2.0, 9.0, 0.5, 4.0]
    progress = StepProgress(len(losses), True, log_every=1)
    for loss in losses:
        progress.update({"loss": loss, "lr": 0.1, "tokens_per_s": 10.0})
    progress.close()
    err = capsys.readouterr().err
    assert f"mean{LOSS_WINDOW}: the mean loss of the last {LOSS_WINDOW} steps" in err
    lines = [line for line in err.splitlines() if line.startswith("cp-train: step ")]
    assert len(lines) == len(losses)
    for step, line in enumerate(lines):
        window = losses[max(0, step + 1 - LOSS_WINDOW):step + 1]
        assert f" loss {losses[step]:.4f} mean{LOSS_WINDOW} {sum(window) / len(window):.4f} " in line, line


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_what_cp_train_writes_has_the_mode_the_umask_gives(tmp_path, monkeypatch, umask):
    """The metrics file (mkstemp: 0600 whatever the umask) and an --export-hf folder (mkdtemp: 0700) get the
    modes open / mkdir give, as the checkpoints do (tests/test_cli_generate.py)."""
    import types

    import cp_handler.training.build as run
    from cp_handler.cli.common import write_json_atomically

    class Saved:
        def save_pretrained(self, folder, state_dict=None):
            (Path(folder) / "config.json").write_text("{}")

    monkeypatch.setattr(run.dist, "get_rank", lambda: 0)
    old = os.umask(umask)
    try:
        write_json_atomically(str(tmp_path / "m.json"), {"step": 1})
        run.export_hf(types.SimpleNamespace(export_hf=str(tmp_path / "export"), hf_source=None),
                      types.SimpleNamespace(model=Saved()))
    finally:
        os.umask(old)
    assert (tmp_path / "m.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "export").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "export" / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask
