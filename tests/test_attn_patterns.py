"""Every cp_comm_type of the local backend vs single-process attention on the same inputs.

Checked: out, lse, dq, dk, dv; causal and full; MHA, GQA and uneven GQA ratios; cp in {1, 2, 4, 8};
a2a+p2p at [2, 2], with a level of size 1 ([1, 4] = ring, [4, 1] = a2a), and [2, 4] / [4, 2] at cp=8.
Reference: the CPU flash kernel over the whole sequence (out, lse), autograd of SDPA (gradients),
sharded with the zigzag layout.

GPU mode (``-m gpu``): the same checks on CUDA in fp32 / bf16 / fp16 against a float64 reference, with
the tolerances of tests/device_cases.py.

Tolerance (CPU): float32, atol = rtol = 4e-6 * cp. Each ring step / gathered block adds one
log-sum-exp merge (a few float32 roundings, eps = 1.2e-7, on values of order 1), so error grows
with the number of merges, at most cp; measured max 1.9e-6 at cp=4 and cp=8, i.e. >= 8x headroom,
while a masking or layout mistake gives O(1) errors.
"""

import pytest
import torch
import torch.distributed as dist
from attn_reference import run_pattern, single_process_attention, zigzag_shard
from device_cases import CPU, GPU_CASES
from dist_utils import run_distributed

from cp_handler import HierarchicalContextParallelHandler, build_dp_cp_groups
from cp_handler.ops.ulysses import a2a_attn
from cp_handler.runtime.groups import hierarchical_level_ranks

HEADS = {"mha": (4, 4, 64), "gqa": (8, 2, 80), "gqa_ratio3": (12, 4, 32), "mqa": (4, 1, 32)}
"""name -> (query heads, KV heads, head dim)."""


def check_pattern(pattern, groups, rank, world, causal, heads_name, case=CPU):
    heads, kv_heads, head_dim = HEADS[heads_name]
    torch.manual_seed(0)
    b, s = 2, 8 * world
    q, dout = torch.randn(b, heads, s, head_dim), torch.randn(b, heads, s, head_dim)
    k, v = torch.randn(b, kv_heads, s, head_dim), torch.randn(b, kv_heads, s, head_dim)
    expected = single_process_attention(*(case.reference(t) for t in (q, k, v, dout)), causal)

    def shard(t):
        return zigzag_shard(t, 2, rank, world)

    q_l, k_l, v_l = (case.local(shard(t)).requires_grad_() for t in (q, k, v))
    out, lse = run_pattern(pattern, q_l, k_l, v_l, groups, causal=causal, scale=head_dim**-0.5)
    out.backward(case.local(shard(dout)))
    tol = case.tolerance(world, 4e-6 * world)
    where = f"{pattern} cp={world} causal={causal} {heads_name} {case.device} {case.dtype}"
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q_l.grad, k_l.grad, v_l.grad),
                               expected, strict=True):
        case.assert_close(got, shard(want), tol, msg=lambda m, n=name, c=where: f"{n} ({c}): {m}")


def _flat_worker(rank, world, patterns, heads_names, case=CPU):
    groups = build_dp_cp_groups(world, case.device)
    for pattern in patterns:
        for causal in (True, False):
            for heads_name in heads_names:
                check_pattern(pattern, groups, rank, world, causal, heads_name, case)


def _hierarchical_worker(rank, world, sizes_list, heads_names, causal_list, case=CPU):
    for sizes in sizes_list:
        groups = build_dp_cp_groups(world, case.device, sizes)
        for causal in causal_list:
            for heads_name in heads_names:
                check_pattern("a2a+p2p", groups, rank, world, causal, heads_name, case)


@pytest.mark.parametrize("world, heads_names", [(1, ["mha", "gqa"]), (2, ["mha", "gqa", "gqa_ratio3"]),
                                                (4, ["mha", "gqa", "gqa_ratio3", "mqa"])])
def test_flat_patterns_match_single_process(world, heads_names):
    run_distributed(_flat_worker, world, ["p2p", "all_gather", "a2a"], heads_names)


def test_hierarchical_cp4_matches_single_process():
    run_distributed(_hierarchical_worker, 4, [[2, 2], [1, 4], [4, 1]], ["mha", "gqa", "mqa"], [True, False])


@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_patterns_on_gpu(world, case):
    """Every pattern on CUDA (ranks sharing a GPU stage collectives through host memory)."""
    run_distributed(_flat_worker, world, ["p2p", "all_gather", "a2a"], ["mha", "gqa"], case, device="cuda")
    if world == 4:
        run_distributed(_hierarchical_worker, world, [[2, 2]], ["mha", "gqa"], [True, False], case, device="cuda")


def test_host_staging_harness_on_cpu():
    """The GPU mode's harness, run on CPU with every collective staged into fresh host copies: a copy
    that did not come back would break parity."""
    run_distributed(_flat_worker, 2, ["p2p", "all_gather", "a2a"], ["gqa"], stage_through_host=True)
    run_distributed(_hierarchical_worker, 4, [[2, 2]], ["gqa"], [True], stage_through_host=True)


def check_group_layout(rank, world, cp, sizes):
    """DeviceMesh groups = the documented arithmetic; every level lies inside this rank's CP group."""
    groups = build_dp_cp_groups(cp, "cpu", sizes)
    cp_ranks = dist.get_process_group_ranks(groups.cp_group)
    assert cp_ranks == list(range(rank // cp * cp, rank // cp * cp + cp))
    expected = hierarchical_level_ranks(world, sizes)
    for level, group in enumerate(groups.hierarchical_cp_groups):
        ranks = dist.get_process_group_ranks(group)
        assert rank in ranks and ranks in expected[level] and set(ranks) <= set(cp_ranks), (level, ranks)


def _cp8_worker(rank, world):
    for cp, sizes in [(8, [2, 2, 2]), (8, [4, 2]), (4, [2, 2]), (4, [1, 4])]:
        check_group_layout(rank, world, cp, sizes)
    _hierarchical_worker(rank, world, [[2, 4], [4, 2]], ["gqa"], [True])


def test_group_layout_and_hierarchical_cp8():
    run_distributed(_cp8_worker, 8)


def _errors_worker(rank, world):
    groups = build_dp_cp_groups(world, "cpu", [2, 2])
    q = torch.randn(1, 6, 4, 8)  # heads the a2a size does not split run padded (tests/test_a2a_uneven_heads.py)
    with pytest.raises(ValueError, match=r"query heads \(6\) a multiple of KV heads \(4\)"):
        a2a_attn(q, q[:, :4], q[:, :4], a2a_group=groups.cp_group, causal=True, scale=1.0)
    with pytest.raises(ValueError, match=r"needs hierarchical_cp_groups=\[a2a_group, p2p_group\], got 0"):
        HierarchicalContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match=r"sizes \[4, 4\] multiplying to 16, but the CP group has 4 ranks"):
        HierarchicalContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p",
                                           hierarchical_cp_groups=[groups.cp_group, groups.cp_group])
    with pytest.raises(ValueError, match=r"multiply to 3, but context_parallel_size=4"):
        build_dp_cp_groups(world, "cpu", [3, 1])


def test_bad_inputs_raise_before_any_collective():
    run_distributed(_errors_worker, 4)
