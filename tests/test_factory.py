"""``get_cp_handler_cls(backend, cp_comm_type)`` returns the registered class, and the comm type is data on the
handler: every registered (backend, comm type) pair builds a handler of that very class (no subclass per comm type)
running that ``cp_comm_type``; at cp > 1 a handler built without one is refused by name (once,
``get_cp_handler_cls("local", "a2a")(cp_group=g)`` ran p2p, the class's default), and (local backend, cp=2 and 4)
the collectives issued are the named algorithm's, counted with ``count_comms``."""

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from cp_handler.handlers.registry import _REGISTRY
from cp_handler.ops.collectives import count_comms

FAKES = str(Path(__file__).parent / "fakes")
PAIRS = sorted(_REGISTRY)


@pytest.fixture(autouse=True)
def backend_fakes(monkeypatch):
    """TE and MagiAttention through the contract fakes of tests/fakes (their CUDA checks off)."""
    monkeypatch.syspath_prepend(FAKES)
    import cp_handler.handlers.magi as magi
    import cp_handler.handlers.transformer_engine as te

    for module, name in ((te, "require_cuda"), (magi, "require_cuda"), (magi, "require_nccl")):
        monkeypatch.setattr(module, name, lambda *args: None)
    yield
    for name in [m for m in sys.modules if m.startswith(("transformer_engine", "magi_attention"))]:
        del sys.modules[name]


@pytest.mark.parametrize("backend, comm_type", PAIRS)
def test_factory_class_takes_the_comm_type_as_data(backend, comm_type):
    cls = get_cp_handler_cls(backend, comm_type)
    assert cls is _REGISTRY[(backend, comm_type)]  # the registered class, not a subclass made per comm type
    handler = cls(cp_group=None, cp_comm_type=comm_type)
    assert type(handler) is cls and handler.cp_comm_type == comm_type


EXPECTED_OPS = {"p2p": {"send", "recv"}, "all_gather": {"all_gather", "reduce_scatter"}, "a2a": {"all_to_all"},
                "a2a+p2p": {"all_to_all", "send", "recv"}}


def _collectives_worker(rank, world):
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    for comm_type, ops in EXPECTED_OPS.items():
        if comm_type == "a2a+p2p" and world < 4:
            continue
        with pytest.raises(ValueError, match=rf"LocalContextParallelHandler: cp_comm_type=None at cp={world}: name the "
                                             "comm type the handler runs"):
            get_cp_handler_cls("local", comm_type)(cp_group=groups.cp_group)  # the factory's value is not a default
        h = get_cp_handler_cls("local", comm_type)(cp_group=groups.cp_group, cp_comm_type=comm_type,
                                                   hierarchical_cp_groups=groups.hierarchical_cp_groups,
                                                   check_ranks=False)  # only the attention's collectives
        q, k, v = (torch.randn(1, 8, 4, 8, requires_grad=True) for _ in range(3))  # (B, S_local, H, D)
        with count_comms() as counter:
            h.core_attn(None, q, k, v).sum().backward()
        assert set(counter.ops) == ops, (comm_type, dict(counter.ops))


@pytest.mark.parametrize("world", [2, 4])
def test_factory_class_issues_the_named_collectives(world):
    run_distributed(_collectives_worker, world)
