"""Packed variable-length sequences (thd): layout, dispatch/combine, roll, RoPE and attention of every
pattern against per-document single-process references, at cp in {1, 2, 4}.

Document lengths come from hypothesis: many tiny documents, one huge one, length-1 documents, lengths
not divisible by 2*cp, zero-length documents. In the multi-rank test hypothesis runs inside every rank, derandomized and
without shrinking, so all ranks draw the same cases and a failing rank fails the test at once.

Tolerances: moves (dispatch, combine, roll, RoPE row selection) are exact (float64, torch.equal);
attention float32 atol = rtol = 4e-6 * cp as in test_attn_patterns.py (one merge per step).
GPU mode (``-m gpu``): the same on CUDA (moves exact; attention in fp32 / bf16 / fp16 against a
float64 reference with the tolerances of tests/device_cases.py).
"""

import pytest
import torch
import torch.distributed as dist
from attn_reference import per_document_attention, run_pattern
from device_cases import CPU, GPU_CASES
from dist_utils import fails_fast, run_distributed
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from cp_handler import HierarchicalContextParallelHandler, build_dp_cp_groups
from cp_handler.core.layout import ZigzagDocs
from cp_handler.runtime.rope import apply_rotary, rotary_freqs

LENGTHS = st.lists(st.one_of(st.just(0), st.integers(1, 3), st.integers(4, 24), st.integers(60, 130)), min_size=1,
                   max_size=8).filter(lambda lengths: sum(lengths) > 0)  # 0: a zero-length document


def te_partitioned_indices(cu_seqlens_padded: list[int], cp: int, rank: int) -> list[int]:
    """Transformer Engine's ``thd_get_partitioned_indices`` written plainly: per padded document,
    rank r takes chunks r and 2cp-1-r of 2cp (indices into the padded global sequence)."""
    out = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:], strict=True):
        chunk = (end - start) // (2 * cp)
        out += list(range(start + rank * chunk, start + (rank + 1) * chunk))
        out += list(range(start + (2 * cp - 1 - rank) * chunk, start + (2 * cp - rank) * chunk))
    return out


def test_regression_rope_positions_restart_cp2():
    layout = ZigzagDocs.from_cu_seqlens(torch.tensor([0, 4, 8], dtype=torch.int32), 2)
    assert layout.dispatch_index(0).tolist() == [0, 3, 4, 7]  # packed tokens on rank 0
    assert layout.positions(0).tolist() == [0, 3, 0, 3]  # their RoPE positions: restart per document


@given(lengths=LENGTHS, cp=st.sampled_from([1, 2, 3, 4, 8]))
def test_layout_partition_properties(lengths, cp):
    layout = ZigzagDocs.from_lengths(lengths, cp)
    total = sum(lengths)
    for n, padded in zip(lengths, layout.padded_lengths, strict=True):
        assert padded >= n and (cp == 1 and padded == n or padded % (2 * cp) == 0 and padded - n < 2 * cp)
    padded_starts = layout.cu_seqlens_padded.tolist()
    real_of_padded = {}
    for i, n in enumerate(lengths):
        for p in range(n):
            real_of_padded[padded_starts[i] + p] = sum(lengths[:i]) + p
    shards = [layout.dispatch_index(r) for r in range(cp)]
    for r, shard in enumerate(shards):
        expected = [real_of_padded.get(j, total) for j in te_partitioned_indices(padded_starts, cp, r)] \
            if cp > 1 else list(range(total))
        assert shard.tolist() == expected
        assert torch.equal(shard < total, layout.real_mask(r))
    gathered = torch.cat(shards)
    assert torch.equal(gathered[layout.gathered_index(real_only=True)], torch.arange(total))


def roll_per_document(x: torch.Tensor, shift: int, cu_seqlens: list[int]) -> torch.Tensor:
    """y[p] = x[p - shift] inside each document, zero where that leaves the document."""
    zero_row = x.shape[0]
    source = [s + p - shift if 0 <= p - shift < e - s else zero_row
              for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True) for p in range(e - s)]
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, torch.tensor(source, device=x.device))


def rope_per_document(t: torch.Tensor, cu_seqlens: list[int], freqs: torch.Tensor) -> torch.Tensor:
    positions = torch.cat([torch.arange(e - s) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)])
    positions = positions.to(t.device)
    return apply_rotary(t, freqs[positions], "thd")


def check_moves(h, group, cu, device):
    total = cu[-1]
    torch.manual_seed(1)
    x = torch.randn(total, 3, dtype=torch.float64).to(device).requires_grad_()
    local = h.dispatch(x, 0)
    assert local.shape[0] == h.token_layout.thd_layout.local_len
    assert torch.equal(h.combine(local.detach(), 0), x.detach())
    real = h.token_layout.thd_layout.real_mask(h.cp_rank).to(device)
    assert torch.all(local.detach()[~real] == 0)  # padding inserted as zeros
    rolled, _ = h.roll_tensor(local, shifts=-1, dims=0)
    assert torch.equal(h.combine(rolled.detach(), 0), roll_per_document(x.detach(), -1, cu))
    pad = ~h.token_layout.thd_layout.real_mask(h.cp_rank).to(device)
    dirty = local.detach() + 7.0 * pad[:, None]  # activations are not zero at padding slots
    for shift in (-1, 1):
        rolled_dirty, _ = h.roll_tensor(dirty, shifts=shift, dims=0)
        assert torch.equal(h.combine(rolled_dirty, 0), roll_per_document(x.detach(), shift, cu))
        assert torch.all(rolled_dirty[pad] == 0)
    w = torch.randn_like(x)
    (rolled * h.dispatch(w, 0)).sum().backward()
    grad = x.grad.clone()
    if group is not None:
        dist.all_reduce(grad, group=group)
    x_ref = x.detach().clone().requires_grad_()
    (roll_per_document(x_ref, -1, cu) * w).sum().backward()
    assert torch.equal(grad, x_ref.grad)
    t = torch.randn(total, 2, 8).to(device)
    freqs = rotary_freqs(h.get_rotary_seq_len(h.token_layout.thd_layout.local_len), 8, device=device)
    got = h.apply_rotary_pos_emb(h.dispatch(t, 0), h.get_emb_on_this_cp_rank(freqs))
    assert torch.equal(got, h.dispatch(rope_per_document(t, cu, freqs), 0))


def check_attention(h, groups, patterns, world, cu_t, case):
    torch.manual_seed(2)
    total, heads, kv_heads, d = int(cu_t[-1]), 4, 2, 16
    q, dout = torch.randn(total, heads, d), torch.randn(total, heads, d)
    k, v = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
    real = h.token_layout.thd_layout.real_mask(h.cp_rank)
    for causal in (True, False):
        expected = per_document_attention(*(case.reference(t) for t in (q, k, v, dout)), cu_t, causal)
        for pattern in patterns:
            q_l, k_l, v_l = (case.local(h.dispatch(t, 0)).transpose(0, 1).unsqueeze(0).requires_grad_()
                             for t in (q, k, v))
            out, lse = run_pattern(pattern, q_l, k_l, v_l, groups, causal=causal, scale=d**-0.5,
                                   layout=h.token_layout.thd_layout)
            out.backward(case.local(h.dispatch(dout, 0)).transpose(0, 1).unsqueeze(0))
            got = [out[0].transpose(0, 1), lse[0], *(g[0].transpose(0, 1) for g in (q_l.grad, k_l.grad, v_l.grad))]
            got = [g.detach().to("cpu", expected[0].dtype) for g in got]
            want = [h.dispatch(expected[0], 0), h.dispatch(expected[1], 1), *(h.dispatch(g, 0) for g in expected[2:])]
            tol = case.tolerance(world, 4e-6 * world)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
                a, b = (a[:, real], b[:, real]) if name == "lse" else (a[real], b[real])
                torch.testing.assert_close(a, b, atol=tol, rtol=tol,
                                           msg=lambda m, n=name, p=pattern, c=causal: f"{n} ({p}, causal={c}): {m}")
            for name, g in (("out", got[0]), ("dq", got[2]), ("dk", got[3])):
                assert torch.all(g[~real] == 0), f"{name} nonzero at padding ({pattern})"


def _thd_worker(rank, world, patterns, sizes, case=CPU):
    groups = build_dp_cp_groups(world, case.device, sizes)

    @settings(max_examples=5, derandomize=True,  # every rank draws the same cases
              phases=[Phase.explicit, Phase.generate])
    @given(lengths=LENGTHS)
    @example(lengths=[1] * 9)  # only length-1 documents
    @example(lengths=[2, 1, 130, 3, 1])  # one huge among tiny ones
    @example(lengths=[4, 4])  # the cp=2 RoPE regression layout
    @example(lengths=[0, 5, 0, 0, 17, 0])  # zero-length documents first, between and last
    @fails_fast  # a rank's failure ends the run with its message (no replay the other ranks do not make)
    def run(lengths):
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        h = HierarchicalContextParallelHandler(
            cp_group=groups.cp_group if world > 1 else None, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu_t,
            hierarchical_cp_groups=groups.hierarchical_cp_groups)
        check_moves(h, groups.cp_group if world > 1 else None, cu, case.device)
        if world > 1:
            check_attention(h, groups, patterns, world, cu_t, case)

    run()


THD_CASES = [
    (1, [], None),
    (2, ["p2p", "all_gather", "a2a"], None),
    (4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2]),
]
"""``(world, patterns, hierarchical sizes)`` of the thd parity runs (also run with the packed kernel, test_varlen)."""


@pytest.mark.parametrize("world, patterns, sizes", THD_CASES)
def test_thd_matches_per_document_reference(world, patterns, sizes):
    run_distributed(_thd_worker, world, patterns, sizes)


@pytest.mark.parametrize("case", GPU_CASES)
def test_thd_on_gpu(case):
    run_distributed(_thd_worker, 4, ["p2p", "all_gather", "a2a", "a2a+p2p"], [2, 2], case, device="cuda")
