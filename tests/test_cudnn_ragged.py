"""cuDNN blocks without a graph per shape (``cudnn_ragged``: ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``), on a GPU.

The flag buckets the graph's lengths to powers of two, and the backward graph takes the lse's strides from the
tensor it was built with while its cache key does not: a graph built for one length and reused for another of
the same bucket must read the right lse rows. So two lengths of one bucket (1000 and 1024, then 600 and 1000)
run forward + backward in one process, each against float64 autograd (bf16 tolerance of tests/test_kernels.py).
The flag is read once per process, before the first cuDNN call: the check runs in a fresh interpreter. Opt-in
until this passes on a GPU (scripts/gpu_check.py cudnn_ragged); skipped without CUDA, never counted as passed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S

CHECK = r"""
import torch
from cp_handler.ops.kernels import select_kernel
torch.manual_seed(0)
kernel = select_kernel(torch.empty(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16), "cudnn_ragged")
for s in (1000, 1024, 600, 1000):
    q, dout = (torch.randn(1, s, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, s, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.125)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.125)
    q64, k64, v64 = (t.double().cpu().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=0.125,
                                                            enable_gqa=True)
    want.backward(dout.double().cpu())
    for name, got, ref in (("out", out, want), ("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        error = ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert error < 1e-2, (s, name, error)
print("cudnn_ragged: 1000 / 1024 / 600 / 1000 exact in one process")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_lengths_of_one_bucket_in_one_process():
    root = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, "TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_ragged_kernel_needs_the_flag_and_says_so(monkeypatch):
    from cp_handler.ops.kernels import cuda_cudnn

    monkeypatch.delenv(cuda_cudnn.RAGGED_ENV, raising=False)
    probe = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16)
    assert "it needs TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 in the environment before the first cuDNN call" in \
        cuda_cudnn.ragged_needs(probe)
    monkeypatch.setenv(cuda_cudnn.RAGGED_ENV, "1")
    assert cuda_cudnn.ragged_needs(probe) is None and not cuda_cudnn.RAGGED_KERNEL.shape_specialized
