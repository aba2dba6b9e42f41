"""Dynamic CP scheduler guarantees, property-based over length distributions and 1..1024 ranks,
plus regressions for the bug classes found in the reference implementation's review."""

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_handler.bench import dynamic_solver
from cp_handler.bench.dynamic_cp import draw_lengths, stdlib_lengths
from cp_handler.core.layout import padded_length
from cp_handler.dynamic import CostModel, Workload
from cp_handler.dynamic.scheduler import cp_size_for, group_sizes, makespan_bound, schedule_sequences

LENGTHS = st.lists(st.one_of(st.integers(1, 64), st.integers(65, 2000), st.integers(2001, 9000)),
                   min_size=1, max_size=120)


def check_schedule(lengths, ranks, budget, min_size, schedule, workload=None, rule="divisors_and_powers_of_two"):
    workload = workload or Workload()
    allowed = group_sizes(ranks, 1, None, rule)
    seen = []
    for mb in schedule.micro_batches:
        covered = []
        for group in mb.groups:
            size = group.size
            assert size in allowed, f"group of {size} ranks: not among the {rule} {allowed}"
            assert group.first >= 0 and group.first + size <= ranks
            covered += list(group.ranks)
            assert sorted(i for pack in group.packs for i in pack) == sorted(group.sequences), "packs = sequences"
            for pack in group.packs:
                assert sum(padded_length(lengths[i], size) // size for i in pack) <= budget, "pack over the budget"
            for i in group.sequences:
                assert schedule.cp_sizes[i] == size
            assert group.cost == pytest.approx(sum(workload.cost(lengths[i], size) for i in group.sequences))
            seen += group.sequences
        assert sorted(covered) == list(range(ranks)), "groups disjoint and covering every rank"
    assert sorted(seen) == list(range(len(lengths))), "every sequence scheduled exactly once"
    for i, n in enumerate(lengths):
        size = schedule.cp_sizes[i]
        assert size >= cp_size_for(n, budget, group_sizes(ranks, min_size, None, rule)), "the smallest size that fits"
    assert schedule.makespan == pytest.approx(sum(max(g.cost for g in mb.groups) for mb in schedule.micro_batches))
    assert schedule.makespan >= schedule.bound * (1 - 1e-6), "no schedule beats the lower bound"
    assert all(len(schedule.for_rank(r)) == len(schedule.micro_batches) for r in (0, ranks - 1))


@settings(max_examples=150)
@given(lengths=LENGTHS, ranks=st.integers(1, 1024), budget=st.sampled_from([256, 1000, 4096]),
       min_index=st.integers(0, 2), rule=st.sampled_from(["divisors_and_powers_of_two", "divisors", "powers_of_two"]))
def test_schedule_guarantees(lengths, ranks, budget, min_index, rule):
    every = group_sizes(ranks, 1, None, rule)
    min_size, largest = every[min(min_index, len(every) - 1)], every[-1]
    if any(padded_length(n, largest) // largest > budget for n in lengths):
        with pytest.raises(ValueError, match="does not fit"):
            schedule_sequences(lengths, ranks, budget, min_size, sizes_rule=rule)
        return
    schedule = schedule_sequences(lengths, ranks, budget, min_size, sizes_rule=rule)
    check_schedule(lengths, ranks, budget, min_size, schedule, rule=rule)


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match=r"a sequence of 5000 tokens does not fit: max_seqlen_per_dp_cp_rank=512 "
                                         r"on at most 8 ranks holds 4096 tokens"):
        schedule_sequences([10, 5000], 8, 512)
    with pytest.raises(ValueError, match=r"min_dynamic_context_parallel_size=3 must be one of the group sizes "
                                         r"\[1, 2, 4, 8\] \(divisors of and powers of two up to the 8 ranks\)"):
        schedule_sequences([10], 8, 512, min_dynamic_context_parallel_size=3)
    with pytest.raises(ValueError, match=r"min_dynamic_context_parallel_size=3 must be one of the group sizes "
                                         r"\[1, 2, 4\] \(powers of two up to the 6 ranks\)"):
        schedule_sequences([10], 6, 512, min_dynamic_context_parallel_size=3, sizes_rule="powers_of_two")


def test_regression_no_negative_index_wrap_around():
    # Rank counts that are not powers of two: a scan from the last block backwards wrapped to index -1.
    for ranks in (1, 3, 5, 6, 7):
        schedule = schedule_sequences([900, 40, 40, 300], ranks, 1000)
        check_schedule([900, 40, 40, 300], ranks, 1000, 1, schedule)
        assert all(g.first >= 0 for mb in schedule.micro_batches for g in mb.groups)


def test_regression_no_slot_filled_twice():
    lengths = [1024] * 4 + [100] * 16  # big groups first, then many small ones competing for ranks
    schedule = schedule_sequences(lengths, 8, 512)
    check_schedule(lengths, 8, 512, 1, schedule)


def test_regression_no_list_aliasing():
    schedule = schedule_sequences([10, 20, 30], 4, 64)
    groups = schedule.micro_batches[0].groups
    groups[0].sequences.append(999)
    assert all(999 not in g.sequences for g in groups[1:])


def test_regression_rank_with_no_sequence_still_has_a_group():
    schedule = schedule_sequences([5], 4, 64)  # one tiny sequence, four ranks
    assert len(schedule.micro_batches) == 1
    holders = [r for r in range(4) if schedule.micro_batches[0].group_of(r).sequences == [0]]
    assert holders == list(schedule.micro_batches[0].group_of(holders[0]).ranks)  # one group has it, all have one


def test_static_cp_puts_every_sequence_at_the_static_size():
    lengths = [5, 900, 40, 3000, 17]
    schedule = schedule_sequences(lengths, 8, 1024, min_dynamic_context_parallel_size=4,
                                  max_dynamic_context_parallel_size=4)
    check_schedule(lengths, 8, 1024, 4, schedule)
    assert set(schedule.cp_sizes) == {4}
    with pytest.raises(ValueError, match=r"max_dynamic_context_parallel_size=2 must be >= "
                                         r"min_dynamic_context_parallel_size=4"):
        schedule_sequences(lengths, 8, 1024, 4, max_dynamic_context_parallel_size=2)


@pytest.mark.parametrize("ranks, sequences, bound", [(8, 512, 1.01), (32, 512, 1.01), (256, 2048, 1.02),
                                                     (1024, 4096, 1.02)])
def test_schedule_quality_on_stdlib_lengths(ranks, sequences, bound):
    """Issue 17's protocol (stdlib file sizes cut at 32768 tokens, 4096 tokens per rank, cost L^2 / cp):
    makespan (sum over micro-batches of the busiest rank) within ``bound`` of total work / ranks, every
    draw. Megatron-LM's BalancedCPScheduler measured 1.000, 1.005, 1.013, 1.039 (median of 5)."""
    workload = Workload(quadratic=1.0, linear=0.0)
    for seed in range(3):
        lengths = draw_lengths(stdlib_lengths(32768), sequences, seed)
        schedule = schedule_sequences(lengths, ranks, 4096, 1, workload)
        check_schedule(lengths, ranks, 4096, 1, schedule, workload)
        assert schedule.makespan * ranks / sum(n * n for n in lengths) <= bound


def test_cp_size_counts_padding():
    assert cp_size_for(1025, 512, [1, 2, 4, 8]) == 4  # 1025 padded to 1028 over 2 ranks is 514 > 512
    assert cp_size_for(1024, 512, [1, 2, 4, 8]) == 2
    assert cp_size_for(1025, 512, [1, 2, 3, 6]) == 3  # 1025 padded to 1026 over 3 ranks is 342


RANK_TIMES = Path(__file__).parent.parent / "cp_handler" / "dynamic" / "rank_times" / "h100_ring_rank_times.csv"


def test_cost_model_fitted_to_the_h100_table_prices_splitting():
    """The model fitted to one H100's per-rank ring plans (42 rows) reproduces them (median relative
    error < 10%) and says what L^2 / cp does not: splitting a short sequence costs more than running
    it whole, splitting a long one pays, and a group across nodes pays for its slower link."""
    model = CostModel.from_rank_times_csv(str(RANK_TIMES))
    assert model.fit_error["rows"] == 42 and model.fit_error["median_rel"] < 0.1
    assert model.rank_plan_ms(512 * 16, 16) * 16 > 4 * model.rank_plan_ms(512 * 16, 1)  # 512 tokens per rank
    assert model.cost(4096, 16) * 16 > model.cost(4096, 1)  # a short sequence split costs more rank-time
    assert model.cost(131072, 8) < model.cost(131072, 1) / 4  # a long one finishes much sooner
    inside, across = replace(model, gpus_per_node=16), replace(model, gpus_per_node=8)
    assert across.comm_ms(65536, 16) == pytest.approx(inside.comm_ms(65536, 16) * 150 / 25)


def test_cost_model_from_plan_json(tmp_path):
    rows = [{"pattern": "whole", "qkv_format": "bshd", "cp_size": 1, "seq_len": n, "median_ms": 1e-6 * n * n + 0.1}
            for n in (1024, 4096, 8192)]
    rows += [{"pattern": "p2p", "qkv_format": "bshd", "cp_size": c, "seq_len": n,
              "median_ms": 0.2 * c + 1e-6 * n * n / c} for n in (4096, 8192) for c in (2, 4)]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": {"rows": rows}}))
    model = CostModel.from_plan_json(str(path))
    assert model.fit_error["max_rel"] < 1e-6
    assert model.step_overhead_ms == pytest.approx(0.2) and model.quadratic_ms == pytest.approx(1e-6)


@settings(max_examples=40)
@given(lengths=st.lists(st.integers(1, 131072), min_size=1, max_size=200), ranks=st.sampled_from([8, 24, 64, 256]))
def test_schedule_guarantees_with_the_gpu_cost_model(lengths, ranks):
    model = CostModel.from_rank_times_csv(str(RANK_TIMES))
    check_schedule(lengths, ranks, 16384, 1, schedule_sequences(lengths, ranks, 16384, 1, model), model)


def test_the_bound_by_hand():
    """Two sequences, sizes 1 and 2, 2 ranks: A takes 4 ms alone or 3 ms on 2 ranks, B 2 ms or 1.5 ms. At T = 3, A
    must take 2 ranks (6 rank-ms) and B one (2): 8 > 2 x 3; at T = 4 both alone: 6 <= 8. Between, A on two ranks
    and B alone need 8 <= 2T: T = 4; so the bound is 4 (A alone, B alone: 4 and 2 ms side by side)."""
    costs = torch.tensor([[4.0, 3.0], [2.0, 1.5]], dtype=torch.float64)
    bound, chosen = makespan_bound(costs, [1, 2], torch.tensor([0, 0]), 2)
    assert bound == pytest.approx(4.0, rel=1e-8) and chosen.tolist() == [0, 0]
    bound, chosen = makespan_bound(costs, [1, 2], torch.tensor([1, 0]), 2)  # A must split: 6 + 2 rank-ms over 2
    assert bound == pytest.approx(4.0, rel=1e-8) and chosen.tolist() == [1, 0]


def test_groups_of_any_divisor_and_a_sequence_too_long_for_a_power_of_two():
    """6 ranks: a sequence of 5,000 tokens needs 3 ranks at 2,048 per rank (1,667 each after padding to 6); with
    power-of-two groups it takes 4. Its group starts at any rank (contiguous, not aligned)."""
    lengths = [5000, 300, 200, 100, 50, 40]
    schedule = schedule_sequences(lengths, 6, 2048)
    check_schedule(lengths, 6, 2048, 1, schedule)
    assert schedule.cp_sizes[0] in (3, 6)
    powers = schedule_sequences(lengths, 6, 2048, sizes_rule="powers_of_two")
    check_schedule(lengths, 6, 2048, 1, powers, rule="powers_of_two")
    assert powers.cp_sizes[0] == 4 and group_sizes(6) == [1, 2, 3, 4, 6] and group_sizes(12, 2, 8) == [2, 3, 4, 6, 8]
    assert set(schedule.groups()) >= {(schedule.cp_sizes[0], g.first) for mb in schedule.micro_batches
                                      for g in mb.groups if 0 in g.sequences}


@pytest.fixture(scope="module")
def h100_workload():
    return dynamic_solver.workload("h100-nvlink")


@pytest.mark.parametrize("ranks", [8, 12])
def test_solver_within_3_percent_of_the_bound_on_the_three_mixes(h100_workload, ranks):
    """Issue 72 part 4: 1,024-document batches of each length mix (cp_handler.bench.dynamic_solver), the modelled
    H100 (patterns, communication and local documents priced by one cost model): makespan <= 1.03 x the bound."""
    for mix in dynamic_solver.MIXES:
        lengths = dynamic_solver.draw(mix, 1024, seed=0)
        schedule = schedule_sequences(lengths, ranks, 32768, 1, h100_workload)
        check_schedule(lengths, ranks, 32768, 1, schedule, h100_workload)
        assert schedule.makespan <= 1.03 * schedule.bound, (mix, schedule.makespan / schedule.bound)
        split = [c for c in schedule.comm_types if c is not None]
        assert split and set(split) <= {"p2p", "all_gather", "a2a"}, schedule.comm_types  # a pattern per split one
        assert [c for c, n in zip(schedule.cp_sizes, schedule.comm_types, strict=True) if n is None] == \
            [1] * schedule.comm_types.count(None)  # no pattern: the local documents, on one rank


def test_the_cost_table_interpolates_the_predictions_within_2_percent(h100_workload):
    """PatternWorkload tabulates each size's predictions (8 points per doubling) and interpolates: against the
    predictions themselves at lengths off the grid, at most 2% apart (measured: 1.4% at most, 0.1% median)."""
    rng = random.Random(5)
    lengths = [rng.randint(17, 131072) for _ in range(40)]
    sizes = [1, 2, 3, 4, 8]
    table = h100_workload.costs(lengths, sizes)
    for i, n in enumerate(lengths):
        for j, c in enumerate(sizes):
            direct = min(p.total_ms for p in h100_workload._choice(n, c).predictions) + \
                h100_workload.linear_ms_per_token * n / c
            assert table[i, j].item() == pytest.approx(direct, rel=0.02), (n, c)
