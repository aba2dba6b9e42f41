"""Where and in which dtype a multi-rank parity test runs, its reference and its tolerance.

``CPU`` (float32) is the default suite: the reference is the single-process computation in float32
on the same inputs, with each test's own measured tolerance. The GPU cases (``pytest -m gpu``; skipped
without CUDA, never counted as passed) run the ranks on CUDA in float32, bfloat16 and float16; their
reference is float64 on CPU from the same inputs rounded to the case's dtype, so only the device
computation's own error is measured. Tolerances (atol = rtol, on outputs and gradients):

* float32: ``1e-5 * cp``. The CUDA efficient kernel was measured within 5e-7 of float64 per block
  (issue 13, H100); each ring step adds one float32 log-sum-exp merge (a few roundings of 1.2e-7).
* bfloat16: 2.5e-2, Transformer Engine's own CP tests (8 mantissa bits, eps 7.8e-3; flash blocks were
  measured at 2-3e-3 relative error on an H100).
* float16: 5e-3, Transformer Engine's (eps 9.8e-4; blocks measured at 3e-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

GPU_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2, torch.float16: 5e-3}
"""Tolerance of the GPU cases; float32 is multiplied by cp (see the module doc)."""


@dataclass(frozen=True)
class DeviceCase:
    device: str
    dtype: torch.dtype

    @property
    def on_cpu(self) -> bool:
        """The default suite's case: CPU in float32, the reference the same float32 computation."""
        return self.device == "cpu" and self.dtype == torch.float32

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """An input as the ranks get it."""
        return t.to(self.device, self.dtype)

    def reference(self, t: torch.Tensor) -> torch.Tensor:
        """The same input as the single-process reference gets it (CPU)."""
        return t if self.on_cpu else t.to(self.dtype).double()

    def tolerance(self, cp: int, cpu_tolerance: float) -> float:
        """``cpu_tolerance`` (the test's own, for the CPU case) or the GPU tolerance of this dtype."""
        if self.on_cpu:
            return cpu_tolerance
        tol = GPU_TOLERANCE[self.dtype]
        return tol * cp if self.dtype == torch.float32 else tol

    def assert_close(self, got: torch.Tensor, want: torch.Tensor, tol: float, msg=None) -> None:
        """``got`` (device) against ``want`` (reference), both brought to the reference's dtype on CPU."""
        torch.testing.assert_close(got.detach().to("cpu", want.dtype), want, atol=tol, rtol=tol, msg=msg)


CPU = DeviceCase("cpu", torch.float32)
CPU_BF16 = DeviceCase("cpu", torch.bfloat16)
"""CPU in bfloat16 (the FlashAttention-4 contract fake computes only fp16 / bf16): a float64 reference and the
bfloat16 tolerance, as the GPU cases."""

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_CASES = [pytest.param(DeviceCase("cuda", dtype), marks=[pytest.mark.gpu, _needs_cuda], id=f"cuda-{name}")
             for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))]
"""One parameter per GPU dtype, marked ``gpu`` and skipped without CUDA."""
