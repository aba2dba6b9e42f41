"""``get_cp_handler_cls(backend, cp_comm_type)`` returns a class that runs the comm type it was asked
for: every registered (backend, comm type) pair builds a handler with that ``cp_comm_type``, another
one passed to it is refused, and (local backend, cp=2 and 4) the collectives issued are the named
algorithm's, counted with ``count_comms``. Before, ``get_cp_handler_cls("local", "a2a")(cp_group=g)``
ran p2p (the class's default)."""

import re
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
OTHER = {"p2p": "a2a", "all_gather": "p2p", "a2a": "all_gather", "a2a+p2p": "p2p"}


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
def test_factory_class_runs_the_comm_type_it_names(backend, comm_type):
    cls = get_cp_handler_cls(backend, comm_type)
    assert cls(cp_group=None).cp_comm_type == comm_type
    assert cls(cp_group=None, cp_comm_type=comm_type).cp_comm_type == comm_type
    message = f"cp_comm_type='{OTHER[comm_type]}', but this class came from get_cp_handler_cls(..., '{comm_type}')"
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(cp_group=None, cp_comm_type=OTHER[comm_type])


EXPECTED_OPS = {"p2p": {"send", "recv"}, "all_gather": {"all_gather", "reduce_scatter"}, "a2a": {"all_to_all"},
                "a2a+p2p": {"all_to_all", "send", "recv"}}


def _collectives_worker(rank, world):
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    for comm_type, ops in EXPECTED_OPS.items():
        if comm_type == "a2a+p2p" and world < 4:
            continue
        h = get_cp_handler_cls("local", comm_type)(cp_group=groups.cp_group,
                                                   hierarchical_cp_groups=groups.hierarchical_cp_groups,
                                                   check_ranks=False)  # only the attention's collectives
        q, k, v = (torch.randn(1, 8, 4, 8, requires_grad=True) for _ in range(3))  # (B, S_local, H, D)
        with count_comms() as counter:
            h.core_attn(None, q, k, v).sum().backward()
        assert set(counter.ops) == ops, (comm_type, dict(counter.ops))


@pytest.mark.parametrize("world", [2, 4])
def test_factory_class_issues_the_named_collectives(world):
    run_distributed(_collectives_worker, world)
