"""Bad input to the handlers gets an error that names the argument, the value and the rule, raised
before any collective, on every rank: never a gloo abort, a raw ATen error or a wrong answer.

Each case is one of issue 16's findings (silent wrong results and crashes at 2 and 4 gloo ranks).
Cross-rank cases (different cu_seqlens or lengths per rank) are caught by the handler's agreement
check: one all-gather of a few int64 per handler and kind of call; every rank raises with every
rank's values. The check can be turned off (``check_ranks=False`` or ``CP_HANDLER_CHECK_RANKS=0``).
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import new_cp_group, run_distributed

from cp_handler import ContextParallelConfig, HierarchicalContextParallelHandler, LocalContextParallelHandler
from cp_handler.handlers import base as handler_base
from cp_handler.handlers.agreement import CHECK_RANKS_ENV
from cp_handler.models.gpt import GPTConfig, SelfAttention

ATTN = SelfAttention(GPTConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2), 1)
PATTERNS = ("p2p", "all_gather", "a2a")


def _qkv(batch=(1, 1), local=(8, 8), dtypes=(torch.float32, torch.float32)):
    q = torch.randn(batch[0], local[0], 4, 16, dtype=dtypes[0])
    k = torch.randn(batch[1], local[1], 2, 16, dtype=dtypes[1])
    return q, k, k.clone()


def _one_rank_checks(rank, world):
    group = new_cp_group()
    for pattern in PATTERNS:
        h = LocalContextParallelHandler(cp_group=group, cp_comm_type=pattern)
        with pytest.raises(ValueError, match=r"q \(2, 8, 4, 16\) and k \(1, 8, 2, 16\) must agree in every dim but "
                                             r"heads"):
            h.core_attn(ATTN, *_qkv(batch=(2, 1)))
        with pytest.raises(ValueError, match=r"q \(1, 32, 4, 16\) and k \(1, 16, 2, 16\) must agree"):
            h.core_attn(ATTN, *_qkv(local=(32, 16)))
        with pytest.raises(ValueError, match=r"local sequence length 7 is odd"):
            h.core_attn(ATTN, *_qkv(local=(7, 7)))
        with pytest.raises(TypeError, match=r"q, k, v must share one dtype, got torch.float32, torch.float64"):
            h.core_attn(ATTN, *_qkv(dtypes=(torch.float32, torch.float64)))
        q = torch.randint(0, 5, (1, 8, 4, 16))
        with pytest.raises(TypeError, match=r"core_attn q has dtype torch.int64; attention takes floating tensors"):
            h.core_attn(ATTN, q, q[..., :2, :], q[..., :2, :])
    x = torch.zeros(2, 8 * world)

    def dispatched():  # a handler per batch, which dispatched the batch
        h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
        h.dispatch(x, seq_dim=1)
        return h

    with pytest.raises(ValueError, match=r"seq_dim=2 is out of range for a 2-D tensor \(valid: -2..1\)"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").dispatch(x, seq_dim=2)
    with pytest.raises(ValueError, match=r"seq_dim=-3 is out of range"):
        dispatched().combine(x[:, :8], seq_dim=-3)
    with pytest.raises(ValueError, match=r"roll_tensor dims=5 is out of range for a 2-D tensor"):
        dispatched().roll_tensor(x[:, :8], shifts=-1, dims=5)
    with pytest.raises(TypeError, match=r"roll_tensor shifts=True must be one int"):
        dispatched().roll_tensor(x[:, :8], shifts=True, dims=1)
    for bad, error, message in ((3, TypeError, r"cp_comm_type=3 must be one of"),
                                ([], ValueError, r"cp_comm_type=\[\] must name at least one"),
                                ("ring", ValueError, r"cp_comm_type='ring' is not a valid communication type")):
        with pytest.raises(error, match=message):
            LocalContextParallelHandler(cp_group=group, cp_comm_type=bad)
        with pytest.raises(error, match=message):
            ContextParallelConfig(cp_comm_type=bad)
    with pytest.raises(TypeError, match=r"cp_comm_type=None must be one of"):
        ContextParallelConfig(cp_comm_type=None)
    with pytest.raises(ValueError, match=r"cp_comm_type=None at cp=\d: name the comm type the handler runs"):
        LocalContextParallelHandler(cp_group=group)  # no default under CP: the comm type is named, never assumed
    assert LocalContextParallelHandler(cp_comm_type=None).cp_comm_type == "p2p"  # cp = 1: nothing is communicated
    for dtype in (torch.uint8, torch.int8, torch.float32):
        with pytest.raises(TypeError, match=rf"cu_seqlens has dtype {dtype}; it must be int32"):
            LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="thd",
                                        cu_seqlens=torch.tensor([0, 100, 120],
                                                                                                   dtype=dtype))
    for cu, message in (([[0, 4]], r"must be 1-D"), ([1, 4], r"starting at 0"),
                        ([0, 4, 3], r"non-decreasing .* cu_seqlens\[1\]=4, cu_seqlens\[2\]=3"),
                        ([0, 0, 0], r"holds no token")):
        with pytest.raises(ValueError, match=message):
            LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="thd",
                                        cu_seqlens=torch.tensor(cu))
    alone = LocalContextParallelHandler(qkv_format="thd", cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32))
    q = torch.randn(10, 4, 16)
    with pytest.raises(ValueError, match=r"thd tensor has 10 local tokens, but this batch's cu_seqlens give 8"):
        alone.core_attn(ATTN, q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match=r"q \(2, 8, 4, 16\): qkv_format='thd' takes \(T, H, D\) or \(1, T, H, D\)"):
        alone.core_attn(ATTN, *_qkv(batch=(2, 1)))
    q, k, _ = _qkv(batch=(1, 2))
    with pytest.raises(ValueError, match=r"q \(1, 8, 4, 16\) and k \(2, 8, 2, 16\) must agree"):
        alone.core_attn(ATTN, q, k, k)


def _outsider(rank, world):
    group = dist.new_group([0, 1])  # every rank takes part in creating it; rank 2 and 3 are outside
    if rank >= 2:
        with pytest.raises(ValueError, match=rf"this process \(global rank {rank}\) is not a member of the CP group "
                                             r"\(global ranks \[0, 1\]\)"):
            LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")


def _cross_rank(rank, world):
    group = new_cp_group()
    cu = torch.tensor([0, 4, 8] if rank == 0 else [0, 2, 8], dtype=torch.int32)  # same length, other documents
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu)
    local = torch.randn(h.token_layout.thd_layout.local_len, 4, 16)
    with pytest.raises(ValueError) as caught:  # the differing fields only, each rank's value in words
        h.core_attn(ATTN, local, local[:, :2], local[:, :2])
    assert str(caught.value).startswith(
        "core_attn (layer_number 1): the ranks of the CP group disagree on local_len (rank 0: 4; rank 1: 6), layout "
        "(rank 0: document lengths [4, 4]; rank 1: document lengths [2, 6]); every rank must pass the same batch "
        "layout"), str(caught.value)
    with pytest.raises(ValueError, match=r"roll_tensor: the ranks of the CP group disagree on local_len \(rank 0: 4; "
                                         r"rank 1: 6\), layout \(rank 0: document lengths \[4, 4\]; rank 1: document "
                                         r"lengths \[2, 6\]\); every"):
        h.roll_tensor(local[:, 0], shifts=-1, dims=0)
    bshd = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    q = torch.randn(1, 8 if rank == 0 else 12, 4, 16)  # different global lengths
    with pytest.raises(ValueError, match=r"disagree on local_len \(rank 0: 8; rank 1: 12\), layout \(rank 0: "
                                         r"document lengths \[16\]; rank 1: document lengths \[24\]\); every"):
        bshd.core_attn(ATTN, q, q[..., :2, :], q[..., :2, :])
    with pytest.raises(ValueError, match=r"combine: the inputs of some ranks of the CP group were refused \(rank 0: "
                                         r"ValueError: combine: this handler dispatched nothing"):
        bshd.combine(q, seq_dim=1)
    with pytest.raises(ValueError, match=r"roll_tensor: the ranks of the CP group disagree"):
        bshd.roll_tensor(q[..., 0, 0], shifts=-1, dims=1)
    agreed = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    same = torch.randn(1, 8, 4, 16)
    agreed.core_attn(ATTN, same, same[..., :2, :], same[..., :2, :])
    agreed.core_attn(ATTN, same, same[..., :2, :], same[..., :2, :])  # the same layer again (a recompute)
    assert agreed.agreement.done == {"core_attn (layer_number 1)"}  # checked once per layer and handler, remembered


def _long_layouts(rank, world):
    """80 documents that differ only in the last two: the message quotes the lists from shortly before they
    differ, not 80 lengths (nor a hash)."""
    group = new_cp_group()
    lengths = [4] * 78 + ([4, 8] if rank == 0 else [8, 4])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu)
    local = torch.randn(h.token_layout.thd_layout.local_len, 4, 16)
    with pytest.raises(ValueError) as caught:
        h.core_attn(ATTN, local, local[:, :2], local[:, :2])
    message = str(caught.value)
    assert "disagree on layout (rank 0: ..." in message and "4, 4, 8]; rank 1: ..." in message, message
    assert "4, 8, 4]); every rank" in message and "local_len" not in message and len(message) < 700, message


def _switch_off(rank, world, monkeypatch_env):
    group = new_cp_group()

    def fail(*args):
        raise AssertionError("the agreement check ran although it was turned off")

    handler_base.check_ranks_agree = fail
    if monkeypatch_env:
        import os

        os.environ[CHECK_RANKS_ENV] = "0"
        h = HierarchicalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    else:
        h = HierarchicalContextParallelHandler(cp_group=group, cp_comm_type="p2p", check_ranks=False)
    assert not h.agreement.enabled
    q = torch.randn(1, 8, 4, 16)
    h.core_attn(ATTN, q, q[..., :2, :], q[..., :2, :])


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_checks(world):
    run_distributed(_one_rank_checks, world)


def test_rank_outside_the_group():
    run_distributed(_outsider, 4)


def test_ranks_that_disagree_raise_on_every_rank():
    run_distributed(_cross_rank, 2)


def test_ranks_with_long_layouts_that_differ_are_quoted_where_they_differ():
    run_distributed(_long_layouts, 2)


@pytest.mark.parametrize("by_env", [False, True])
def test_agreement_check_can_be_turned_off(by_env):
    run_distributed(_switch_off, 2, by_env)
