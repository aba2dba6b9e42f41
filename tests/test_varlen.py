"""Packed (varlen) execution of block plans: the batching the CUDA ``flash_varlen`` kernel relies on,
checked on CPU through ``cpu_varlen`` (the same packed interface, computed per segment).

* The calls of a plan: every block in exactly one call, one mask flag per call, disjoint query rows
  inside a call, ``fresh`` exactly when no earlier call wrote those rows (hypothesis over packs,
  cp sizes, ring steps and the all-gather plan, CPU causal tiling included).
* Every pattern with ``CP_HANDLER_ATTN_KERNEL=cpu_varlen`` against the single-process / per-document
  reference: the thd parity test (cp 1, 2, 4; a2a+p2p at [2, 2]) and the bshd pattern test (cp 2),
  with the tolerances of those tests (float32 4e-6 * cp).
* The attention variants (test_masks' cases at cp 4) through ``cpu_varlen``, against float64.
* On CUDA (``-m gpu``): rank plans through ``flash_varlen`` against the same plans through ``flash``.
"""

import os

import pytest
import test_attn_patterns
import test_masks
import test_thd
import torch
from dist_utils import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_handler.bench.plan import PlanCase, PlanShape, rank_plan
from cp_handler.core.layout import ZigzagDocs
from cp_handler.core.masks import CAUSAL, AttentionMask
from cp_handler.ops.all_gather import all_gather_blocks
from cp_handler.ops.blocks import blocks_backward_, blocks_forward_, new_accumulators, tile_causal
from cp_handler.ops.halves import docs_rows, halves_order, halves_step_plans, uses_halves
from cp_handler.ops.kernels import ATTN_KERNEL_ENV, KERNELS
from cp_handler.ops.packed_blocks import packed_calls, plan_key
from cp_handler.ops.ring import ring_blocks
from cp_handler.ops.spec import AttnSpec


def _plans(lengths, cp):
    layout = ZigzagDocs.from_lengths(lengths, cp)
    for rank in range(cp):
        for causal in (True, False):
            for step in range(cp):
                yield ring_blocks(layout, step, rank, AttentionMask(causal=causal))
            if cp > 1:
                yield all_gather_blocks(layout, rank, AttentionMask(causal=causal))


@settings(max_examples=40)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), cp=st.sampled_from([1, 2, 4]),
       tile=st.sampled_from([None, 8, 64]))
def test_calls_partition_the_plan(lengths, cp, tile):
    for blocks in _plans(lengths, cp):
        plan = plan_key(tile_causal(blocks, tile) if tile else blocks)
        calls = packed_calls(plan, torch.device("cpu"))
        seen, written = [], set()
        for call in calls:
            cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
            members = []
            for i in range(len(cu_q) - 1):
                q_rows = call.q_index[cu_q[i]:cu_q[i + 1]].tolist()
                k_rows = call.kv_index[cu_k[i]:cu_k[i + 1]].tolist()
                assert q_rows == list(range(q_rows[0], q_rows[-1] + 1)) and k_rows == list(range(k_rows[0],
                                                                                               k_rows[-1] + 1))
                members.append((q_rows[0], q_rows[-1] + 1, k_rows[0], k_rows[-1] + 1, call.causal))
            rows = call.q_index.tolist()
            assert len(rows) == len(set(rows)), "query rows overlap inside one call"
            for span, index in ((call.q_span, rows), (call.kv_span, call.kv_index.tolist())):
                assert (span is not None) == (index == list(range(index[0], index[-1] + 1)))  # a view iff one range
                assert span is None or span == (index[0], index[-1] + 1)
            assert call.fresh == written.isdisjoint(rows)
            assert call.max_q == max(b - a for a, b, *_ in members) and call.blocks == len(members)
            written |= set(rows)
            seen += members
        assert sorted(seen) == sorted(plan)


def _thd_varlen(rank, world, patterns, sizes):
    os.environ[ATTN_KERNEL_ENV] = "cpu_varlen"
    test_thd._thd_worker(rank, world, patterns, sizes)


def _bshd_varlen(rank, world, patterns, heads):
    os.environ[ATTN_KERNEL_ENV] = "cpu_varlen"
    test_attn_patterns._flat_worker(rank, world, patterns, heads)


@pytest.mark.parametrize("world, patterns, sizes", test_thd.THD_CASES)
def test_cpu_varlen_thd_matches_per_document(world, patterns, sizes):
    run_distributed(_thd_varlen, world, patterns, sizes)


def test_cpu_varlen_bshd_matches_single_process():
    run_distributed(_bshd_varlen, 2, ["p2p", "all_gather", "a2a"], ["gqa"])


def _masks_varlen(rank, world, patterns, sizes, formats):
    os.environ[ATTN_KERNEL_ENV] = "cpu_varlen"
    test_masks._worker(rank, world, patterns, sizes, formats)


def test_cpu_varlen_attention_variants_match_float64():
    """The packed calls beside the masked blocks (windows, chunks, soft-caps, sinks): the path of CUDA's
    automatic bf16 kernel, ``flash_varlen``, checked through ``cpu_varlen`` with test_masks' cases at cp 4."""
    run_distributed(_masks_varlen, 4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2], ["bshd", "thd"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pattern, fmt, cp", [("p2p", "thd", 1), ("p2p", "thd", 4), ("all_gather", "thd", 4),
                                              ("a2a+p2p", "thd", 4), ("p2p", "bshd", 4), ("all_gather", "bshd", 4)])
def test_flash_varlen_plans_match_flash_blocks(pattern, fmt, cp):
    """GPU check of the packed kernel (and of the packing's views, gathers and scatters on
    CUDA): rank 0's whole plan (remote K/V stood in by local ones, as ``cp-bench --modes plan``
    does) through ``flash_varlen`` against the same plan through the verified ``flash`` blocks, bf16,
    outputs, lse and gradients. Tolerance: relative error 1e-2 (each is within 2-3e-3 of float64)."""
    shape = PlanShape(num_heads=8, num_kv_heads=2, head_dim=64, device="cuda", thd_mean_doc=100)
    plan = rank_plan(PlanCase(pattern, fmt, cp, 2048), shape)
    torch.manual_seed(0)
    q, dout = (torch.randn(1, plan.heads, plan.q_len, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, plan.kv_heads, plan.kv_len, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    results = {}
    for kernel in ("flash", "flash_varlen"):
        spec = AttnSpec(CAUSAL, 0.125, None, KERNELS[kernel])
        out, lse = new_accumulators(q)
        for i, blocks in enumerate(plan.steps):
            blocks_forward_(out, lse, q, k, v, blocks, spec, fresh=i == 0)
        out = out.to(q.dtype)
        grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
        for blocks in plan.steps:
            blocks_backward_(*grads, dout, q, k, v, out, lse, blocks, spec)
        results[kernel] = (out, lse, *grads)
    for label, got, want in zip(("out", "lse", "dq", "dk", "dv"), results["flash_varlen"], results["flash"],
                                strict=True):
        if label == "lse":  # rows no block reaches (padding) hold -inf in both: compare where, then the rest
            assert torch.equal(got.isneginf(), want.isneginf())
            got, want = got[want.isfinite()], want[want.isfinite()]
        error = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        assert error < 1e-2, (label, error)


def _pairs(blocks, row_map_q, row_map_k):
    """The (query row, key row) pairs ``blocks`` compute, through row maps (reordered -> local rows)."""
    return sorted((row_map_q[a], row_map_k[b]) for q, k, c in blocks for a in range(q.start, q.stop)
                  for b in range(k.start, k.stop) if c is not True or b - k.start <= a - q.start)


@settings(max_examples=40)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=10), cp=st.sampled_from([2, 4]),
       a2a=st.sampled_from([1, 2, 4]))
def test_reordered_ring_steps_cover_the_same_pairs_in_contiguous_calls(lengths, cp, a2a):
    """The ring over reordered rows (ops/halves.py, packed documents through a packed kernel): every step's
    plans hold exactly the (query, key) token pairs of :func:`ring_blocks`, and every packed call's query and key
    rows are one range each (views: no gather, no scatter); a block from a later rank, which arrives in docs order,
    is one call. The ring of the whole group (``a2a`` 1) and the
    all-to-all's inner ring (over ``cp / a2a`` ranks; over one rank for plain a2a, whose documents keep the
    whole group's padding)."""
    layout = ZigzagDocs.from_lengths(lengths, cp).inner(min(a2a, cp))
    assert uses_halves(layout, True, CAUSAL) == (layout.lengths != layout.padded_lengths or
                                                  (layout.size > 1 and len(lengths) > 1))
    if not uses_halves(layout, True, CAUSAL):
        return
    for rank in range(layout.size):
        order = halves_order(layout, rank, torch.device("cpu"))[0].tolist()
        for step in range(layout.size):
            src = (rank - step) % layout.size
            src_order = halves_order(layout, src, torch.device("cpu"))[0]
            if src > rank:  # the block arrives in docs order (it passed the ring's wrap)
                src_order = src_order[docs_rows(layout, src, torch.device("cpu"))]
            src_order = src_order.tolist()
            plans = halves_step_plans(layout, step, rank)
            got = sorted(p for plan in plans for p in _pairs(plan, order, src_order))
            identity = list(range(layout.local_len))
            assert got == _pairs(ring_blocks(layout, step, rank, CAUSAL), identity, identity)
            assert step > 0 or len(plans) <= 1  # step 0 is one plan: its first call writes fresh
            assert src <= rank or len(plans) <= 1  # a block from a later rank: one call (keys in docs order)
            for plan in plans:
                for call in packed_calls(plan_key(plan), torch.device("cpu")):
                    assert call.q_span is not None and call.kv_span is not None, (lengths, cp, rank, step)
