"""Every validation rule of ContextParallelConfig raises a ValueError naming field, value and rule."""

import pytest

from cp_handler import (
    ContextParallelConfig,
    HierarchicalContextParallelHandler,
    LocalContextParallelHandler,
    MagiAttnContextParallelHandler,
    check_seq_len,
    get_cp_handler_cls,
    register_cp_handler,
)


def test_valid_config_round_trip():
    cfg = ContextParallelConfig(context_parallel_size=4, cp_comm_type=["p2p", "p2p"], num_layers=2)
    assert cfg.comm_types == ["p2p"]
    ContextParallelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cp_comm_type": "ring"}, r"cp_comm_type='ring'.*valid: \('p2p', 'all_gather', 'a2a', 'a2a\+p2p', 'auto'\)"),
        ({"context_parallel_size": 0}, r"context_parallel_size=0 must be an integer >= 1"),
        ({"context_parallel_size": 2.0}, r"context_parallel_size=2.0"),
        ({"context_parallel_size": 4, "cp_comm_type": "a2a+p2p"}, r"needs hierarchical_context_parallel_sizes"),
        (
            {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 3]},
            r"multiply to 6, but context_parallel_size=4",
        ),
        ({"hierarchical_context_parallel_sizes": [1, 0]}, r"integers >= 1"),
        ({"context_parallel_size": 4, "cp_comm_type": ["p2p", "a2a"], "num_layers": 2,
          "hierarchical_context_parallel_sizes": [2, 2]},
         r"hierarchical_context_parallel_sizes=\[2, 2\] is used only by a hierarchical cp_comm_type \(a2a\+p2p\) or "
         r"by 'auto' \(which may pick one\); "
         r"cp_comm_type=\['p2p', 'a2a'\] has none: drop it"),
        ({"cp_comm_type": ["p2p", "p2p", "p2p"], "num_layers": 2}, r"3 entries but the model has num_layers=2"),
        ({"cp_comm_type": []}, r"at least one"),
        ({"qkv_format": "bhsd"}, r"qkv_format='bhsd'"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContextParallelConfig(**kwargs)


def test_seq_len_rule():
    check_seq_len(1000, 1)
    check_seq_len(1024, 4)
    check_seq_len(1001, 2, "thd")  # thd pads per document
    with pytest.raises(ValueError, match=r"seq_len=1001 is not divisible by 2 \* context_parallel_size = 4"):
        check_seq_len(1001, 2)
    with pytest.raises(ValueError, match="seq_len=0"):
        check_seq_len(0, 1)


def test_factory_errors():
    with pytest.raises(ValueError, match=r"backend='nope' is not registered; registered backends: \[.*'local'"):
        get_cp_handler_cls("nope", "p2p")
    for comm_type in ("p2p", "a2a", "a2a+p2p", ["p2p", "a2a+p2p"]):  # the registered class itself: one serves all
        assert get_cp_handler_cls("local", comm_type) is LocalContextParallelHandler
    assert HierarchicalContextParallelHandler is LocalContextParallelHandler  # the old name of the same class
    with pytest.raises(ValueError, match=r"backend='magi' has no handler for cp_comm_type='a2a'; it supports "
                                         r"\['p2p'\]"):
        get_cp_handler_cls("magi", "a2a")  # MagiAttention plans its own communication: one entry, not four


def test_a_class_declares_the_comm_types_it_runs():
    class GatherOnly(LocalContextParallelHandler):
        cp_comm_types = ("all_gather",)

    assert GatherOnly().cp_comm_type == "all_gather"  # the one it runs: the default, at any cp
    with pytest.raises(ValueError, match=r"GatherOnly: cp_comm_type='p2p': it runs \['all_gather'\] only, not "
                                         r"\['p2p'\]"):
        GatherOnly(cp_comm_type="p2p")
    with pytest.raises(ValueError, match=r"comm_types names 'a2a', but the class runs \['all_gather'\]"):
        register_cp_handler("gather_only", GatherOnly, ["a2a"])
    register_cp_handler("gather_only", GatherOnly)  # registered for what it declares
    assert get_cp_handler_cls("gather_only", "all_gather") is GatherOnly
    with pytest.raises(ValueError, match=r"backend='gather_only' has no handler for cp_comm_type='p2p'"):
        get_cp_handler_cls("gather_only", "p2p")
    with pytest.raises(ValueError, match=r"MagiAttnContextParallelHandler: cp_comm_type='a2a': it runs \['p2p'\]"):
        MagiAttnContextParallelHandler(cp_comm_type="a2a")  # refused before MagiAttention is imported


def test_factory_rejects_a_list_no_single_class_serves():
    class OnlyA2A(LocalContextParallelHandler):
        pass

    register_cp_handler("split_backend", LocalContextParallelHandler, ["p2p"])
    register_cp_handler("split_backend", OnlyA2A, ["a2a"])
    assert get_cp_handler_cls("split_backend", ["p2p", "a2a"]) is OnlyA2A  # it derives from the other
    class Unrelated(LocalContextParallelHandler):
        pass

    register_cp_handler("split_backend", Unrelated, ["a2a+p2p"])
    with pytest.raises(ValueError, match="none of them serves every layer"):
        get_cp_handler_cls("split_backend", ["a2a", "a2a+p2p"])
    with pytest.raises(ValueError, match=r"has no handler for cp_comm_type='all_gather'; it supports"):
        get_cp_handler_cls("split_backend", "all_gather")
