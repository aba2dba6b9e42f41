"""Selecting a GPU backend where it cannot run fails loudly, before any collective or rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S
from test_cli import cp_train

from cp_handler import MagiAttnContextParallelHandler, TEContextParallelHandler

TESTS = Path(__file__).parent
FAKES = os.pathsep.join([str(TESTS / "fakes"), str(TESTS)])  # the fakes use tests/dist_utils.py


def test_missing_packages_raise_import_error_with_install_hint():
    with pytest.raises(ImportError, match=r"'transformer_engine' package.*pip install transformer_engine\[pytorch\]"):
        TEContextParallelHandler(cp_group=None)
    with pytest.raises(ImportError, match=r"'magi_attention' package.*install MagiAttention"):
        MagiAttnContextParallelHandler(cp_group=None)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only error path")
def test_missing_cuda_raises_runtime_error():
    code = ("from cp_handler import TEContextParallelHandler as T, MagiAttnContextParallelHandler as M\n"
            "for cls in (T, M):\n"
            "    try:\n        cls(cp_group=None)\n    except RuntimeError as e:\n        print('RuntimeError:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S,
                            env={**os.environ, "PYTHONPATH": FAKES + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert result.stdout.count("RuntimeError:") == 2, result.stdout + result.stderr
    assert "runs on CUDA GPUs only and no CUDA device is available" in result.stdout


@pytest.mark.parametrize("backend, package", [("transformer_engine", "transformer_engine"), ("magi", "magi_attention")])
def test_cp_train_gpu_backend_on_cpu_exits_with_the_reason(backend, package):
    result = cp_train("--nproc", "2", "--backend", backend)
    assert result.returncode != 0
    assert f"cp-train: error: backend needs the '{package}' package" in result.stderr
    assert "cp-train: world" not in result.stderr
