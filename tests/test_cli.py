"""cp-train end to end: parity with one process, flag rules, a crashed rank stops the run."""

import json
import os
import random
import subprocess
import sys

import pytest

SMALL = ["--steps", "6", "--seq-len", "128", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--max-corpus-bytes", "2000000"]


def cp_train(*flags, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "cp_handler.cli.train", *flags], capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("layout", [["--nproc", "2", "--cp-size", "2"], ["--nproc", "4", "--cp-size", "2"]])
def test_check_parity_passes_and_metrics_written(tmp_path, layout):
    out = tmp_path / "metrics.json"
    result = cp_train(*layout, *SMALL, "--check-parity", "--metrics-out", str(out))
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
    assert [r["step"] for r in metrics["steps"] if "eval_loss" in r] == [2, 5]
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
        (["--nproc", "2", "--seq-len", "1001"], "seq_len=1001 is not divisible by 2 * context_parallel_size = 4"),
        (["--nproc", "3", "--cp-size", "2"], "world size 3 is not a multiple of context_parallel_size=2"),
        (["--nproc", "2", "--cp-comm-type", "ring"], "cp_comm_type='ring' is not a valid communication type"),
        (["--nproc", "2", "--backend", "nope"], "backend='nope' is not registered"),
        (["--nproc", "2", "--num-heads", "3"], "hidden_size=128 must be divisible by num_attention_heads=3"),
        (["--nproc", "2", "--cp-comm-type", "p2p,p2p,p2p"],
         "cp_comm_type has 3 entries but the model has num_layers=2"),
        (["--nproc", "4", "--eval-cp-size", "3"], "world size 4 is not a multiple of context_parallel_size=3"),
        (["--nproc", "4", "--cp-size", "2", "--eval-cp-size", "4", "--seq-len", "100"],
         "seq_len=100 is not divisible by 2 * context_parallel_size = 8"),
        (["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "2", "--eval-cp-size", "2"],
         "cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes"),
        (["--nproc", "4", "--cp-comm-type", "a2a+p2p"],
         "cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes"),
        (["--nproc", "4", "--dynamic-cp"], "--dynamic-cp needs --max-seqlen-per-rank N"),
        (["--nproc", "2", "--dynamic-cp", "--max-seqlen-per-rank", "100", "--seq-len", "1024"],
         "a sequence of 1024 tokens does not fit: max_seqlen_per_dp_cp_rank=100 on at most 2 ranks"),
        (["--nproc", "4", "--dynamic-cp", "--max-seqlen-per-rank", "512", "--cp-size", "2"], "drop --cp-size"),
        (["--nproc", "4", "--dynamic-cp", "--max-seqlen-per-rank", "512", "--min-cp-size", "3"], "power of two"),
        (["--nproc", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "3"],
         "hierarchical_context_parallel_sizes=[2, 3] multiply to 6, but context_parallel_size=4"),
        (["--nproc", "4", "--cp-size", "2", "--moe-experts", "8", "--expert-parallel-size", "8"],
         "expert_model_parallel_size=8 must divide dp * cp = 2 * 2 = 4"),
        (["--nproc", "4", "--moe-experts", "6", "--expert-parallel-size", "4"],
         "--moe-experts 6 must be a multiple of --expert-parallel-size 4"),
        (["--nproc", "2", "--expert-parallel-size", "2"], "--expert-parallel-size 2 needs --moe-experts E"),
        (["--nproc", "2", "--moe-experts", "4", "--moe-top-k", "5"], "moe_router_topk=5 must lie in"),
    ],
)
def test_bad_flags_exit_before_training(flags, message):
    result = cp_train(*flags, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr
    assert "cp-train: world" not in result.stderr  # no rank was started


def test_crashed_rank_stops_every_rank():
    result = cp_train("--nproc", "2", *SMALL, env={"CP_TRAIN_FAIL_RANK": "1"}, timeout=120)
    assert result.returncode != 0
    assert "rank 1 failed; all ranks stopped" in result.stderr
    assert "injected failure on rank 1" in result.stderr
