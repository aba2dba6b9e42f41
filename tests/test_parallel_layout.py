"""ParallelLayout over world sizes 1..64, simulated in one process with PyTorch's fake process group:
every rank builds its groups through DeviceMesh exactly as it would under torchrun, and the
invariants are checked on the groups it gets (not on a second copy of the rank arithmetic)."""

import itertools
import random

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from cp_handler.runtime.parallel_layout import GROUP_KINDS, ParallelLayout


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts_of(world, rng, count):
    """Up to ``count`` layouts of ``world`` ranks: the most factored one and random others."""
    shapes = []
    for tp, cp, pp in itertools.product(divisors(world), repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for ep in divisors(dp * cp):
            levels = (2, cp // 2) if cp % 2 == 0 and cp > 2 else None
            shapes.append(ParallelLayout(world, tp, cp, pp, ep, levels))
    shapes.sort(key=lambda s: -sum(x > 1 for x in (s.tensor_model_parallel_size, s.context_parallel_size,
                                                    s.pipeline_model_parallel_size, s.data_parallel_size,
                                                    s.expert_model_parallel_size)))
    return shapes[:1] + rng.sample(shapes[1:], min(count - 1, len(shapes) - 1))


def groups_of_every_rank(layout):
    """{rank: {kind: sorted ranks}} as DeviceMesh builds them on each rank."""
    seen = {}
    kinds = list(GROUP_KINDS)
    if layout.hierarchical_context_parallel_sizes:
        kinds += [f"cp_level_{i}" for i in range(len(layout.hierarchical_context_parallel_sizes))]
    for rank in range(layout.world_size):
        dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
        try:
            groups = layout.build()
            seen[rank] = {kind: sorted(groups.ranks(kind)) for kind in kinds}
        finally:
            dist.destroy_process_group()
    return seen


def expected_size(layout, kind):
    tp, cp, dp, pp, ep = (layout.tensor_model_parallel_size, layout.context_parallel_size, layout.data_parallel_size,
                          layout.pipeline_model_parallel_size, layout.expert_model_parallel_size)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "tp_cp": tp * cp, "dp_cp": dp * cp, "ep": ep,
             "edp": layout.expert_data_parallel_size}
    if kind.startswith("cp_level_"):
        return layout.hierarchical_context_parallel_sizes[int(kind[-1])]
    return sizes[kind]


def check_layout(layout):
    seen = groups_of_every_rank(layout)
    stage = {r: g["pp"].index(r) for r, g in seen.items()}  # pipeline stage of each rank
    for rank, groups in seen.items():
        for kind, members in groups.items():
            assert rank in members and len(members) == expected_size(layout, kind), (layout, rank, kind, members)
            for m in members:  # a partition: every member sees the same group
                assert seen[m][kind] == members, (layout, kind, rank, m)
            if kind != "pp":  # no group crosses pipeline stages
                assert {stage[m] for m in members} == {stage[rank]}, (layout, kind, members)
        for a, b in [("tp", "cp"), ("tp", "dp"), ("cp", "dp"), ("tp", "pp"), ("cp", "pp"), ("dp", "pp"),
                     ("ep", "edp"), ("ep", "tp"), ("edp", "tp")]:
            assert set(groups[a]) & set(groups[b]) == {rank}, (layout, rank, a, b)  # orthogonal kinds
        assert set(groups["ep"]) <= set(groups["dp_cp"]) and set(groups["edp"]) <= set(groups["dp_cp"])
        assert set(groups["tp"]) | set(groups["cp"]) <= set(groups["tp_cp"])
        assert set(groups["dp"]) | set(groups["cp"]) <= set(groups["dp_cp"])
        if layout.expert_model_parallel_size == layout.context_parallel_size:
            assert groups["ep"] == groups["cp"]
        if layout.hierarchical_context_parallel_sizes:
            inner, outer = groups["cp_level_0"], groups["cp_level_1"]
            assert set(inner) <= set(groups["cp"]) and set(outer) <= set(groups["cp"])
            assert set(inner) & set(outer) == {rank}
            cp_order = groups["cp"]  # inner level = adjacent CP ranks
            positions = [cp_order.index(m) for m in inner]
            assert positions == list(range(positions[0], positions[0] + len(inner)))
    assert seen[0]["tp"] == list(range(layout.tensor_model_parallel_size))  # tp fastest


@pytest.mark.parametrize("world", list(range(1, 65)))
def test_layout_invariants(world):
    rng = random.Random(world)
    for layout in layouts_of(world, rng, count=3 if world <= 16 else 2):
        check_layout(layout)


def test_megatron_rank_order_example():
    layout = ParallelLayout(16, tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=4)
    seen = groups_of_every_rank(layout)
    assert seen[0]["tp"] == [0, 1] and seen[0]["cp"] == [0, 2] and seen[0]["dp"] == [0, 4]
    assert seen[0]["pp"] == [0, 8] and seen[0]["ep"] == [0, 2, 4, 6] and seen[1]["ep"] == [1, 3, 5, 7]
    assert seen[9]["edp"] == [9]
    assert "pp stage 1: experts   [edp][ep][tp] = [[[8, 9], [10, 11], [12, 13], [14, 15]]]" in layout.describe()


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tensor_model_parallel_size=3), "not a multiple of tp \\* cp \\* pp"),
    (dict(world_size=8, context_parallel_size=2, expert_model_parallel_size=3), "must divide dp \\* cp"),
    (dict(world_size=8, context_parallel_size=4, hierarchical_context_parallel_sizes=(2, 3)),
     r"\[2, 3\] multiply to 6, but context_parallel_size=4"),
    (dict(world_size=8, context_parallel_size=2, data_parallel_size=2), "dp must be 4"),
    (dict(world_size=0), "world_size=0"),
])
def test_bad_layouts_raise_before_any_group(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_node_levels_follow_the_node_boundary():
    """The default hierarchical levels (a2a inside a node, p2p across): the CP ranks on one node, then the nodes a CP
    group spans; with tp the CP ranks are tp apart; groups that split unevenly over nodes are refused by name."""
    from cp_handler.runtime.parallel_layout import default_hierarchical_sizes

    assert ParallelLayout(8, context_parallel_size=4).node_levels(2) == (2, 2)
    assert ParallelLayout(8, context_parallel_size=4).node_levels(8) == (4, 1)
    assert ParallelLayout(16, context_parallel_size=8).node_levels(4) == (4, 2)
    assert ParallelLayout(16, tensor_model_parallel_size=2, context_parallel_size=4).node_levels(4) == (2, 2)
    with pytest.raises(ValueError, match="do not fall into equal runs per node"):
        ParallelLayout(6, context_parallel_size=6).node_levels(4)
    layout = ParallelLayout(8, context_parallel_size=8)
    assert default_hierarchical_sizes("a2a+p2p", layout, 4) == [4, 2]
    assert default_hierarchical_sizes("a2a+p2p", layout, 8) == [8, 1]
    assert default_hierarchical_sizes("auto", layout, 4) == [4, 2]
    assert default_hierarchical_sizes("auto", layout, 8) is None  # one node: auto picks among the flat patterns
    assert default_hierarchical_sizes(["p2p", "a2a"], layout, 4) is None
