"""Attention variants under CP (sliding window, chunked attention, soft-capping, learnable sinks) against
a float64 single-process reference: every comm type of the local backend, bshd / sbhd / thd, cp 1, 2, 4,
windows and chunks smaller than, equal to and larger than a zigzag chunk and a rank's shard.

Reference: explicit masked softmax per document in float64 (scores, soft-cap, mask, the sink as an extra
column of the softmax), gradients by autograd. The handler runs the same float64 inputs through
``core_attn`` with the variant as attributes of ``attn_mod``.

Tolerance: atol = rtol = 1e-10 in float64. Each query's output is a log-sum-exp merge of at most a few
dozen blocks (eps = 2.2e-16 per rounding on values of order 1): measured max error ~1e-14, while a wrong
mask, a dropped block or a missing sink gives errors of order 1e-2 and more. GPU mode (``-m gpu``; passed on an
H100 on 2026-11-24, before MLA, two-sided windows and zero-length documents were added; those pending): the same
cases on CUDA in fp32 / bf16 / fp16 against the float64 reference, with the tolerances of tests/device_cases.py
(MLA through ``attn_kernel="efficient"``, the opt-in that run would verify).
"""

import os
import types

import pytest
import torch
import torch.distributed as dist
from device_cases import GPU_CASES
from dist_utils import run_distributed

from cp_handler import LocalContextParallelHandler, build_dp_cp_groups
from cp_handler.core.layout import ZigzagDocs
from cp_handler.core.masks import AttentionMask, mask_blocks
from cp_handler.ops.collectives import count_comms
from cp_handler.ops.halo import halo_applies
from cp_handler.ops.kernels import MASKED_KERNEL_ENV
from cp_handler.ops.ring import ring_attn
from cp_handler.testing.reference import attention as attention_reference

TOL = 1e-10
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
GPU_HEAD_DIMS = {HEAD_DIM: (16, 16), 12: (16, 24), 6: (16, 8)}
"""On CUDA, each value head dim of :data:`MASKS` as ``(q/k head dim, value head dim)``: the same shapes (MLA wider
and narrower than q/k) in multiples of 8, which the memory-efficient kernel (MLA's opt-in there) takes; the GPU
pass of 2026-11-27 was refused a value head dim of 12."""


def reference(q, k, v, dout, mask: AttentionMask, scale: float, sinks, lengths):
    """``(out, dq, dk, dv, dsinks)`` of packed ``(T, H, D)`` float64 tensors, each document alone (the conformance
    kit's reference, :func:`cp_handler.testing.reference.attention`)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out = attention_reference(q, k, v, mask, scale, sinks, lengths)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


MASKS = {
    # name: (mask as a function of the zigzag chunk c of the first document, with sinks, value head dim); a value
    # head dim other than HEAD_DIM is multi-head latent attention (MLA), wider and narrower than q/k
    "window<chunk": (lambda c: AttentionMask(window=max(2, c // 2)), False, HEAD_DIM),
    "window=chunk+1": (lambda c: AttentionMask(window=c + 1), True, 12),  # lookback = c: the halo's edge
    "window=shard": (lambda c: AttentionMask(window=2 * c), False, HEAD_DIM),
    "window>shard": (lambda c: AttentionMask(window=3 * c + 1, softcap=3.0), False, 6),
    "chunk=3": (lambda c: AttentionMask(chunk=3), False, 12),
    "chunk=c": (lambda c: AttentionMask(chunk=c), True, HEAD_DIM),  # aligned: no communication
    "chunk=shard": (lambda c: AttentionMask(chunk=2 * c), False, HEAD_DIM),
    "chunk>shard": (lambda c: AttentionMask(chunk=3 * c + 1), False, 6),
    "window+chunk": (lambda c: AttentionMask(window=c + 2, chunk=3 * c - 1), False, HEAD_DIM),
    "softcap": (lambda c: AttentionMask(softcap=2.0), False, 12),
    "sinks": (lambda c: AttentionMask(), True, 6),
    "mla": (lambda c: AttentionMask(), False, 12),
    "softcap+sinks, no_mask": (lambda c: AttentionMask(causal=False, softcap=2.0), True, 12),
    # two-sided windows without the causal mask, Transformer Engine's window_size (L, R) with no_mask
    "two-sided (c/2, c/2)": (lambda c: AttentionMask(causal=False, window=c // 2 + 1, window_right=c // 2), False,
                             HEAD_DIM),
    "two-sided (c, 2c+1)": (lambda c: AttentionMask(causal=False, window=c + 1, window_right=2 * c + 1), True, 12),
    "right only (-1, 2)": (lambda c: AttentionMask(causal=False, window_right=2), False, 6),
    "(W, 0) no_mask": (lambda c: AttentionMask(causal=False, window=c, window_right=0), False, 12),
    "two-sided (3c, 1), softcap": (lambda c: AttentionMask(causal=False, window=3 * c + 1, window_right=1,
                                                            softcap=2.0), False, HEAD_DIM),
}


def window_size(mask: AttentionMask):
    """Transformer Engine's ``(left, right)`` of ``mask`` (``-1``: unbounded), ``None`` without a window."""
    if mask.window is None and mask.window_right is None:
        return None
    left = -1 if mask.window is None else mask.window - 1
    return left, 0 if mask.causal else (-1 if mask.window_right is None else mask.window_right)


def attn_module(mask: AttentionMask, sinks):
    return types.SimpleNamespace(window_size=window_size(mask), attention_chunk_size=mask.chunk,
                                 softcap=mask.softcap, sinks=sinks, softmax_scale=0.3)


def check_variant(rank, world, groups, pattern, qkv_format, name, lengths, case=None):
    """One variant through ``core_attn`` against :func:`reference`; ``case``: a GPU DeviceCase (the
    inputs rounded to its dtype for the reference), default float64 on CPU."""
    torch.manual_seed(0)  # the same global tensors on every rank
    total, chunk = sum(lengths), ZigzagDocs.from_lengths(lengths, world).chunk(0)
    make_mask, with_sinks, v_head_dim = MASKS[name]
    head_dim, v_head_dim = (HEAD_DIM, v_head_dim) if case is None else GPU_HEAD_DIMS[v_head_dim]
    mask = make_mask(chunk)
    q = torch.randn(total, HEADS, head_dim, dtype=torch.float64)
    dout = torch.randn(total, HEADS, v_head_dim, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, head_dim, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, v_head_dim, dtype=torch.float64)
    sinks = torch.randn(HEADS, dtype=torch.float64) if with_sinks else None
    if case is not None:  # the reference gets the inputs the device gets
        q, k, v, dout = (case.reference(t) for t in (q, k, v, dout))
        sinks = case.reference(sinks) if sinks is not None else None
    device, dtype = ("cpu", torch.float64) if case is None else (case.device, case.dtype)
    tol = TOL if case is None else case.tolerance(world, TOL)
    want = reference(q, k, v, dout, mask, 0.3, sinks, lengths)
    kwargs = {"cp_group": groups.cp_group if world > 1 else None, "qkv_format": qkv_format, "cp_comm_type": pattern,
              "hierarchical_cp_groups": groups.hierarchical_cp_groups}
    if qkv_format == "thd":
        kwargs["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if case is not None and v_head_dim != head_dim:  # MLA on CUDA: opt-in until a GPU run verifies it
        kwargs["attn_kernel"] = "efficient"
    handler = LocalContextParallelHandler(**kwargs)

    def to_format(t):  # packed (T, ...) -> the handler's global layout on the device
        return {"thd": t, "bshd": t.unsqueeze(0), "sbhd": t.unsqueeze(1)}[qkv_format].to(device, dtype)

    seq_dim = 1 if qkv_format == "bshd" else 0
    q_l, k_l, v_l = (handler.dispatch(to_format(t), seq_dim).requires_grad_() for t in (q, k, v))
    sinks_l = sinks.to(device, dtype).requires_grad_() if sinks is not None else None
    out = handler.core_attn(attn_module(mask, sinks_l), q_l, k_l, v_l,
                            attn_mask_type="causal" if mask.causal else "no_mask")
    out.backward(handler.dispatch(to_format(dout), seq_dim))
    where = f"{pattern} cp={world} {qkv_format} {name} {mask} lengths={lengths}"
    for label, got, expected in zip(("out", "dq", "dk", "dv"), (out, q_l.grad, k_l.grad, v_l.grad), want,
                                    strict=False):
        torch.testing.assert_close(got.double(), handler.dispatch(to_format(expected), seq_dim).double(), atol=tol,
                                   rtol=tol, msg=lambda m, n=label: f"{n} ({where}): {m}")
    if sinks is not None:  # a parameter's gradient: each rank holds its queries' share (the DP/CP all-reduce sums)
        grad = sinks_l.grad.clone()
        if world > 1:
            dist.all_reduce(grad, group=groups.cp_group)
        torch.testing.assert_close(grad.cpu().double(), want[4], atol=tol, rtol=tol,
                                   msg=lambda m: f"dsinks ({where}): {m}")


LENGTHS = {"bshd": [48], "sbhd": [48], "thd": [37, 0, 9, 64, 0]}  # zero-length documents: padding a batch's count


def _worker(rank, world, patterns, sizes, formats, case=None, names=tuple(MASKS), masked_kernel=None):
    if masked_kernel is not None:
        os.environ[MASKED_KERNEL_ENV] = masked_kernel
    groups = build_dp_cp_groups(world, "cpu" if case is None else case.device, sizes)
    for pattern in patterns:
        for qkv_format in formats:
            lengths = [16 * world] if qkv_format != "thd" else LENGTHS["thd"]
            for name in names:
                check_variant(rank, world, groups, pattern, qkv_format, name, lengths, case)


@pytest.mark.parametrize("world, patterns, sizes, formats", [
    (1, ["p2p"], None, ["bshd", "thd"]),
    (2, ["p2p", "all_gather", "a2a"], None, ["bshd", "sbhd", "thd"]),
    (4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2], ["bshd", "thd"]),
])
def test_variants_match_float64_reference(world, patterns, sizes, formats):
    run_distributed(_worker, world, patterns, sizes, formats)


@pytest.mark.parametrize("case", GPU_CASES)
def test_variants_on_gpu(case):
    """Every variant and comm type on CUDA (ranks sharing a GPU stage collectives through host memory)."""
    run_distributed(_worker, 4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2], ["bshd", "thd"], case,
                    device="cuda")


BAND_MASKS = tuple(name for name, (make, _, v_head_dim) in MASKS.items() if v_head_dim == HEAD_DIM and
                   make(16).softcap is None)
"""The variants whose masked blocks are bands (windows, the causal edge; chunks leave none), q/k/v of one head dim."""


@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.id != "cuda-fp32"])
def test_flash_windows_on_gpu(case):
    """The masked blocks on FlashAttention-2's own windows (``CP_HANDLER_MASKED_KERNEL=flash_gqa``, the opt-in
    :mod:`cp_handler.ops.kernels.flash_window` declares) against the float64 reference, every comm type."""
    run_distributed(_worker, 4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2], ["bshd", "thd"], case, BAND_MASKS,
                    "flash_gqa", device="cuda")


SOFTCAP_BAND_MASKS = (*BAND_MASKS, *(name for name, (make, _, v_head_dim) in MASKS.items() if v_head_dim == HEAD_DIM
                                     and make(16).softcap is not None))
"""The band variants and the soft-capped ones, q/k/v of one head dim: what FA4's masked calls declare."""


def _fa4_missing() -> str | None:
    from cp_handler.ops.kernels import fa4

    return "needs CUDA" if not torch.cuda.is_available() else fa4.cannot_run_here(torch.empty(1, device="cuda"))


@pytest.mark.skipif(_fa4_missing() is not None, reason=str(_fa4_missing()))
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.id != "cuda-fp32"])
def test_fa4_masked_on_gpu(case):
    """The masked blocks on FlashAttention-4's windows and soft-cap (``CP_HANDLER_MASKED_KERNEL=fa4``, opt-in until
    this passes) against the float64 reference, every comm type (scripts/gpu_check.py: the fa4_patterns stage)."""
    run_distributed(_worker, 4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2], ["bshd", "thd"], case,
                    SOFTCAP_BAND_MASKS, "fa4", device="cuda")


def _bytes_worker(rank, world):
    """Bytes a rank sends per layer (forward + backward), counted with count_comms."""
    group = dist.group.WORLD
    s_local = 256 // world
    layout = ZigzagDocs.uniform(256, world)
    sent = {}
    for v_head_dim in (HEAD_DIM, 12):  # 12: MLA, K and V travel with their own widths
        q = torch.randn(1, HEADS, s_local, HEAD_DIM, requires_grad=True)
        k = torch.randn(1, KV_HEADS, s_local, HEAD_DIM, requires_grad=True)
        v = torch.randn(1, KV_HEADS, s_local, v_head_dim, requires_grad=True)
        for name, mask in {"full": AttentionMask(), "window 9": AttentionMask(window=9),
                           "window 5": AttentionMask(window=5),
                           "two-sided (4, 4)": AttentionMask(causal=False, window=5, window_right=4),
                           "chunk 32 (aligned)": AttentionMask(chunk=32)}.items():
            with count_comms() as counter:
                out, _ = ring_attn(q, k, v, group=group, causal=mask.causal, scale=0.3, mask=mask)
                out.sum().backward()
            sent[name, v_head_dim] = counter.bytes_sent
    kv_row = 1 * KV_HEADS * 2 * HEAD_DIM * 4  # K and V of one position, batch 1, float32
    # full causal ring: (cp - 1) K/V shards forward and back, and (cp - 1) dK/dV partials (float32)
    assert sent["full", HEAD_DIM] >= 2 * (world - 1) * s_local * kv_row
    # window W: a rank sends at most 2 (W - 1) rows of K/V forward, and their dK/dV back
    assert halo_applies(layout, AttentionMask(window=9))
    assert 0 < sent["window 9", HEAD_DIM] <= 2 * (2 * 8 * kv_row), sent
    # two-sided (L, R) = (4, 4): the 4 rows next to each neighbouring zigzag chunk on both sides, twice what
    # the causal window 5 (4 rows to the left) sends
    assert 0 < sent["two-sided (4, 4)", HEAD_DIM] == 2 * sent["window 5", HEAD_DIM], sent
    assert sent["chunk 32 (aligned)", HEAD_DIM] == 0, sent  # chunks aligned with the zigzag chunks need nothing
    # MLA: every message carries K (Dqk wide) and V (Dv wide) rows, nothing padded
    for name in ("full", "window 9", "two-sided (4, 4)"):
        assert sent[name, 12] * 2 * HEAD_DIM == sent[name, HEAD_DIM] * (HEAD_DIM + 12), (name, sent)


def test_halo_exchange_bytes_proportional_to_window():
    run_distributed(_bytes_worker, 4)


def test_mask_blocks_cover_every_visible_pair_once():
    """The planner's pieces: no empty block, full / causal pieces exactly full / lower-triangular, and
    every visible (query, key) pair in exactly one piece (random masks and ranges)."""
    gen = torch.Generator().manual_seed(0)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for i in range(600):
        if i % 3:  # causal: windows and chunks
            mask = AttentionMask(window=pick([None, 1, 2, 5, 70, 130]), chunk=pick([None, 1, 3, 16, 100]),
                                 softcap=pick([None, 5.0]))
        else:  # bidirectional: two-sided windows
            mask = AttentionMask(causal=False, window=pick([None, 1, 2, 5, 70, 130]),
                                 window_right=pick([None, 0, 1, 4, 70, 130]), softcap=pick([None, 5.0]))
        nq, nk, qp, kp = (int(x) for x in torch.randint(1, 300, (4,), generator=gen))
        visible = mask.visible(torch.arange(qp, qp + nq)[:, None], torch.arange(kp, kp + nk)[None])
        cover = torch.zeros(nq, nk, dtype=torch.int)
        for q_rows, k_rows, kind in mask_blocks(slice(0, nq), qp, slice(0, nk), kp, mask, tile=16, key_tile=32):
            part = visible[q_rows, k_rows]
            assert part.any()
            if kind is False:
                assert part.all()
            elif kind is True:
                assert torch.equal(part, torch.ones_like(part).tril())
            else:
                assert (kind.q_pos, kind.k_pos) == (qp + q_rows.start, kp + k_rows.start)
            cover[q_rows, k_rows] += 1
        assert (cover <= 1).all() and (cover[visible] == 1).all(), (mask, nq, nk, qp, kp)


@pytest.mark.parametrize("attrs, error, match", [
    ({"window_size": (0, 0)}, None, None),  # window 1: each query sees itself (valid)
    ({"window_size": (3, 2)}, ValueError, r"window_size=\(3, 2\) with attn_mask_type='causal': a causal mask takes"),
    ({"window_size": (3, -2)}, ValueError, r"window_size=\(3, -2\): each bound must be >= -1"),
    ({"attention_chunk_size": 0}, ValueError, r"chunk=0 must be >= 1"),
    ({"attention_chunk_size": 2.5}, TypeError, r"chunk=2.5 must be an int"),
    ({"softcap": 0.0}, ValueError, r"softcap=0.0 must be a finite number > 0"),
    ({"softcap": float("nan")}, ValueError, r"softcap=nan"),
    ({"sinks": torch.zeros(3, dtype=torch.float64)}, ValueError, r"sinks has shape \(3,\); it must be \(4,\)"),
    ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, r"sinks must be a floating tensor"),
    ({"sliding_window": 4}, ValueError, r"attn_mod.sliding_window=4 is not read .* set attn_mod.window_size"),
    ({"s_aux": torch.zeros(4)}, ValueError, r"attn_mod.s_aux=.* set attn_mod.sinks"),
])
def test_bad_variant_attributes_raise(attrs, error, match):
    handler = LocalContextParallelHandler(cp_group=None, qkv_format="bshd")
    q = torch.randn(1, 8, HEADS, HEAD_DIM, dtype=torch.float64)
    module = types.SimpleNamespace(**attrs)
    if error is None:
        handler.core_attn(module, q, q, q)
        return
    with pytest.raises(error, match=match):
        handler.core_attn(module, q, q, q)


def test_no_mask_with_window_or_chunk_raises():
    handler = LocalContextParallelHandler(cp_group=None, qkv_format="bshd")
    q = torch.randn(1, 8, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"window_size=\(-1, 0\) with attn_mask_type='no_mask': \(-1, 0\) is"):
        handler.core_attn(types.SimpleNamespace(window_size=(-1, 0)), q, q, q, attn_mask_type="no_mask")
    with pytest.raises(ValueError, match=r"attention_chunk_size=4 needs attn_mask_type='causal'"):
        handler.core_attn(types.SimpleNamespace(attention_chunk_size=4), q, q, q, attn_mask_type="no_mask")


def test_mla_default_scale_is_the_query_key_head_dim():
    """Without ``softmax_scale`` the scale is ``1/sqrt(Dqk)`` also when values are wider (as torch's SDPA and
    Transformer Engine); the output has the values' head dim."""
    handler = LocalContextParallelHandler(cp_group=None, qkv_format="bshd")
    q, k = torch.randn(2, 1, 10, HEADS, HEAD_DIM, dtype=torch.float64).unbind(0)
    v = torch.randn(1, 10, HEADS, 20, dtype=torch.float64)
    out = handler.core_attn(types.SimpleNamespace(), q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    assert out.shape == (1, 10, HEADS, 20)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=TOL, rtol=TOL)
