"""Ulysses (``a2a``, ``a2a+p2p``) with head counts the all-to-all size does not split: padded heads, exact results.

:func:`cp_handler.ops.ulysses.a2a_head_plan` pads query heads as ``(Hkv, g) -> (Hkv', g')`` and K/V to ``Hkv'``
zero heads; the padded query heads (and lse rows) are dropped after the inverse all-to-all. Checked here:

* the plan: for every ``(H, Hkv, A)`` with ``H <= 24``, ``A <= 8`` it satisfies the even rule, moves the fewest
  elements among all grid paddings (a brute force over a wider range than the plan's search), and is today's plan
  (no padding, the same KV replicas) whenever the even rule already held;
* the attention: out, dq, dk, dv (and dsinks for one case, lse for direct ``a2a_attn`` calls) of cp 2 / 4 ``a2a``
  and cp 4 ``a2a+p2p`` at ``[2, 2]`` and ``[4, 1]``, heads (3, 3), (6, 3), (6, 2), (5, 1), (7, 7) and the even
  control (4, 4); bshd and thd (three documents), causal, one sliding window, one MLA value head dim, one
  bidirectional case;
* a negative control: the same run with the padded heads dropped at the wrong places (the first ``H`` of ``H'``)
  fails the comparison, so the exactness checks see a misaligned head.

Reference: :func:`cp_handler.testing.reference.attention` (explicit masked softmax per document, autograd) in
float64 on the same float32 inputs. Tolerance: float32, atol = rtol = 1e-5: the padded heads do not change the
real heads' arithmetic (zero K/V heads meet only padded queries, dropped outputs send zero gradients), so what
differs from the reference is float32 rounding of the blockwise kernels and their log-sum-exp merges (eps = 1.2e-7
per rounding on values of order 1; measured max 1.4e-6: 7x headroom), while a misaligned head gives errors of
order 1e-1.
"""

import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from cp_handler import LocalContextParallelHandler, build_dp_cp_groups
from cp_handler.core.layout import ZigzagDocs
from cp_handler.core.masks import AttentionMask
from cp_handler.ops.ulysses import A2AHeads, a2a_attn, a2a_head_plan
from cp_handler.testing.reference import attention as attention_reference

TOL = 1e-5
SCALE = 0.3
HEAD_DIM = 8
HEADS = [(3, 3), (6, 3), (6, 2), (5, 1), (7, 7), (4, 4)]
"""(query heads, KV heads): uneven for a2a sizes 2 and 4, and the even control (4, 4)."""
EXTRA = [  # (name, heads, qkv_format, mask, sinks, value head dim)
    ("thd", (6, 2), "thd", AttentionMask(), False, HEAD_DIM),
    ("thd sinks", (5, 1), "thd", AttentionMask(), True, HEAD_DIM),
    ("window", (7, 7), "bshd", AttentionMask(window=5), False, HEAD_DIM),
    ("mla", (6, 3), "bshd", AttentionMask(), False, 12),
    ("bidirectional", (3, 3), "bshd", AttentionMask(causal=False), False, HEAD_DIM),
]
THD_LENGTHS = [13, 19, 7]


def _old_replicas(heads: int, kv_heads: int, a2a_size: int) -> int | None:
    """The rule before padding (the removed ``check_a2a_heads``): KV replicas, ``None`` where it refused."""
    if heads % a2a_size:
        return None
    if kv_heads % a2a_size == 0:
        return 1
    return a2a_size // kv_heads if a2a_size % kv_heads == 0 else None


def _sent(padded_kv: int, padded_group: int, replicas: int) -> int:
    """Head rows the all-to-alls move (q and out, K/V after replication): ``H' + Hkv' r``."""
    return padded_kv * padded_group + padded_kv * replicas


def test_head_plan_is_even_minimal_and_today_when_even():
    for a2a in range(1, 9):
        for heads in range(1, 25):
            for kv_heads in (n for n in range(1, heads + 1) if heads % n == 0):
                plan = a2a_head_plan(heads, kv_heads, a2a)
                group, where = heads // kv_heads, (heads, kv_heads, a2a)
                assert plan.padded_kv_heads >= kv_heads and plan.padded_group >= group, where
                assert plan.padded_heads % a2a == 0, where
                assert _old_replicas(plan.padded_heads, plan.padded_kv_heads, a2a) == plan.replicas, where
                assert plan.heads_per_rank * a2a == plan.padded_heads, where
                assert plan.kv_heads_per_rank * a2a == plan.padded_kv_heads * plan.replicas, where
                assert plan.padded == ((plan.padded_kv_heads, plan.padded_group) != (kv_heads, group)), where
                brute = min((_sent(kv, g, r), kv * g) for kv in range(kv_heads, kv_heads + 4 * a2a + 1)
                            for g in range(group, group + 2 * a2a + 1)
                            if (r := _old_replicas(kv * g, kv, a2a)) is not None)
                assert (_sent(plan.padded_kv_heads, plan.padded_group, plan.replicas), plan.padded_heads) == brute, \
                    (where, plan, brute)
                today = _old_replicas(heads, kv_heads, a2a)
                if today is not None:
                    assert not plan.padded and plan.replicas == today, (where, plan)
                else:
                    assert plan.padded, (where, plan)
    assert a2a_head_plan(7, 7, 4) == A2AHeads(7, 7, 4, 8, 1, 1, True)
    assert a2a_head_plan(5, 1, 4) == A2AHeads(5, 1, 4, 1, 8, 4, True)  # 8 q heads; not (2, 6): 12
    assert a2a_head_plan(6, 2, 4) == A2AHeads(6, 2, 4, 2, 4, 2, True)


def test_head_plan_refuses_only_nonsense():
    for args, message in [((0, 1, 2), r"query heads \(0\), KV heads \(1\) and the a2a size \(2\) >= 1"),
                          ((4, 0, 2), r"KV heads \(0\)"), ((4, 2, 0), r"a2a size \(0\)"),
                          ((6, 4, 2), r"query heads \(6\) a multiple of KV heads \(4\)")]:
        with pytest.raises(ValueError, match=message):
            a2a_head_plan(*args)


def test_padding_keeps_real_heads_in_place():
    plan = a2a_head_plan(6, 2, 4)  # (Hkv, g) = (2, 3) -> (2, 4)
    q = torch.arange(6.0).view(1, 6, 1, 1)
    padded = plan.pad_q(q)
    assert padded.flatten().tolist() == [0, 1, 2, 0, 3, 4, 5, 0]
    assert torch.equal(plan.unpad(padded), q)
    assert plan.pad_q(torch.arange(1.0, 7.0), 0).tolist() == [1, 2, 3, 0, 4, 5, 6, 0]
    assert plan.pad_kv(torch.ones(1, 2, 3, 4)).shape == (1, 2, 3, 4)  # Hkv' = Hkv: no KV padding
    assert a2a_head_plan(7, 7, 4).pad_kv(torch.ones(1, 7, 3, 4))[:, 7].abs().sum() == 0


def _attn_module(mask: AttentionMask, sinks):
    window = None if mask.window is None else (mask.window - 1, 0)
    return types.SimpleNamespace(window_size=window, softcap=None, sinks=sinks, softmax_scale=SCALE)


def _inputs(heads, kv_heads, total, v_head_dim, sinks):
    q = torch.randn(total, heads, HEAD_DIM)
    k = torch.randn(total, kv_heads, HEAD_DIM)
    v = torch.randn(total, kv_heads, v_head_dim)
    dout = torch.randn(total, heads, v_head_dim)
    return q, k, v, dout, torch.randn(heads) if sinks else None


def _reference(q, k, v, dout, mask, sinks, lengths):
    """``(out, dq, dk, dv, dsinks)`` in float64 of the float32 inputs."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    sinks = sinks.double().requires_grad_() if sinks is not None else None
    out = attention_reference(*leaves, mask, SCALE, sinks, lengths)
    out.backward(dout.double())
    return out.detach(), *(t.grad for t in leaves), None if sinks is None else sinks.grad


def check_handler(rank, world, groups, pattern, name, heads, qkv_format, mask, with_sinks, v_head_dim,
                  expect_mismatch=False):
    """One case through ``core_attn`` (float32) against :func:`_reference`; ``expect_mismatch``: the negative
    control, the comparison must fail."""
    torch.manual_seed(0)  # the same global tensors on every rank
    lengths = [16 * world] if qkv_format == "bshd" else THD_LENGTHS
    q, k, v, dout, sinks = _inputs(*heads, sum(lengths), v_head_dim, with_sinks)
    want = _reference(q, k, v, dout, mask, sinks, lengths)
    kwargs = {"cp_group": groups.cp_group, "qkv_format": qkv_format, "cp_comm_type": pattern,
              "hierarchical_cp_groups": groups.hierarchical_cp_groups}
    if qkv_format == "thd":
        kwargs["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    handler = LocalContextParallelHandler(**kwargs)
    seq_dim = 1 if qkv_format == "bshd" else 0

    def local(t):
        return handler.dispatch(t.unsqueeze(0) if qkv_format == "bshd" else t, seq_dim)

    q_l, k_l, v_l = (local(t).requires_grad_() for t in (q, k, v))
    sinks_l = sinks.clone().requires_grad_() if sinks is not None else None
    out = handler.core_attn(_attn_module(mask, sinks_l), q_l, k_l, v_l,
                            attn_mask_type="causal" if mask.causal else "no_mask")
    out.backward(local(dout))
    where = f"{pattern} cp={world} {name} heads={heads} {qkv_format} {mask}"
    got = [out, q_l.grad, k_l.grad, v_l.grad]
    expected = [local(t.float()) for t in want[:4]]
    if sinks is not None:  # each rank holds its queries' share of a parameter's gradient: summed over the group
        grad = sinks_l.grad.clone()
        dist.all_reduce(grad, group=groups.cp_group)
        got.append(grad)
        expected.append(want[4].float())
    errors = [(got_t - want_t).abs().max().item() for got_t, want_t in zip(got, expected, strict=True)]
    if expect_mismatch:
        assert max(errors) > 1e-2, f"negative control ({where}): a misaligned head went unseen, errors {errors}"
        return
    for label, got_t, want_t in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=False):
        torch.testing.assert_close(got_t, want_t, atol=TOL, rtol=TOL, msg=lambda m, n=label: f"{n} ({where}): {m}")


def check_lse(rank, world, groups, pattern, heads):
    """A direct ``a2a_attn(..., return_lse=True)`` (bshd, causal): out and the lse of the real heads only."""
    torch.manual_seed(1)
    total = 16 * world
    q, k, v, _, _ = _inputs(*heads, total, HEAD_DIM, False)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(heads[0] // heads[1], 1))
    scores = (scores * SCALE).masked_fill(torch.ones(total, total, dtype=torch.bool).triu(1), float("-inf"))
    want_lse = scores.logsumexp(-1)
    index = ZigzagDocs.uniform(total, world).dispatch_index(rank)
    q_l, k_l, v_l = (t.index_select(0, index).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if pattern == "a2a":
        out, lse = a2a_attn(q_l, k_l, v_l, a2a_group=groups.cp_group, causal=True, scale=SCALE, return_lse=True)
    else:
        a2a_group, p2p_group = groups.hierarchical_cp_groups
        out, lse = a2a_attn(q_l, k_l, v_l, a2a_group=a2a_group, p2p_group=p2p_group, causal=True, scale=SCALE,
                            return_lse=True)
    want_out = attention_reference(q.double(), k.double(), v.double(), AttentionMask(), SCALE, None, [total])
    assert out.shape == q_l.shape and lse.shape == q_l.shape[:3], (out.shape, lse.shape)
    torch.testing.assert_close(out[0].transpose(0, 1), want_out.index_select(0, index).float(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse[0], want_lse.index_select(1, index).float(), atol=TOL, rtol=TOL)


def _worker(rank, world, configs):
    for pattern, sizes in configs:
        groups = build_dp_cp_groups(world, "cpu", sizes)
        for heads in HEADS:
            check_handler(rank, world, groups, pattern, "causal", heads, "bshd", AttentionMask(), False, HEAD_DIM)
            check_lse(rank, world, groups, pattern, heads)
        for name, heads, qkv_format, mask, sinks, v_head_dim in EXTRA:
            check_handler(rank, world, groups, pattern, name, heads, qkv_format, mask, sinks, v_head_dim)
        if (pattern, world) == ("a2a", 4):  # (6, 2) at A = 4: (2, 3) -> (2, 4), the real heads are not the first 6
            unpad = A2AHeads.unpad
            A2AHeads.unpad = lambda self, t: t[:, :self.heads]
            try:
                check_handler(rank, world, groups, pattern, "wrong unpad", (6, 2), "bshd", AttentionMask(), False,
                              HEAD_DIM, expect_mismatch=True)
            finally:
                A2AHeads.unpad = unpad


@pytest.mark.parametrize("world, configs", [
    (2, [("a2a", None)]),
    (4, [("a2a", None), ("a2a+p2p", [2, 2]), ("a2a+p2p", [4, 1])]),
])
def test_uneven_heads_match_single_process(world, configs):
    run_distributed(_worker, world, configs)
