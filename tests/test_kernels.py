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
from cp_handler.ops.blocks import new_accumulators
from cp_handler.ops.kernels import ATTN_KERNEL_ENV, KERNELS, cuda_efficient, cuda_flash, select_kernel


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


def test_automatic_choice_skips_unverified_unsupported_and_shape_specialized(monkeypatch):
    """The CUDA order (cudnn, flash_varlen, flash_gqa, flash, efficient) run on meta tensors: cudnn is
    unverified (opt-in), so bf16 gets flash_varlen, fp16 flash_gqa (flash_varlen verified in bf16 only),
    fp32 efficient; cudnn forced for packed documents is refused (a graph per block shape), and once
    verified (a stand-in) it is chosen for bshd and skipped for packed documents (``varying_shapes``)."""
    meta = {name: dataclasses.replace(k, device_type="meta") for name, k in KERNELS.items() if k.device_type == "cuda"}
    monkeypatch.setattr(kernels, "KERNELS", meta)
    monkeypatch.delenv(ATTN_KERNEL_ENV, raising=False)
    q = torch.empty(1, 2, 4, 64, device="meta", dtype=torch.bfloat16)
    assert select_kernel(q).name == "flash_varlen"
    assert select_kernel(q.half()).name == "flash_gqa"
    assert select_kernel(q.float()).name == "efficient"
    assert select_kernel(q, "cudnn").name == "cudnn"  # an explicit opt-in
    with pytest.raises(ValueError, match=r"attn_kernel='cudnn' cannot run this attention: it builds a plan per "
                                         r"block shape .* use flash_varlen"):
        select_kernel(q, "cudnn", varying_shapes=True)
    monkeypatch.setitem(meta, "cudnn", dataclasses.replace(meta["cudnn"], verified_on="a stand-in"))
    assert select_kernel(q).name == "cudnn"
    assert select_kernel(q, varying_shapes=True).name == "flash_varlen"
    assert select_kernel(torch.empty(1, 2, 4, 192, device="meta", dtype=torch.bfloat16)).name == "flash_varlen"
    with pytest.raises(ValueError, match=r"no attention kernel runs q \(1, 2, 4, 64\) torch.float64 on meta: "
                                         r"fa4_varlen: it takes .*; cudnn: it takes"):
        select_kernel(q.double())
    with pytest.raises(ValueError, match=r"attn_kernel='flash' cannot run this attention: it takes head dims <= 256"):
        select_kernel(torch.empty(1, 2, 4, 512, device="meta", dtype=torch.bfloat16), "flash")


def test_local_handler_marks_thd_plans_as_varying_shapes():
    """The local handler tells the kernel choice that thd plans have a new block shape per document pair."""
    from cp_handler import get_cp_handler_cls

    cls = get_cp_handler_cls("local", "p2p")
    assert cls(cp_group=None, qkv_format="thd", cu_seqlens=torch.tensor([0, 4])).kernel_choice.varying_shapes
    assert not cls(cp_group=None, qkv_format="bshd").kernel_choice.varying_shapes


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


class _EfficientLayoutAten:
    """Stands in for ``torch.ops.aten`` in cuda_efficient: records the layout of ``out`` that the
    memory-efficient backward gets and applies its kernel's rule (torch's kernel_backward.h: in
    fp16/bf16 ``out`` is read with row stride ``head_dim * num_heads``, only its batch and head strides
    taken from the tensor)."""

    def __init__(self):
        self.outs = []

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, *args, **kwargs):
        b, h, s, d = out.shape
        if out.stride(2) != h * d or out.stride(1) != d:
            raise RuntimeError(f"out strides {out.stride()} for shape {tuple(out.shape)}: the kernel would read "
                               f"rows {h * d} apart")
        self.outs.append(out)
        return q, k, v, None


@pytest.mark.parametrize("layout", ["sequence_major_rows", "head_chunk", "head_major"])
def test_efficient_backward_gets_out_in_the_layout_its_kernel_reads(monkeypatch, layout):
    """Regression (issue 23): the accumulators were (B, H, S, D) (row stride D), so the bf16/fp16
    efficient backward read every head's rows at the wrong place. Each ``out`` a plan passes (a row
    slice of the sequence-major accumulator, a KV-head chunk of all_gather, a head-major tensor) reaches
    the kernel with row stride H * D."""
    recorder = _EfficientLayoutAten()
    monkeypatch.setattr(cuda_efficient, "aten", recorder)
    out_full, _ = new_accumulators(torch.empty(1, 8, 32, 16, dtype=torch.bfloat16))
    out = {"sequence_major_rows": out_full[:, :, 8:24], "head_chunk": out_full[:, 2:4],
           "head_major": torch.zeros(1, 8, 32, 16)}[layout].to(torch.bfloat16)
    q = torch.zeros(out.shape, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2 if out.shape[1] == 8 else 1, out.shape[2], 16, dtype=torch.bfloat16)
    cuda_efficient.backward(q, q, kv, kv, out, torch.zeros(out.shape[:3]), causal=True, scale=0.25)
    (seen,) = recorder.outs
    torch.testing.assert_close(seen, out, atol=0, rtol=0)  # same values, readable with the kernel's strides
    assert layout != "sequence_major_rows" or seen.data_ptr() == out.data_ptr()  # a plan's rows: no copy


@pytest.mark.parametrize("name, dtype, head_dim, reason", [
    ("flash", torch.bfloat16, 100, "multiples of 8"), ("flash", torch.bfloat16, 264, "head dims <= 256"),
    ("cudnn", torch.bfloat16, 192, "head dims <= 128"), ("cudnn", torch.float16, 36, "multiples of 8"),
    ("efficient", torch.float32, 30, "multiples of 4"), ("flash_varlen", torch.bfloat16, 12, "multiples of 8")])
def test_each_kernel_states_its_head_dim_limits(name, dtype, head_dim, reason):
    """A head dim a kernel cannot take is its own clear error when forced (not a failure inside the op)."""
    meta = dataclasses.replace(KERNELS[name], device_type="meta")
    assert reason in meta.cannot_run(torch.empty(1, 2, 4, head_dim, device="meta", dtype=dtype))
    assert meta.cannot_run(torch.empty(1, 2, 4, 64, device="meta", dtype=dtype)) is None


def test_mla_kernels_state_it_and_cuda_mla_stays_opt_in(monkeypatch):
    """A value head dim other than q/k's (MLA): a kernel that takes one head dim says so when forced; on CPU
    the automatic choice keeps cpu_flash; on CUDA (meta stand-ins) only ``efficient`` takes it and, with no GPU
    run of MLA yet, only as an opt-in: the automatic choice is a clear error naming it."""
    q = torch.empty(1, 2, 4, 16, device="meta", dtype=torch.bfloat16)
    for name in ("flash", "flash_gqa", "flash_varlen", "cudnn", "fa4"):
        meta = dataclasses.replace(KERNELS[name], device_type="meta", requirement=None)
        assert "it takes one head dim for q, k and v; v has 24, q and k 16" in meta.cannot_run(q, v_head_dim=24)
        assert meta.cannot_run(q, v_head_dim=16) is None
    monkeypatch.delenv(ATTN_KERNEL_ENV, raising=False)
    assert select_kernel(torch.empty(1, 2, 4, 16), v_head_dim=24).name == "cpu_flash"
    meta = {name: dataclasses.replace(k, device_type="meta") for name, k in KERNELS.items() if k.device_type == "cuda"}
    monkeypatch.setattr(kernels, "KERNELS", meta)
    with pytest.raises(ValueError, match=r"flash_varlen: it takes one head dim .* efficient: not yet verified on a "
                                         r"GPU in torch.bfloat16 at head dims 16 \(q, k\) / 24 \(v\) \(opt-in"):
        select_kernel(q, v_head_dim=24)
    assert select_kernel(q, "efficient", v_head_dim=24).name == "efficient"
    with pytest.raises(ValueError, match=r"attn_kernel='flash' cannot run this attention: it takes one head dim"):
        select_kernel(q, "flash", v_head_dim=24)


def test_unverified_dtype_is_opt_in_and_causal_blocks_must_be_square(monkeypatch):
    """bf16 with head dim 264: only efficient runs it; with bf16 unverified (a stand-in) the automatic
    choice is a clear error instead of an unverified kernel; a non-square causal block is refused at
    the kernel entry (the kernels align such a mask differently)."""
    meta = {name: dataclasses.replace(k, device_type="meta") for name, k in KERNELS.items() if k.device_type == "cuda"}
    meta["efficient"] = dataclasses.replace(meta["efficient"], verified_dtypes=(torch.float32,))
    monkeypatch.setattr(kernels, "KERNELS", meta)
    monkeypatch.delenv(ATTN_KERNEL_ENV, raising=False)
    q = torch.empty(1, 2, 4, 264, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"efficient: not yet verified on a GPU in torch.bfloat16 at head dim 264 "
                                         r"\(opt-in: attn_kernel='efficient'\)"):
        select_kernel(q)
    assert select_kernel(q, "efficient").name == "efficient"
    assert select_kernel(q.float()).name == "efficient"
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="a causal block of 4 queries and 6 keys: causal blocks must be square"):
        kernels.block_attn_forward(x, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), causal=True, scale=1.0)


def _reference(q, k, v, dout, causal, scale):
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=scale,
                                                           enable_gqa=True)
    out.backward(dout.double().cpu())
    return out, q64.grad, k64.grad, v64.grad


def _relative_error(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
BLOCK_KERNELS = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}") for name, k in KERNELS.items()
                 if k.device_type == "cuda" and not k.packed for dtype in k.dtypes]
"""Every dense CUDA kernel in every dtype it claims (verified or opt-in)."""
OUT_LAYOUTS = ("kernel", "head_major", "sequence_major_rows", "head_chunk")
"""How ``out`` reaches a backward: as the kernel returned it; head-major (B, H, S, D) contiguous; a row
slice of a plan's sequence-major accumulator (the ring); a KV-head chunk of it (all_gather)."""


def _as_plan_passes(out: torch.Tensor, layout: str, rows: slice, heads: slice) -> torch.Tensor:
    if layout == "kernel":
        return out
    if layout == "head_major":
        return out.contiguous()
    acc, _ = new_accumulators(torch.empty(out.shape[0], out.shape[1], out.shape[2] + 64, out.shape[3],
                                          dtype=out.dtype, device=out.device))
    acc = acc.to(out.dtype)
    acc[:, :, rows] = out  # the block's rows inside a longer accumulator
    view = acc[:, :, rows]
    return view[:, heads] if layout == "head_chunk" else view


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, dtype", BLOCK_KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernels_match_float64(name, dtype, causal):
    """Each CUDA kernel's forward and backward (given its own out/lse, as the blocks are) vs float64, in
    every dtype it claims, 8 query heads over 2 KV heads, with ``out`` in every layout a plan passes (a
    head chunk: the chunk's 4 query heads over 1 KV head). Fails on the code before issue 13's fix (the
    bf16 flash backward raised) and before issue 23's (bf16/fp16 efficient read out rows D apart)."""
    torch.manual_seed(0)
    tol = GPU_TOL[dtype]
    needs = KERNELS[name].requirement
    if needs is not None and needs(torch.empty(1, device="cuda")):  # an optional package, an env flag
        pytest.skip(f"{name}: {needs(torch.empty(1, device='cuda'))}")
    q, dout = (torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=dtype) for _ in range(2))
    kernel = select_kernel(q, name)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.125)
    want = _reference(q, k, v, dout, causal, 0.125)
    assert _relative_error(out, want[0].detach()) < tol, ("out", _relative_error(out, want[0].detach()))
    for layout in OUT_LAYOUTS:
        heads, kv_heads = (slice(4, 8), slice(1, 2)) if layout == "head_chunk" else (slice(None), slice(None))
        out_passed = _as_plan_passes(out, layout, slice(32, 288), heads)
        dq, dk, dv = kernel.backward(dout[:, heads], q[:, heads], k[:, kv_heads], v[:, kv_heads], out_passed,
                                     lse[:, heads].contiguous(), causal=causal, scale=0.125)
        expected = _reference(q[:, heads], k[:, kv_heads], v[:, kv_heads], dout[:, heads], causal, 0.125)
        for label, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), expected[1:], strict=True):
            error = _relative_error(got, ref)
            assert error < tol, (layout, label, error)
