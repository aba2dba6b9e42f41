"""Block kernels: selection and its errors, the CUDA kernels' calls against the real ops' schemas
(run through the ops' meta kernels, so every torch version is checked without a GPU), and on CUDA
(``-m gpu``) every kernel against a float64 reference.

GPU tolerance: relative error (max |got - want| / max |want|) 1e-2 in bf16, 2e-3 in fp16, 1e-5 in
fp32; issue 13 measured 2-3e-3, 3e-4 and 5e-7 for the flash / efficient blocks on an H100.
"""

import dataclasses

import pytest
import torch

from cp_handler.ops import kernels
from cp_handler.ops.kernels import ATTN_KERNEL_ENV, KERNELS, cuda_flash, select_kernel


def test_cpu_picks_cpu_flash_and_honours_the_override(monkeypatch):
    q = torch.randn(1, 2, 4, 8)
    monkeypatch.delenv(ATTN_KERNEL_ENV, raising=False)
    assert select_kernel(q).name == "cpu_flash"
    monkeypatch.setenv(ATTN_KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match=r"CP_HANDLER_ATTN_KERNEL='flash' cannot run this attention: it runs on "
                                         r"cuda, q is on cpu"):
        select_kernel(q)
    assert select_kernel(q, "cpu_flash").name == "cpu_flash"  # the argument wins over the environment
    with pytest.raises(ValueError, match=r"attn_kernel='fa3' is not a known attention kernel; known: \['cpu_flash'"):
        select_kernel(q, "fa3")
    monkeypatch.setenv(ATTN_KERNEL_ENV, "")
    assert select_kernel(q).name == "cpu_flash"  # empty = automatic


def test_automatic_choice_skips_unverified_and_unsupported(monkeypatch):
    """The CUDA order (cudnn, flash_varlen, flash_gqa, flash, efficient) run on meta tensors: the first
    three are unverified, so bf16 gets flash, fp32 efficient; forcing cudnn is allowed (an explicit opt-in)."""
    meta = {name: dataclasses.replace(k, device_type="meta") for name, k in KERNELS.items() if k.device_type == "cuda"}
    monkeypatch.setattr(kernels, "KERNELS", meta)
    monkeypatch.delenv(ATTN_KERNEL_ENV, raising=False)
    q = torch.empty(1, 2, 4, 64, device="meta", dtype=torch.bfloat16)
    assert select_kernel(q).name == "flash"
    assert select_kernel(q.float()).name == "efficient"
    assert select_kernel(q, "cudnn").name == "cudnn"
    with pytest.raises(ValueError, match=r"no attention kernel runs q \(1, 2, 4, 64\) torch.float64 on meta: "
                                         r"cudnn: it takes"):
        select_kernel(q.double())
    with pytest.raises(ValueError, match=r"attn_kernel='flash' cannot run this attention: it takes head dims <= 256"):
        select_kernel(torch.empty(1, 2, 4, 512, device="meta", dtype=torch.bfloat16), "flash")


@pytest.mark.parametrize("name, dtype", [("flash", torch.bfloat16), ("flash", torch.float16),
                                         ("flash_gqa", torch.bfloat16), ("efficient", torch.float32),
                                         ("cudnn", torch.bfloat16)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_calls_match_the_op_schemas(name, dtype, causal):
    """Forward and backward of each CUDA kernel on meta tensors, GQA 8/2: the aten ops parse every
    argument (names and types of this torch's schema) and return the documented shapes."""
    module = KERNELS[name]
    q = torch.empty(2, 8, 16, 64, device="meta", dtype=dtype)
    k = v = torch.empty(2, 2, 16, 64, device="meta", dtype=dtype)
    out, lse = module.forward(q, k, v, causal=causal, scale=0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, 16) and lse.dtype == torch.float32
    dq, dk, dv = module.backward(out, q, k, v, out, lse, causal=causal, scale=0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


class _RecordingAten:
    """Stands in for ``torch.ops.aten`` in cuda_flash: records the flash backward's arguments and
    applies the CUDA kernel's rule that made issue 13's bf16 backward crash: a *defined* cum_seq_q
    selects the varlen path, which needs int32 offsets."""

    def __init__(self):
        self.calls = []

    def _scaled_dot_product_flash_attention_backward(self, *args, **kwargs):
        schema = torch.ops.aten._scaled_dot_product_flash_attention_backward.default._schema
        names = [a.name for a in schema.arguments]
        bound = dict(zip(names, args, strict=False)) | kwargs
        assert set(bound) <= set(names), set(bound) - set(names)
        for offsets in ("cum_seq_q", "cum_seq_k"):
            if bound[offsets] is not None and bound[offsets].dtype != torch.int32:
                raise RuntimeError("cu_seqlens_q must have dtype int32")
        self.calls.append(bound)
        return bound["query"], bound["key"], bound["value"]


def test_flash_backward_passes_undefined_offsets(monkeypatch):
    """Regression (issue 13): the dense flash backward gets cum_seq_q/k undefined, as its forward returns them."""
    recorder = _RecordingAten()
    monkeypatch.setattr(cuda_flash, "aten", recorder)
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    cuda_flash.backward(q, q, k, k, q, torch.zeros(1, 4, 8), causal=True, scale=0.25)
    (call,) = recorder.calls
    assert call["cum_seq_q"] is None and call["cum_seq_k"] is None
    assert (call["max_q"], call["max_k"], call["dropout_p"], call["is_causal"]) == (8, 8, 0.0, True)
    forward = torch.ops.aten._scaled_dot_product_flash_attention(*(torch.empty(1, 1, 8, 16, device="meta",
                                                                               dtype=torch.bfloat16),) * 3)
    assert forward[2] is None and forward[3] is None  # what the forward returns for a dense call


@pytest.mark.parametrize("name, key_heads", [("flash", 4), ("flash_gqa", 2)])
def test_flash_gqa_passes_kv_with_their_own_heads(monkeypatch, name, key_heads):
    """``flash`` expands K/V to q's 4 heads before the op; ``flash_gqa`` hands the op the 2 KV heads
    (no copies) and returns dk/dv with 2 heads either way."""
    recorder = _RecordingAten()
    monkeypatch.setattr(cuda_flash, "aten", recorder)
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    dq, dk, dv = KERNELS[name].backward(q, q, k, k, q, torch.zeros(1, 4, 8), causal=True, scale=0.25)
    (call,) = recorder.calls
    assert call["key"].shape[1] == call["value"].shape[1] == key_heads
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def _reference(q, k, v, dout, causal, scale):
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=scale,
                                                           enable_gqa=True)
    out.backward(dout.double().cpu())
    return out, q64.grad, k64.grad, v64.grad


def _relative_error(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, dtype, tol", [("flash", torch.bfloat16, 1e-2), ("flash", torch.float16, 2e-3),
                                              ("flash_gqa", torch.bfloat16, 1e-2), ("flash_gqa", torch.float16, 2e-3),
                                              ("efficient", torch.float32, 1e-5), ("cudnn", torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernels_match_float64(name, dtype, tol, causal):
    """Each CUDA kernel's forward and backward (given its own out/lse, as the blocks are) vs float64.
    Fails on the code before issue 13's fix: the bf16 flash backward raised."""
    torch.manual_seed(0)
    q, dout = (torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=dtype) for _ in range(2))
    kernel = select_kernel(q, name)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.125)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=0.125)
    for label, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                                _reference(q, k, v, dout, causal, 0.125), strict=True):
        assert _relative_error(got, want.detach()) < tol, (label, _relative_error(got, want.detach()))
