"""The README's examples (the GPT quickstart, the Hugging Face one) run under torchrun and match the
single-process model."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import HANG_GUARD_S

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
"""torchrun on a free port (--standalone): test files run side by side (make test's workers)."""

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_under_torchrun():
    result = subprocess.run(
        [*TORCHRUN, str(ROOT / "examples/quickstart.py")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    diff = float(result.stdout.split("max |CP - single process| =")[1])
    assert diff < 1e-5  # float32 logits of order 1; the ring reorders sums only


def test_hf_trainer_sft_example_under_torchrun():
    """examples/hf_trainer_sft.py (TRL's SFTTrainer with packed documents and a sliding window) at cp 2: it trains
    (the loss falls over its 20 steps; its exactness is tests/test_hf_trainer.py's)."""
    result = subprocess.run(
        [*TORCHRUN,
         str(ROOT / "examples/hf_trainer_sft.py")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in result.stdout.split("losses")[1].split()]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses


def test_hf_vlm_sft_example_under_torchrun():
    """examples/hf_vlm_sft.py (a tiny Qwen2.5-VL under TRL's SFTTrainer, its vision collator, cp 2 with a2a): it trains
    (the loss falls over its 20 steps; its exactness is tests/test_hf_vlm_trainer.py's)."""
    result = subprocess.run(
        [*TORCHRUN, str(ROOT / "examples/hf_vlm_sft.py")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in result.stdout.split("losses")[1].split()]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses


def test_grpo_cp_example_under_torchrun():
    """examples/grpo_cp.py (a tiny Llama under TRL's GRPOTrainer, real sampling on each CP group's first rank, cp 2): it
    trains (the mean reward rises over its 24 steps; its exactness is tests/test_hf_rl_trainer.py's)."""
    result = subprocess.run(
        [*TORCHRUN, str(ROOT / "examples/grpo_cp.py")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [float(x) for x in result.stdout.split("\nrewards ")[1].split()]
    assert len(rewards) == 4 and rewards[-1] > rewards[0] + 0.3, rewards


def test_hf_quickstart_under_torchrun():
    result = subprocess.run(
        [*TORCHRUN,
         str(ROOT / "examples/hf_quickstart.py")],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split("difference")[1]) < 1e-5  # float32 loss of order 5; reordered sums only
