"""Dynamic CP scheduler guarantees, property-based over length distributions and 1..1024 ranks,
plus regressions for the bug classes found in the reference implementation's review."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_handler.dynamic.scheduler import cp_size_for, padded_len, schedule_sequences

LENGTHS = st.lists(st.one_of(st.integers(1, 64), st.integers(65, 2000), st.integers(2001, 9000)),
                   min_size=1, max_size=120)


def check_schedule(lengths, ranks, budget, min_size, schedule):
    seen = []
    for mb in schedule.micro_batches:
        covered = []
        for group in mb.groups:
            size = group.size
            assert size & (size - 1) == 0 and size >= 1 and group.first % size == 0, "aligned power of two"
            assert group.first >= 0 and group.first + size <= ranks
            covered += list(group.ranks)
            tokens = sum(padded_len(lengths[i], size) // size for i in group.sequences)
            assert tokens <= budget and tokens == group.tokens_per_rank, "rank over its token budget"
            for i in group.sequences:
                assert schedule.cp_sizes[i] == size
            seen += group.sequences
        assert sorted(covered) == list(range(ranks)), "groups disjoint and covering every rank"
    assert sorted(seen) == list(range(len(lengths))), "every sequence scheduled exactly once"
    for i, n in enumerate(lengths):
        size = schedule.cp_sizes[i]
        assert size >= min_size and padded_len(n, size) // size <= budget
        assert size == min_size or padded_len(n, size // 2) // (size // 2) > budget, "smallest CP size that fits"
    assert all(len(schedule.for_rank(r)) == len(schedule.micro_batches) for r in (0, ranks - 1))


@settings(max_examples=150, deadline=None)
@given(lengths=LENGTHS, ranks=st.integers(1, 1024), budget=st.sampled_from([256, 1000, 4096]),
       min_log=st.integers(0, 2))
def test_schedule_guarantees(lengths, ranks, budget, min_log):
    min_size = min(1 << min_log, 1 << (ranks.bit_length() - 1))
    largest = 1 << (ranks.bit_length() - 1)
    if any(padded_len(n, largest) // largest > budget for n in lengths):
        with pytest.raises(ValueError, match="does not fit"):
            schedule_sequences(lengths, ranks, budget, min_size)
        return
    check_schedule(lengths, ranks, budget, min_size, schedule_sequences(lengths, ranks, budget, min_size))


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match=r"a sequence of 5000 tokens does not fit: max_seqlen_per_dp_cp_rank=512 "
                                         r"on at most 8 ranks holds 4096 tokens"):
        schedule_sequences([10, 5000], 8, 512)
    with pytest.raises(ValueError, match="power of two"):
        schedule_sequences([10], 8, 512, min_dynamic_context_parallel_size=3)


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
    for rank in range(4):
        group = schedule.micro_batches[0].group_of(rank)
        assert (group.sequences == [0]) == (rank == group.first == 0)


def test_cp_size_counts_padding():
    assert cp_size_for(1025, 512, 1, 8) == 4  # 1025 padded to 1028 over 2 ranks is 514 > 512
    assert cp_size_for(1024, 512, 1, 8) == 2
