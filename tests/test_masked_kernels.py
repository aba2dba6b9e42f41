"""Masked blocks on the kernels that declare them (issue 52, part 2): what a block needs, the routing, the CPU
flash kernel's additive masks, and FlashAttention-2's windows as arithmetic (their GPU run: scripts/gpu_check.py).

Every comparison is in float64 against the explicit scores of :mod:`cp_handler.ops.kernels.masked` (the reference
path), tolerance 1e-12: one block is a single softmax over at most a few hundred keys (eps 2.2e-16 per rounding,
measured ~1e-15), while a wrong mask moves values by 1e-2 and more. The end-to-end CP cases (every comm type and
format, float64 against a single-process reference) are tests/test_masks.py, which runs through this routing.
"""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_handler.core.masks import AttentionMask, BlockMask, block_needs, mask_blocks
from cp_handler.ops.blocks import plan_backward, plan_forward
from cp_handler.ops.kernels import KERNELS, MASKED_KERNEL_ENV, count_attn_work, cpu_flash, flash_window, masked
from cp_handler.ops.spec import AttnSpec

TOL = 1e-12

masks = st.one_of(
    st.builds(AttentionMask, window=st.sampled_from([None, 1, 2, 5, 40, 130]),
              chunk=st.sampled_from([None, 1, 3, 16, 100]), softcap=st.sampled_from([None, 5.0])),
    st.builds(AttentionMask, causal=st.just(False), window=st.sampled_from([None, 1, 2, 5, 40, 130]),
              window_right=st.sampled_from([None, 0, 1, 4, 40]), softcap=st.sampled_from([None, 5.0])))
ranges = st.tuples(*(st.integers(1, 200) for _ in range(4)))  # nq, nk, q_pos, k_pos


def _masked_blocks(mask, nq, nk, qp, kp, tile=16, key_tile=32):
    return [(q, k, b) for q, k, b in mask_blocks(slice(0, nq), qp, slice(0, nk), kp, mask, tile=tile,
                                                 key_tile=key_tile) if isinstance(b, BlockMask)]


def _visible(mask, block, nq, nk):
    return mask.visible(torch.arange(block.q_pos, block.q_pos + nq)[:, None],
                        torch.arange(block.k_pos, block.k_pos + nk)[None, :])


@settings(deadline=None, max_examples=150)
@given(masks, ranges)
def test_block_needs_are_sufficient(mask, sizes):
    """Dropping every feature a block does not need leaves its visibility unchanged; the planner's blocks never
    need a chunk boundary; a soft-cap is needed by every block of a soft-capped mask."""
    for q_rows, k_rows, block in _masked_blocks(mask, *sizes):
        nq, nk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
        needs = block_needs(block, nq, nk)
        assert "chunk" not in needs
        assert ("softcap" in needs) == (mask.softcap is not None)
        reduced = AttentionMask(causal=mask.causal and "causal" in needs,
                                window=mask.window if "window" in needs else None,
                                window_right=mask.window_right if "window_right" in needs else None)
        assert torch.equal(_visible(reduced, block, nq, nk), _visible(mask, block, nq, nk)), (mask, block, needs)


def _flash_visibility(nq, nk, queries, keys, left, right):
    """FlashAttention-2's local mask (bottom-right aligned; -1 unbounded) on the first ``queries`` x ``keys``."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    centre = i + keys - queries
    seen = (i < queries) & (j < keys)
    if left >= 0:
        seen &= j >= centre - left
    if right >= 0:
        seen &= j <= centre + right
    return seen


@settings(deadline=None, max_examples=150)
@given(masks, ranges)
def test_flash_window_band_is_the_blocks_visibility(mask, sizes):
    """:func:`flash_window.band`: FlashAttention-2's window on the cut block sees exactly the block's pairs (a
    soft-cap changes scores, not pairs: FA4 takes it beside the band), and the kernel is never given a negative
    finite window (which it would read as unbounded)."""
    for q_rows, k_rows, block in _masked_blocks(mask, *sizes):
        nq, nk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
        if "chunk" in block_needs(block, nq, nk):  # the planner never makes one (test_block_needs_are_sufficient)
            with pytest.raises(ValueError, match="not a band"):
                flash_window.band(block, nq, nk)
            continue
        queries, keys, left, right = flash_window.band(block, nq, nk)
        assert 0 < queries <= nq and 0 < keys <= nk and left >= -1 and right >= -1
        assert torch.equal(_flash_visibility(nq, nk, queries, keys, left, right), _visible(mask, block, nq, nk))


def _inputs(nq, nk, heads=4, kv_heads=2, head_dim=8, v_head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, nq, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, nk, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, nk, v_head_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, heads, nq, v_head_dim, generator=gen, dtype=torch.float64)
    return q, k, v, dout


@pytest.mark.parametrize("v_head_dim", [8, 12])  # 12: multi-head latent attention (the kernel pads)
@pytest.mark.parametrize("mask, q_pos, k_pos", [
    (AttentionMask(window=5), 40, 30),  # a window's left band and the causal edge
    (AttentionMask(causal=False, window=3, window_right=2), 10, 0),  # two-sided: rows 0-6 see no key here
    (AttentionMask(chunk=8), 5, 0),  # a small block across a chunk boundary, run whole
])
def test_cpu_flash_masked_block_equals_explicit_scores(mask, q_pos, k_pos, v_head_dim):
    """One block through the CPU flash kernel's additive mask against the explicit scores: out, lse (a row that
    sees no key: out 0, the lowest finite lse) and the gradients given that out / lse."""
    nq, nk = 12, 9
    block = BlockMask(mask, q_pos, k_pos)
    q, k, v, dout = _inputs(nq, nk, v_head_dim=v_head_dim)
    want_out, want_lse = masked.masked_forward(q, k, v, block, 0.3)
    out, lse = cpu_flash.masked_forward(q, k, v, block, scale=0.3)
    torch.testing.assert_close(out, want_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse, want_lse, atol=TOL, rtol=TOL)
    seen = _visible(mask, block, nq, nk).any(-1)
    if not seen.all():  # the case exercises rows without keys
        assert (lse[..., ~seen] == torch.finfo(lse.dtype).min).all()
    lse_rows = want_lse.masked_fill(~seen, 0.0).contiguous()  # rows without keys: any finite merged lse
    want = masked.masked_backward(dout, q, k, v, want_out, lse_rows, block, 0.3)
    got = cpu_flash.masked_backward(dout, q, k, v, want_out, lse_rows, block, scale=0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, atol=TOL, rtol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def _plan_run(mask, monkeypatch, forced=None, n=96):
    if forced is None:
        monkeypatch.delenv(MASKED_KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(MASKED_KERNEL_ENV, forced)
    blocks = tuple(mask_blocks(slice(0, n), 0, slice(0, n), 0, mask, tile=16, key_tile=32))
    spec = AttnSpec(mask, 0.3, None, KERNELS["cpu_flash"])
    q, k, v, dout = _inputs(n, n, seed=1)
    with count_attn_work() as work:
        out, lse = plan_forward(q, k, v, spec, blocks)
    grads = plan_backward(dout, q, k, v, out, lse, spec, blocks)
    masked_count = sum(isinstance(b, BlockMask) for _, _, b in blocks)
    return (out, *grads), work.explicit_blocks, masked_count


@pytest.mark.parametrize("mask, explicit_automatic", [
    (AttentionMask(window=7), False),
    (AttentionMask(causal=False, window=6, window_right=3), False),
    (AttentionMask(window=20, chunk=24), False),
    (AttentionMask(window=7, softcap=4.0), True),  # a soft-cap has no additive form: explicit scores on CPU
])
def test_routing_on_cpu_and_the_override(mask, explicit_automatic, monkeypatch):
    """The automatic routing puts windows and chunks on cpu_flash (0 explicit blocks) and soft-caps on the explicit
    scores; CP_HANDLER_MASKED_KERNEL=explicit forces the reference path, with the same result."""
    auto, explicit_auto, total = _plan_run(mask, monkeypatch)
    assert total > 0 and explicit_auto == (total if explicit_automatic else 0)
    forced, explicit_forced, _ = _plan_run(mask, monkeypatch, "explicit")
    assert explicit_forced == total
    for a, b in zip(auto, forced, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("value, match", [
    ("flash", r"CP_HANDLER_MASKED_KERNEL='flash' cannot run this masked block: it runs on cuda"),
    ("cudnn", r"CP_HANDLER_MASKED_KERNEL='cudnn': the kernels of masked blocks are \['cpu_flash', 'fa4', 'flash_gqa', "
              r"'flash'\] and 'explicit'"),
    ("cpu_flash", r"cannot run this masked block: it computes .*, a block needs \['softcap'\]"),
])
def test_a_forced_masked_kernel_that_cannot_run_is_refused(value, match, monkeypatch):
    mask = AttentionMask(window=7, softcap=4.0) if value == "cpu_flash" else AttentionMask(window=7)
    with pytest.raises(ValueError, match=match):
        _plan_run(mask, monkeypatch, value)


def test_a_forced_masked_kernel_is_refused_when_the_call_is_resolved(monkeypatch):
    """Through a handler: the refusal comes from the call's spec (every rank alike, before the ring communicates),
    for anything a block of the mask may need, not from inside a ring step."""
    from cp_handler import LocalContextParallelHandler
    from cp_handler.ops import blocks

    monkeypatch.setenv(MASKED_KERNEL_ENV, "cpu_flash")
    route = blocks.route_masked
    monkeypatch.setattr(blocks, "route_masked", lambda *a: pytest.fail("reached a ring step"))
    handler = LocalContextParallelHandler(cp_group=None, qkv_format="bshd")
    q = torch.randn(1, 32, 4, 8)
    attn_mod = types.SimpleNamespace(window_size=(7, 0), softcap=4.0, softmax_scale=0.3)
    with pytest.raises(ValueError, match=r"CP_HANDLER_MASKED_KERNEL='cpu_flash' cannot run this masked block: it "
                                         r"computes .*, a block needs \['softcap'\]"):
        handler.core_attn(attn_mod, q, q, q, attn_mask_type="causal")
    attn_mod.softcap = None
    monkeypatch.setattr(blocks, "route_masked", route)
    assert handler.core_attn(attn_mod, q, q, q, attn_mask_type="causal").shape == q.shape


def test_flash_window_calls_bind_on_meta():
    """FlashAttention-2's window calls as the CUDA code makes them, on ``meta`` tensors (the ops' meta kernels):
    the arguments bind and the shapes come back whole, cut rows and keys padded (the GPU run checks the values)."""
    q = torch.empty(1, 4, 20, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 10, 64, device="meta", dtype=torch.bfloat16)
    block = BlockMask(AttentionMask(window=8), 10, 0)  # row i sees keys i+3..i+10: rows 7..19 none of these 10
    queries, keys, _, _ = flash_window.band(block, 20, 10)
    assert (queries, keys) == (7, 10)
    out, lse = flash_window.masked_forward(q, k, k, block, scale=0.1)
    assert out.shape == q.shape and lse.shape == (1, 4, 20)
    grads = flash_window.masked_backward(q, q, k, k, out, lse.float(), block, scale=0.1)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert KERNELS["flash"].verified_masks == frozenset()  # opt-in until a GPU run
