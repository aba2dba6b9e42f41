"""Transformer Engine and MagiAttention handlers on CPU, through contract fakes (tests/fakes/).

The fakes take exactly the documented arguments, enforce the libraries' documented restrictions
and record their calls; they compute with the local algorithms. Checked at cp=2 and cp=4: a GPT
step (loss and every gradient) through each handler equals the local handler on the same batch
(bshd and thd), the arguments each handler passes (groups, ranks, comm type, formats,
cu_seqlens), re-binding of TE's CP group when the handler's group changes, and the clear errors
for TE's restrictions. Tolerances: see gpt_reference.py (same float32 algorithms underneath).
The CUDA/NCCL checks are replaced inside these ranks only; test_backend_errors checks them.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt_reference import CONFIG, assert_parity, loss_and_grads

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from models import GPTConfig

FAKES = str(Path(__file__).parent / "fakes")
GQA = CONFIG  # 4 query heads, 2 KV heads, head dim 16
MHA = GPTConfig(**{**vars(CONFIG), "num_query_groups": 4})
LENGTHS = [5, 1, 17, 2, 7]


def use_fakes():
    sys.path.insert(0, FAKES)
    import cp_handler.handlers.magi as magi
    import cp_handler.handlers.transformer_engine as te

    te.require_cuda = magi.require_cuda = magi.require_nccl = lambda *args: None


def thd_batch(tokens):
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return tokens.reshape(1, -1)[:, : int(cu[-1])], cu


def _te_worker(rank, world):
    use_fakes()
    from transformer_engine.pytorch import CALLS

    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    te_cls, local_cls = get_cp_handler_cls("transformer_engine", "p2p"), get_cp_handler_cls("local", "a2a+p2p")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        config = MHA if comm.startswith("a2a") else GQA  # TE's a2a needs KV heads divisible by the a2a size
        common = {"cp_group": groups.cp_group, "cp_comm_type": comm,
                  "hierarchical_cp_groups": groups.hierarchical_cp_groups}
        CALLS.clear()
        got = loss_and_grads(config, te_cls(**common), tokens, groups.cp_group)
        assert_parity(got, loss_and_grads(config, local_cls(**common), tokens, groups.cp_group), f"TE {comm}")
        binds = [c for c in CALLS if c["call"] == "set_context_parallel_group"]
        expected_group = groups.hierarchical_cp_groups if comm == "a2a+p2p" else groups.cp_group
        assert len(binds) == config.num_layers and all(
            b["cp_comm_type"] == comm and b["cp_group"] == expected_group
            and b["cp_global_ranks"] == dist.get_process_group_ranks(groups.cp_group) for b in binds)
        assert all(c["qkv_format"] == "bshd" and c["attn_mask_type"] == "causal"
                   for c in CALLS if c["call"] == "forward")
    thd_tokens, cu = thd_batch(tokens)
    for comm in ("p2p", "a2a"):
        config = MHA if comm == "a2a" else GQA
        common = {"cp_group": groups.cp_group, "cp_comm_type": comm, "qkv_format": "thd", "cu_seqlens": cu}
        CALLS.clear()
        handler = te_cls(**common)
        got = loss_and_grads(config, handler, thd_tokens, groups.cp_group)
        assert_parity(got, loss_and_grads(config, local_cls(**common), thd_tokens, groups.cp_group), f"TE thd {comm}")
        forwards = [c for c in CALLS if c["call"] == "forward"]
        assert forwards and all(
            c["attn_mask_type"] == "padding_causal" and torch.equal(c["cu_seqlens_q"].cpu(), cu)
            and torch.equal(c["cu_seqlens_q_padded"].cpu(), handler.cu_seqlens_padded)
            and c["max_seqlen_q"] == max(handler.thd_layout.padded_lengths) for c in forwards)
    _te_rebinds(groups, tokens)
    _te_restrictions(groups)


def _te_rebinds(groups, tokens):
    """One model, handlers on different groups (as evaluation at another CP degree does): TE's
    group is re-bound each time the handler's differs, and not otherwise."""
    from transformer_engine.pytorch import CALLS

    from cp_handler.training import next_token_batch
    from models import GPTModel

    te_cls = get_cp_handler_cls("transformer_engine", "p2p")
    torch.manual_seed(0)
    model = GPTModel(GQA)
    CALLS.clear()
    outputs = []
    for group in (groups.cp_group, groups.cp_group, None, groups.cp_group):
        handler = te_cls(cp_group=group)
        outputs.append(handler.combine(model(next_token_batch(handler, tokens)[0], cp_handler=handler), 1))
    binds = [c["cp_group"] for c in CALLS if c["call"] == "set_context_parallel_group"]
    layers = GQA.num_layers
    assert binds == [groups.cp_group] * layers + [None] * layers + [groups.cp_group] * layers, binds
    torch.testing.assert_close(outputs[2], outputs[0], atol=1e-5, rtol=1e-5)  # cp=1 equals cp=N
    torch.testing.assert_close(outputs[3], outputs[0], atol=0, rtol=0)


def _te_restrictions(groups):
    from cp_handler import TEContextParallelHandler
    from models.gpt import SelfAttention

    q = torch.randn(1, 8, 6, 16)
    attn = SelfAttention(GPTConfig(**{**vars(CONFIG), "num_attention_heads": 6, "num_query_groups": 3,
                                      "hidden_size": 96}), 1)
    kv = q[..., :3, :]  # 3 KV heads divide by neither a2a size 2 nor 4
    with pytest.raises(ValueError, match=r"query heads \(6\) and KV heads \(3\) must both be divisible"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a").core_attn(attn, q, kv, kv)
    attn.window_size = (16, 0)
    with pytest.raises(ValueError, match=r"sliding window attention \(window_size=\(16, 0\)\) is not supported"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="p2p").core_attn(attn, q, q, q)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"does not support qkv_format='thd' with cp_comm_type=\['all_gather'\]"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="all_gather", qkv_format="thd", cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"needs hierarchical_cp_groups=\[a2a_group, p2p_group\]"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p")


def _magi_worker(rank, world):
    use_fakes()
    from magi_attention.api import CALLS

    group = build_dp_cp_groups(world).cp_group
    magi_cls, local_cls = get_cp_handler_cls("magi", "p2p"), get_cp_handler_cls("local", "p2p")
    shape = {"num_heads_q": 4, "num_heads_kv": 2, "head_dim": 16}
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(6))
    CALLS.clear()
    got = loss_and_grads(GQA, magi_cls(cp_group=group, **shape), tokens, group)
    assert_parity(got, loss_and_grads(GQA, local_cls(cp_group=group), tokens, group), "magi bshd (squashed)")
    key_calls = [c for c in CALLS if c["call"] == "magi_attn_varlen_key"]
    assert len(key_calls) == 1 and key_calls[0]["group"] is group and key_calls[0]["causal"]
    assert key_calls[0]["cu_seqlens_q"].tolist() == [0, 32, 64]  # two sequences squashed into two documents
    assert (key_calls[0]["num_heads_q"], key_calls[0]["num_heads_kv"], key_calls[0]["head_dim"]) == (4, 2, 16)
    thd_tokens, cu = thd_batch(tokens)
    got = loss_and_grads(GQA, magi_cls(cp_group=group, qkv_format="thd", cu_seqlens=cu, **shape), thd_tokens, group)
    expected = loss_and_grads(GQA, local_cls(cp_group=group, qkv_format="thd", cu_seqlens=cu), thd_tokens, group)
    assert_parity(got, expected, "magi thd")
    handler = magi_cls(cp_group=group, qkv_format="thd", cu_seqlens=cu, **shape)
    x = torch.randn(1, int(cu[-1]), 3)
    local = handler.dispatch(x, 1)
    assert torch.equal(handler.combine(local, 1), x)
    reference = local_cls(cp_group=group, qkv_format="thd", cu_seqlens=cu)
    rolled = handler.combine(handler.roll_tensor(local, -1, 1)[0], 1)
    assert torch.equal(rolled, reference.combine(reference.roll_tensor(reference.dispatch(x, 1), -1, 1)[0], 1))
    with pytest.raises(ValueError, match="needs num_heads_q, num_heads_kv and head_dim"):
        magi_cls(cp_group=group)
    from cp_handler.handlers import requirements  # the real check (replaced in the magi module above)

    with pytest.raises(RuntimeError, match="needs an NCCL process group, got 'gloo'"):
        requirements.require_nccl("magi", group)


@pytest.mark.parametrize("world", [2, 4])
def test_transformer_engine_handler_matches_local(world):
    run_distributed(_te_worker, world)


@pytest.mark.parametrize("world", [2, 4])
def test_magi_handler_matches_local(world):
    run_distributed(_magi_worker, world)
