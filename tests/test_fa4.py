"""FlashAttention-4 kernels (``fa4`` blocks, ``fa4_varlen`` packed calls) without a GPU, through the contract
fake of ``flash_attn.cute.interface`` (tests/fakes_fa4/flash_attn/cute/interface.py: the signatures, layouts and
assertions of flash-attn-4 4.0.0b36, computing in float32 on CPU, recording every call).

* What we pass: the argument order of the backward (q, k, v, out, dout, lse), the block tensors as
  ``(B, S, H, D)`` transposes of our views (no copy: the same memory), K/V at their own head count, lse in
  the forward's shape and float32, the merged lse of the ring given to the backward, ``max_seqlen`` as
  Python ints, int32 ``cu_seqlens``.
* The kernel contract against a float64 reference (bf16 / fp16 tolerances of tests/device_cases.py): block
  forward and lse; the merged-lse backward over keys split in blocks; packed calls with length-1 segments,
  ``Sq != Sk`` segments and more than 256 segments.
* Every pattern in bf16 forced to ``fa4`` (bshd) and ``fa4_varlen`` (thd) against the float64 reference.
* The kernels' limits: automatic only where run H200-2026-11-27b verified them (``fa4``: bshd, head dims 64 /
  128), a forced kernel that cannot run fails with our error
  (package missing, fp32, head dim, compute capability).
"""

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
from device_cases import CPU_BF16
from dist_utils import run_distributed

from cp_handler.core.masks import AttentionMask, BlockMask
from cp_handler.ops import kernels
from cp_handler.ops.blocks import LseRows, new_accumulators
from cp_handler.ops.kernels import ATTN_KERNEL_ENV, fa4, select_kernel
from cp_handler.ops.merge import merge_attn_out_

FAKES = str(Path(__file__).parent / "fakes_fa4")  # apart from tests/fakes: the TE and Magi tests see no flash_attn
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 5e-3}
"""Relative to the largest reference value: the GPU cases' tolerances (tests/device_cases.py)."""


def use_fake() -> object:
    """Put the FA4 fake on the path and register CPU-labelled FA4 kernels (the real ones run on CUDA only);
    returns the fake interface module."""
    if FAKES not in sys.path:
        sys.path.insert(0, FAKES)
    importlib.invalidate_caches()
    fa4.interface.cache_clear()
    for kernel in (fa4.KERNEL, fa4.VARLEN_KERNEL):
        kernels.KERNELS[kernel.name] = dataclasses.replace(kernel, device_type="cpu")
    return fa4.interface()


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(sys, "path", [FAKES, *sys.path])
    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))
    interface = use_fake()
    interface.CALLS.clear()
    yield interface
    fa4.interface.cache_clear()
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def reference(q, k, v, causal, scale):
    """float64 ``(out, lse)`` of ``q (B, H, Sq, D)`` over ``k, v (B, Hkv, Sk, D)`` (bottom-right causal)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        scores = scores.masked_fill(torch.arange(sk)[None] > torch.arange(sq)[:, None] + sk - sq, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse[..., None]), v), lse


def close(got, want, dtype, what):
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]}"


def _qkv(b, h, hkv, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads, s: torch.randn(b, s, heads, d, generator=g).to(dtype).transpose(1, 2)  # noqa: E731
    return mk(h, sq), mk(hkv, sk), mk(hkv, sk)  # (B, H, S, D) views of sequence-major memory, as the plans pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, sq, sk, heads", [(True, 48, 48, (8, 2)), (False, 24, 40, (4, 4)),
                                                    (True, 33, 33, (6, 3))])
def test_block_kernel_against_float64_and_what_it_passes(fake, dtype, causal, sq, sk, heads):
    q, k, v = _qkv(2, *heads, sq, sk, 64, dtype)
    out, lse = fa4.forward(q, k, v, causal=causal, scale=0.125)
    want_out, want_lse = reference(q, k, v, causal, 0.125)
    close(out, want_out, dtype, "out")
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)  # float32 lse of bf16 inputs
    (name, call), = fake.CALLS
    assert name == "fwd" and call["return_lse"]["value"] is True and call["causal"]["value"] is causal
    assert call["q"]["shape"] == (2, sq, heads[0], 64) and call["k"]["shape"] == (2, sk, heads[1], 64)  # own heads
    assert call["q"]["data_ptr"] == q.data_ptr() and call["k"]["data_ptr"] == k.data_ptr()  # views, no copy
    assert lse.shape == (2, heads[0], sq) and lse.dtype == torch.float32 and out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merged_lse_backward_over_split_keys_equals_whole_attention(fake, dtype):
    """The ring's contract: keys split in 3 blocks, forward merged by lse, each block's backward given the merged
    out / lse; the summed gradients equal whole attention's (float64 autograd)."""
    q, k, v = _qkv(1, 8, 2, 36, 36, 64, dtype, seed=1)
    dout = torch.randn(1, 36, 8, 64, generator=torch.Generator().manual_seed(2)).to(dtype).transpose(1, 2)
    spans = [slice(0, 12), slice(12, 24), slice(24, 36)]
    out, lse = new_accumulators(q)
    for i, keys in enumerate(spans):  # the last block holds the diagonal: queries 24.. causal, the rest full
        rows = slice(24, 36) if i == 2 else slice(0, 36)
        block = fa4.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=i == 2, scale=0.125)
        merge_attn_out_(out[:, :, rows], lse[:, :, rows], *block)
    merged_out = out.to(dtype)
    fake.CALLS.clear()
    grads = [torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v)]
    rows_of = LseRows(lse)
    for i, keys in enumerate(spans):
        rows = slice(24, 36) if i == 2 else slice(0, 36)
        dq, dk, dv = fa4.backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                  merged_out[:, :, rows], rows_of(rows), causal=i == 2, scale=0.125)
        grads[0][:, :, rows] += dq.float()
        grads[1][:, :, keys] += dk.float()
        grads[2][:, :, keys] += dv.float()
    # the whole attention: keys 0..23 full for every query, 24..35 causal for queries 24..35 (= plain causal
    # over a 24-token prefix), computed in float64 with autograd
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    kf, vf = kr.repeat_interleave(4, 1), vr.repeat_interleave(4, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", qr, kf) * 0.125
    mask = torch.arange(36)[None] > torch.maximum(torch.arange(36), torch.tensor(23))[:, None]
    attn = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
    torch.einsum("bhqk,bhkd->bhqd", attn, vf).backward(dout.double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, (qr.grad, kr.grad, vr.grad), strict=True):
        close(got, want, dtype, name)
    for name, call in fake.CALLS:  # the backward got the merged lse, float32, in the forward's shape
        assert name == "bwd" and call["lse"]["dtype"] == torch.float32 and call["lse"]["contiguous"]
        assert call["out"]["dtype"] == dtype and call["dout"]["shape"][1] == call["out"]["shape"][1]


@pytest.mark.parametrize("mask, q_pos, k_pos", [
    (AttentionMask(window=8), 10, 0),  # rows 7.. see none of these 20 keys: cut, lowest lse
    (AttentionMask(causal=False, window=5, window_right=3), 4, 12),  # two-sided, rows 0-4 see nothing
    (AttentionMask(softcap=3.0), 40, 0),  # a soft-capped full block (no window: both sides unbounded)
    (AttentionMask(window=30, softcap=3.0), 24, 0),  # Gemma 2's local layer: a soft-capped window edge
])
def test_masked_blocks_through_fa4_windows_and_softcap(fake, mask, q_pos, k_pos):
    """FA4's masked calls (opt-in until a GPU run): each block's band and soft-cap against the explicit scores in
    float64 on the same bf16 inputs, out, lse and the gradients given that out / lse; FA4 gets ``None`` for an
    unbounded side (never -1: it would read a window of -1)."""
    from cp_handler.ops.kernels import masked

    block = BlockMask(mask, q_pos, k_pos)
    q, k, v = _qkv(1, 8, 2, 20, 20, 64, torch.bfloat16, seed=3)
    dout = torch.randn(1, 20, 8, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).transpose(1, 2)
    want_out, want_lse = masked.masked_forward(*(t.double() for t in (q, k, v)), block, 0.125)
    out, lse = fa4.masked_forward(q, k, v, block, scale=0.125)
    close(out, want_out, torch.bfloat16, "out")
    seen = want_lse > torch.finfo(torch.float64).min  # rows with a key in the block
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=1e-4, rtol=1e-4)
    assert (lse[~seen] == torch.finfo(torch.float32).min).all()  # no key: the lowest finite lse, out 0
    assert (out[~seen] == 0).all()
    for name, call in fake.CALLS:
        assert name == "fwd" and call["softcap"]["value"] == mask.softcap and call["causal"]["value"] is False
        assert all(call[side]["value"] is None or call[side]["value"] >= 0
                   for side in ("window_size_left", "window_size_right"))
    merged_lse = want_lse.float().masked_fill(~seen, 0.0).contiguous()
    grads = fa4.masked_backward(dout, q, k, v, want_out.to(torch.bfloat16), merged_lse, block, scale=0.125)
    want = masked.masked_backward(*(t.double() for t in (dout, q, k, v, want_out, merged_lse)), block, 0.125)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.shape == expected.shape, name
        close(got, expected, torch.bfloat16, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_calls_against_float64(fake, dtype):
    """Length-1 segments, a full segment with Sq != Sk, and 300 segments in one call (FA4's batch-search path on
    a GPU); ``max_seqlen`` reach the interface as Python ints."""
    g = torch.Generator().manual_seed(3)
    lengths_q = [1, 5, 17, 1, *[3] * 296]
    lengths_k = [1, 9, 17, 1, *[3] * 296]
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, 4, 32, generator=g).to(dtype)
    k, v = (torch.randn(tk, 2, 32, generator=g).to(dtype) for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0)], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0)], dtype=torch.int32)
    out, lse = fa4.varlen_forward(q, k, v, cu_q, cu_k, 17, 17, causal=False, scale=0.2)
    assert lse.shape == (4, tq)
    for i in range(len(lengths_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want_out, want_lse = reference(*(t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))), False,
                                       0.2)
        close(out[qs].transpose(0, 1)[None], want_out, dtype, f"segment {i}")
    fa4.varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, 17, 17, causal=False, scale=0.2)
    for _, call in fake.CALLS:
        assert call["max_seqlen_q"]["type"] == "int" and call["max_seqlen_k"]["type"] == "int"
        assert call["cu_seqlens_q"]["dtype"] == torch.int32
    (_, bwd) = fake.CALLS[-1]
    assert bwd["lse"]["shape"] == (4, tq)


def test_fa4_is_automatic_only_where_a_run_verified_it_and_a_forced_kernel_says_why(fake, monkeypatch):
    """Run H200-2026-11-27b verified ``fa4`` blocks (head dims 64 / 128) and every bshd pattern through them: the
    automatic choice for bshd there; thd plans, other head dims and ``fa4_varlen`` stay opt-in."""
    monkeypatch.delenv(ATTN_KERNEL_ENV, raising=False)
    # the CUDA order (the FA4 kernels before the others), the fakes labelled cpu and cpu_flash last
    monkeypatch.setattr(kernels, "KERNELS", {k: kernels.KERNELS[k] for k in ("fa4_varlen", "fa4", "cpu_flash")})
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    assert select_kernel(q).name == "fa4"
    assert select_kernel(q, varying_shapes=True).name == "cpu_flash"  # thd: fa4_varlen and fa4 unverified there
    assert select_kernel(torch.randn(1, 4, 8, 32, dtype=torch.bfloat16)).name == "cpu_flash"  # head dim 32
    with pytest.raises(ValueError, match=r"attn_kernel='fa4' cannot run this attention: it takes \['torch.float16', "
                                         r"'torch.bfloat16'\], q is torch.float32"):
        select_kernel(q.float(), "fa4")
    with pytest.raises(ValueError, match=r"head dims that are multiples of 8 in torch.bfloat16, q has 60"):
        select_kernel(torch.randn(1, 4, 8, 60, dtype=torch.bfloat16), "fa4")
    monkeypatch.setattr(kernels, "KERNELS", {k: v for k, v in kernels.KERNELS.items() if k.startswith("fa4")})
    with pytest.raises(ValueError, match=r"fa4_varlen: not yet verified .*; fa4: not yet verified on a GPU for "
                                         r"packed documents \(thd\)"):
        select_kernel(q, varying_shapes=True)


def test_a_missing_or_other_release_is_named(monkeypatch):
    """Without the package (this machine) the reason names the extra; another release is refused by version."""
    fa4.interface.cache_clear()
    monkeypatch.setattr(fa4.importlib.util, "find_spec", lambda name: None)
    assert "flash-attn-4 is not installed (pip install flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 " \
        "(cp_handler's fa4 extra" in fa4.missing_package()
    with pytest.raises(ImportError, match=r"flash-attn-4 is not installed"):
        fa4.interface()
    monkeypatch.setattr(fa4.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(fa4.importlib.metadata, "version", lambda name: "4.0.0b37")
    assert "flash-attn-4 4.0.0b37 is installed; cp_handler calls the private entry points of 4.0.0b36" in \
        fa4.missing_package()
    fa4.interface.cache_clear()


def _patterns_worker(rank, world):
    import test_attn_patterns
    import test_thd

    interface = use_fake()
    os.environ[ATTN_KERNEL_ENV] = "fa4"
    test_attn_patterns._flat_worker(rank, world, ["p2p", "all_gather", "a2a"], ["gqa"], CPU_BF16)
    calls = [name for name, call in interface.CALLS if call["cu_seqlens_q"]["value"] is None]
    assert calls.count("fwd") and calls.count("bwd") and len(calls) == len(interface.CALLS)  # every block through FA4
    interface.CALLS.clear()
    os.environ[ATTN_KERNEL_ENV] = "fa4_varlen"
    test_thd._thd_worker(rank, world, ["p2p", "all_gather", "a2a"], None, CPU_BF16)
    assert interface.CALLS and all(call["cu_seqlens_q"]["dtype"] == torch.int32 for _, call in interface.CALLS)


def test_every_pattern_in_bf16_through_fa4_and_fa4_varlen():
    run_distributed(_patterns_worker, 2)


def _real_fa4_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return fa4.cannot_run_here(torch.empty(1, device="cuda"))


# The GPU tests below run the real FlashAttention-4 (``pytest -m gpu`` with the ``fa4`` extra on sm90+);
# elsewhere they are skipped, never counted as passed (scripts/gpu_check.py fa4_kernels).

def _cuda_qkv(b, h, hkv, sq, sk, d, dtype, seed):
    return [t.cuda() for t in _qkv(b, h, hkv, sq, sk, d, dtype, seed)]


@pytest.mark.gpu
@pytest.mark.skipif(_real_fa4_reason() is not None, reason=str(_real_fa4_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("causal, sq, sk, b", [(True, 512, 512, 1), (False, 384, 640, 2)])
def test_fa4_blocks_on_gpu_against_float64(dtype, d, heads, causal, sq, sk, b):
    """Forward out and lse of a block (GQA 4:1 and 1:1, head dims 64 / 128, batch 1 / 2, a causal square and a
    full rectangular block) against float64; the backward given its own out / lse against float64 autograd."""
    q, k, v = _cuda_qkv(b, *heads, sq, sk, d, dtype, 0)
    dout = torch.randn(b, sq, heads[0], d, device="cuda").to(dtype).transpose(1, 2)
    out, lse = fa4.forward(q, k, v, causal=causal, scale=d ** -0.5)
    want_out, want_lse = reference(q.cpu(), k.cpu(), v.cpu(), causal, d ** -0.5)
    close(out.cpu(), want_out, dtype, "out")
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=2e-2, rtol=2e-3)
    dq, dk, dv = fa4.backward(dout, q, k, v, out, lse, causal=causal, scale=d ** -0.5)
    qr, kr, vr = (t.cpu().double().requires_grad_() for t in (q, k, v))
    reference(qr, kr, vr, causal, d ** -0.5)[0].backward(dout.cpu().double())
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), (qr.grad, kr.grad, vr.grad), strict=True):
        close(got.cpu(), want, dtype, name)


@pytest.mark.gpu
@pytest.mark.skipif(_real_fa4_reason() is not None, reason=str(_real_fa4_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa4_varlen_on_gpu_and_no_recompile_across_block_shapes(dtype):
    """Packed calls on the GPU against float64 (length-1 segments, Sq != Sk full segments, 300 segments in one
    call), then 20 calls whose segment lengths change: FA4 compiles per variant, not per length, so no new
    entry appears in its compile caches after the first call of each variant. A variant is the dtype, head dims,
    the causal flag and, in 4.0.0b36's backward, whether the longest segment fits one tile of q or of k
    (``single_q_block`` / ``single_k_block`` in its compile key, interface.py; tiles of 64 or 128 rows): the H200
    run of 2026-11-27 saw 2 backward compiles when only a longest segment of 90 had been warmed, so each tile class
    is warmed (longest 40, 100, 200) before the lengths change."""
    g = torch.Generator().manual_seed(5)

    def pack(lengths_q, lengths_k, causal):
        q = torch.randn(sum(lengths_q), 8, 128, generator=g).to(dtype).cuda()
        k, v = (torch.randn(sum(lengths_k), 2, 128, generator=g).to(dtype).cuda() for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0)], dtype=torch.int32, device="cuda")
                      for n in (lengths_q, lengths_k))
        out, lse = fa4.varlen_forward(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                      scale=0.09)
        fa4.varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                            scale=0.09)
        return q, k, v, out, cu_q, cu_k

    lengths_q, lengths_k = [1, 33, 200, 1, *[5] * 296], [1, 70, 200, 1, *[5] * 296]
    q, k, v, out, cu_q, cu_k = pack(lengths_q, lengths_k, False)
    for i in range(len(lengths_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want, _ = reference(*(t[s].cpu().transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))), False, 0.09)
        close(out[qs].cpu().transpose(0, 1)[None], want, dtype, f"segment {i}")
    interface = fa4.interface()
    caches = (interface._flash_attn_fwd.compile_cache.cache, interface._flash_attn_bwd.compile_cache.cache)
    for causal in (True, False):
        for longest in (40, 100, 200):  # one tile of 64 / of 128 rows, two of 128, more: every tile class
            pack([longest, 7], [longest, 7], causal)
    sizes = [len(c) for c in caches]
    rng = torch.Generator().manual_seed(6)
    for _ in range(20):
        lengths = torch.randint(2, 300, (int(torch.randint(2, 40, (1,), generator=rng)),), generator=rng).tolist()
        pack(lengths, lengths, True)
        pack(lengths, lengths, False)
    assert [len(c) for c in caches] == sizes, "FA4 compiled again for new block shapes"
