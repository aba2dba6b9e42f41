"""Transformer Engine and MagiAttention handlers on CPU, through contract fakes (tests/fakes/).

The fakes mirror the libraries' signatures and rules, one release at a time (each fake's docstring
names the source file, tag and lines): TE as 2.17.1 and 2.20.2 (thd + all_gather from 2.18, thd + a2a+p2p
and FP8 + thd from 2.19; te_releases' rules at 2.17-2.21 also checked directly),
MagiAttention as 1.0.4, 1.1.0 and 1.1.1 (three key signatures, ``roll`` only in 1.1.1). They compute
with cp_handler's local algorithms or a dense masked attention, in float16/bfloat16 only, as the
libraries do. Checked at cp=2 and cp=4:

* a GPT step (loss and every gradient, bfloat16) through each handler against the local handler on
  the same batch (bshd and thd): relative norm 1e-2 for TE (same algorithms underneath, only the
  order of a few bf16 roundings differs) and 5e-2 for MagiAttention (a different attention
  algorithm; tests/gpt_reference.py's bf16 bound);
* the arguments passed (groups, ranks, comm type, formats, cu_seqlens, window), group re-binding;
* issue 15's findings, each failing on the code before it: the window reaches TE; fp32 refused
  first; TE's thd / odd-head / FP8 rules by version; the TE module in the model's state_dict and
  mode; a2a+p2p bound once; MagiAttention 1.1.0's key; releases before 1.0.4 refused; the dispatch
  gradient zero outside the local tokens; roll without ``api.roll``.
The CUDA/NCCL checks are replaced inside these ranks only; test_backend_errors checks them.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from gpt_reference import CONFIG, GPT_GPU_TOLERANCE, assert_close_by_norm, loss_and_grads

from cp_handler import AttentionShape, ContextParallelConfig, build_dp_cp_groups, get_cp_handler_cls
from cp_handler.handlers import te_releases
from cp_handler.handlers.agreement import RanksRefused
from cp_handler.handlers.requirements import release
from cp_handler.handlers.te_releases import thd_comm_types
from cp_handler.models import GPTConfig, GPTModel

FAKES = str(Path(__file__).parent / "fakes")
FAKES_FA4 = str(Path(__file__).parent / "fakes_fa4")
GQA = CONFIG  # 4 query heads, 2 KV heads, head dim 16
MHA = GPTConfig(**{**vars(CONFIG), "num_query_groups": 4})
MLA = {"v_head_dim": 24}  # multi-head latent attention: values 24 wide, queries and keys 16
LENGTHS = [5, 0, 1, 17, 2, 7, 0]  # zero-length documents too (Magi gets cu_seqlens without them)
BF16 = torch.bfloat16
TE_TOL, MAGI_TOL = 1e-2, GPT_GPU_TOLERANCE[BF16]


def use_fakes():
    sys.path.insert(0, FAKES)
    import cp_handler.handlers.magi as magi
    import cp_handler.handlers.transformer_engine as te

    te.require_cuda = magi.require_cuda = magi.require_nccl = lambda *args: None


def thd_batch(tokens):
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return tokens.reshape(1, -1)[:, : int(cu[-1])], cu


def step(config, handler, tokens, group):
    return loss_and_grads(config, handler, tokens, group, dtype=BF16)


def _te_worker(rank, world, version):
    use_fakes()
    import transformer_engine
    from transformer_engine.pytorch import CALLS

    transformer_engine.__version__ = version
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        te_cls, local_cls = get_cp_handler_cls("transformer_engine", comm), get_cp_handler_cls("local", comm)
        config = MHA if comm.startswith("a2a") else GQA  # TE's a2a needs KV heads divisible by the a2a size
        if comm in ("all_gather", "a2a+p2p"):
            config = GPTConfig(**{**vars(config), **MLA})
        common = {"cp_group": groups.cp_group, "cp_comm_type": comm,
                  "hierarchical_cp_groups": groups.hierarchical_cp_groups}
        CALLS.clear()
        got = step(config, te_cls(**common), tokens, groups.cp_group)
        assert_close_by_norm(got, step(config, local_cls(**common), tokens, groups.cp_group), TE_TOL, f"TE {comm}")
        binds = [c for c in CALLS if c["call"] == "set_context_parallel_group"]
        expected_group = groups.hierarchical_cp_groups if comm == "a2a+p2p" else groups.cp_group
        assert len(binds) == config.num_layers and all(
            b["cp_comm_type"] == comm and b["cp_group"] == expected_group
            and b["cp_global_ranks"] == dist.get_process_group_ranks(groups.cp_group) for b in binds)
        assert all(c["qkv_format"] == "bshd" and c["attn_mask_type"] == "causal" and c["window_size"] == (-1, 0)
                   for c in CALLS if c["call"] == "forward")
        channels = 16 if config.v_head_dim == 16 else (16, 24)  # TE's kv_channels: an int, or (k, v) for MLA
        assert all(c["kv_channels"] == channels for c in CALLS if c["call"] == "__init__")
    thd_tokens, cu = thd_batch(tokens)
    for comm in thd_comm_types(release(version)):  # all_gather from 2.18, a2a+p2p from 2.19
        te_cls, local_cls = get_cp_handler_cls("transformer_engine", comm), get_cp_handler_cls("local", comm)
        config = GPTConfig(**{**vars(MHA if comm.startswith("a2a") else GQA), **MLA})
        common = {"cp_group": groups.cp_group, "cp_comm_type": comm, "qkv_format": "thd", "cu_seqlens": cu,
                  "hierarchical_cp_groups": groups.hierarchical_cp_groups}
        CALLS.clear()
        handler = te_cls(**common)
        got = step(config, handler, thd_tokens, groups.cp_group)
        assert_close_by_norm(got, step(config, local_cls(**common), thd_tokens, groups.cp_group), TE_TOL,
                             f"TE thd {comm}")
        forwards = [c for c in CALLS if c["call"] == "forward"]
        assert forwards and all(
            c["attn_mask_type"] == "padding_causal" and torch.equal(c["cu_seqlens_q"].cpu(), cu)
            and torch.equal(c["cu_seqlens_q_padded"].cpu(), handler.token_layout.cu_seqlens_padded)
            and c["max_seqlen_q"] == max(handler.token_layout.thd_layout.padded_lengths) for c in forwards)
    _te_rebinds(groups, tokens)
    _te_restrictions(groups, version)
    _te_window(rank, world, groups)
    _te_module_state(groups, tokens)


def _te_rebinds(groups, tokens):
    """One model, handlers on different groups (as evaluation at another CP degree does): TE's
    group is re-bound each time the handler's differs, and not otherwise (a2a+p2p included: its
    group list is compared element by element)."""
    from transformer_engine.pytorch import CALLS

    from cp_handler.training import next_token_batch

    te_cls = get_cp_handler_cls("transformer_engine", "p2p")
    torch.manual_seed(0)
    model = GPTModel(GQA).to(BF16)
    CALLS.clear()
    outputs = []
    for group in (groups.cp_group, groups.cp_group, None, groups.cp_group):
        handler = te_cls(cp_group=group, cp_comm_type="p2p")
        outputs.append(handler.combine(model(next_token_batch(handler, tokens)[0], cp_handler=handler), 1))
    binds = [c["cp_group"] for c in CALLS if c["call"] == "set_context_parallel_group"]
    layers = GQA.num_layers
    assert binds == [groups.cp_group] * layers + [None] * layers + [groups.cp_group] * layers, binds
    torch.testing.assert_close(outputs[3], outputs[0], atol=0, rtol=0)
    model = GPTModel(MHA).to(BF16)
    CALLS.clear()
    for _ in range(2):  # a2a+p2p: a new list of the same groups each call must not re-bind
        handler = get_cp_handler_cls("transformer_engine", "a2a+p2p")(cp_group=groups.cp_group, cp_comm_type="a2a+p2p",
            hierarchical_cp_groups=list(groups.hierarchical_cp_groups))
        model(next_token_batch(handler, tokens)[0], cp_handler=handler)
    assert sum(c["call"] == "set_context_parallel_group" for c in CALLS) == MHA.num_layers


def _te_restrictions(groups, version):
    from cp_handler import TEContextParallelHandler
    from cp_handler.models.gpt import SelfAttention

    q = torch.randn(1, 8, 6, 16, dtype=BF16)
    attn = SelfAttention(GPTConfig(**{**vars(CONFIG), "num_attention_heads": 6, "num_query_groups": 3,
                                      "hidden_size": 96}), 1)
    kv = q[..., :3, :]  # 3 KV heads divide by neither a2a size 2 nor 4
    with pytest.raises(ValueError, match=r"query heads \(6\) and KV heads \(3\) must both be divisible"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a").core_attn(attn, q, kv, kv)
    with pytest.raises(ValueError, match=r"q has dtype torch.float32, but TE has no torch.float32 attention "
                                         r"backend under context parallelism"):
        handler = TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="p2p")
        handler.core_attn(attn, q.float(), q.float(), q.float())
    attn.window_size = (16, 0)
    with pytest.raises(ValueError, match=r"window_size=\(16, 0\) \(sliding window\) is not supported by Transformer "
                                         r"Engine with cp_comm_type='p2p'"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="p2p").core_attn(attn, q, q, q)
    attn.window_size = (3, 3)  # two-sided: a sliding window to TE too
    with pytest.raises(ValueError, match=r"window_size=\(3, 3\) \(sliding window\) is not supported by Transformer "
                                         r"Engine with cp_comm_type='a2a\+p2p'"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p",
                                 hierarchical_cp_groups=groups.hierarchical_cp_groups).core_attn(
            attn, q, q, q, attn_mask_type="no_mask")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    if version < "2.18":
        with pytest.raises(ValueError, match=r"transformer_engine 2.17.1 does not support qkv_format='thd' with "
                                             r"cp_comm_type=\['all_gather'\]"):
            TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="all_gather", qkv_format="thd",
                                     cu_seqlens=cu)
    if version < "2.19":  # thd + a2a+p2p from 2.19 (run in _te_worker)
        with pytest.raises(ValueError, match=r"does not support qkv_format='thd' with cp_comm_type=\['a2a\+p2p'\]; "
                                             r".*a2a\+p2p from 2.19"):
            TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p", qkv_format="thd",
                                     cu_seqlens=cu, hierarchical_cp_groups=groups.hierarchical_cp_groups)
    with pytest.raises(ValueError, match=r"needs hierarchical_cp_groups=\[a2a_group, p2p_group\]"):
        TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p")
    attn.window_size = None
    for name, value, match in (("attention_chunk_size", 8, r"attention_chunk_size=8 \(chunked attention\)"),
                               ("softcap", 30.0, r"softcap=30.0 \(soft-capping\)"),
                               ("sinks", torch.zeros(4, dtype=BF16), r"sinks \(4,\) \(learnable sinks\)")):
        setattr(attn, name, value)  # refused by name, on every comm type (never ignored)
        refused = rf"TEContextParallelHandler \(cp_comm_type='a2a'\): attn_mod\.{match} not run"
        with pytest.raises(ValueError, match=refused):
            TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a").core_attn(attn, q[..., :4, :],
                                                                                          q[..., :2, :], q[..., :2, :])
        setattr(attn, name, None)
    _te_fp8_thd(groups, version, cu)


def _te_fp8_thd(groups, version, cu):
    """FP8 attention with thd: no backend before TE 2.19; from 2.19 DelayedScaling / Float8CurrentScaling on
    SM100+ with cuDNN 9.23+ run, the rest is refused by name (MXFP8BlockScaling; other recipes, SM90: unverified)."""
    from transformer_engine.pytorch import fp8, utils

    from cp_handler import TEContextParallelHandler
    from cp_handler.models.gpt import SelfAttention

    def handler():  # a new one each time: a handler that raised refuses further calls
        return TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu)

    local = torch.randn(handler().token_layout.thd_layout.local_len, 4, 16, dtype=BF16)
    manager = fp8.FP8GlobalStateManager

    def attend(recipe, capability=(10, 0), cudnn=(9, 26, 0)):
        manager.RECIPE, utils.CAPABILITY, utils.CUDNN = recipe(fp8_dpa=True), capability, cudnn
        return handler().core_attn(SelfAttention(GQA, 1), local, local[:, :2], local[:, :2])

    manager.ENABLED = True
    try:
        if version < "2.19":
            with pytest.raises(ValueError, match=r"FP8 attention \(fp8_dpa\) with qkv_format='thd' under context "
                                                 r"parallelism is not supported \(TE disables"):
                attend(fp8.DelayedScaling)
            return
        for recipe in (fp8.DelayedScaling, fp8.Float8CurrentScaling):
            assert attend(recipe).shape == local.shape
        with pytest.raises(ValueError, match=r"not supported with recipe MXFP8BlockScaling \(TE PR #2994"):
            attend(fp8.MXFP8BlockScaling)
        with pytest.raises(ValueError, match=r"recipe Float8BlockScaling is unverified"):
            attend(fp8.Float8BlockScaling)
        with pytest.raises(ValueError, match=r"on compute capability 9.0 is unverified"):
            attend(fp8.DelayedScaling, capability=(9, 0))
        with pytest.raises(ValueError, match=r"needs cuDNN >= 9.23 \(TE PR #2994\), found 9.22.0"):
            attend(fp8.DelayedScaling, cudnn=(9, 22, 0))
    finally:
        manager.ENABLED, manager.RECIPE = False, fp8.DelayedScaling()
        utils.CAPABILITY, utils.CUDNN = (10, 0), (9, 26, 0)


def _sliding_window_reference(q, k, v, window, scale):
    """Single process, float64: query i attends keys [i - left, i + right] (TE's ``window_size``)."""
    n, (left, right) = q.shape[2], window
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=(j <= i + right) &
                                          (j >= i - left), scale=scale, enable_gqa=True)


def _te_window(rank, world, groups):
    """Sliding-window attention modules through TE (a2a, all_gather): causal (5, 0) and two-sided (3, 3) with
    ``no_mask``, values of their own head dim in the second (MLA); the window reaches TE and the result is the
    single-process sliding-window attention (not full attention)."""
    from transformer_engine.pytorch import CALLS

    from cp_handler import TEContextParallelHandler
    from cp_handler.models.gpt import SelfAttention

    torch.manual_seed(3)
    for window, mask_type, v_head_dim in (((5, 0), "causal", 16), ((3, 3), "no_mask", 24)):
        attn = SelfAttention(MHA, 1)
        attn.window_size = window
        q, k = (torch.randn(1, 8 * world, 4, 16).to(BF16) for _ in range(2))
        v = torch.randn(1, 8 * world, 4, v_head_dim).to(BF16)
        expected = _sliding_window_reference(*(t.transpose(1, 2) for t in (q, k, v)), window, attn.softmax_scale)
        for comm in ("a2a", "all_gather"):
            h = TEContextParallelHandler(cp_group=groups.cp_group, cp_comm_type=comm)
            CALLS.clear()
            out = h.combine(h.core_attn(attn, *(h.dispatch(t, 1) for t in (q, k, v)), attn_mask_type=mask_type), 1)
            assert all(c["window_size"] == window and c["attn_mask_type"] == mask_type
                       for c in CALLS if c["call"] == "forward")
            torch.testing.assert_close(out.transpose(1, 2).double(), expected, atol=2.5e-2, rtol=2.5e-2)
            del attn.te_attention  # next comm type builds its module afresh


def _te_module_state(groups, tokens):
    """The DotProductAttention of each layer is the model's child: in state_dict (TE's extra state),
    without parameters of its own (nothing for .to() to move), and in the model's train/eval mode."""
    from transformer_engine.pytorch import CALLS

    from cp_handler.training import next_token_batch

    handler = get_cp_handler_cls("transformer_engine", "p2p")(cp_group=groups.cp_group, cp_comm_type="p2p")
    model = GPTModel(GQA).to(BF16)
    model(next_token_batch(handler, tokens)[0], cp_handler=handler)
    keys = [k for k in model.state_dict() if "te_attention" in k]
    assert keys == [f"layers.{i}.self_attn.te_attention._extra_state" for i in range(GQA.num_layers)], keys
    assert all(not list(layer.self_attn.te_attention.parameters()) for layer in model.layers)
    model.eval()
    CALLS.clear()
    with torch.no_grad():
        model(next_token_batch(handler, tokens)[0], cp_handler=handler)
    assert [c["training"] for c in CALLS if c["call"] == "forward"] == [False] * GQA.num_layers


def _magi_worker(rank, world, version):
    use_fakes()
    from magi_attention import api
    from magi_attention.api import CALLS

    api.install_version(version)
    group = build_dp_cp_groups(world).cp_group
    magi_cls, local_cls = get_cp_handler_cls("magi", "p2p"), get_cp_handler_cls("local", "p2p")
    shape = {"num_heads_q": 4, "num_heads_kv": 2, "head_dim": 16}
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(6))
    CALLS.clear()
    got = step(GQA, magi_cls(cp_group=group, **shape), tokens, group)
    expected = step(GQA, local_cls(cp_group=group, cp_comm_type="p2p"), tokens, group)
    assert_close_by_norm(got, expected, MAGI_TOL, f"magi {version} bshd")
    (key_call,) = [c for c in CALLS if c["call"] == "magi_attn_varlen_key"]
    assert key_call["group"] is group and key_call["causal"]
    assert key_call["cu_seqlens_q"].tolist() == [0, 32, 64]  # two sequences squashed into two documents
    assert key_call["heads"] == (None if version == "1.0.4" else (4, 2, 16))
    if version != "1.1.1":
        assert key_call["chunk_size"] == 512 and key_call["pad_size"] == (-64) % (512 * world)
    thd_tokens, cu = thd_batch(tokens)
    got = step(GQA, magi_cls(cp_group=group, qkv_format="thd", cu_seqlens=cu, **shape), thd_tokens, group)
    expected = step(GQA, local_cls(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu), thd_tokens,
                    group)
    assert_close_by_norm(got, expected, MAGI_TOL, f"magi {version} thd")
    handler = magi_cls(cp_group=group, qkv_format="thd", cu_seqlens=cu, **shape)
    x = torch.randn(1, int(cu[-1]), 3, requires_grad=True)
    local = handler.dispatch(x, 1)
    assert torch.equal(handler.combine(local.detach(), 1), x.detach())
    reference = local_cls(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu)
    rolled = handler.combine(handler.roll_tensor(local.detach(), -1, 1)[0], 1)  # api.roll only in 1.1.1
    assert torch.equal(rolled, reference.combine(reference.roll_tensor(reference.dispatch(x.detach(), 1), -1, 1)[0],
                                                 1))
    weights = torch.randn_like(x)
    (local * handler.dispatch(weights, 1)).sum().backward()  # contract: this rank's tokens only
    real = handler.token_layout.real_token_mask()  # the slots not padded by MagiAttention: this rank's tokens
    assert real.shape == (local.shape[1],)
    mine = torch.zeros(int(cu[-1]), dtype=torch.bool)
    mine[handler.token_layout.positions[real]] = True
    count = real.sum()
    dist.all_reduce(count, group=group)
    assert int(count) == int(cu[-1])  # every token of the batch in exactly one rank's real slots
    assert torch.equal(x.grad[0][~mine], torch.zeros_like(x.grad[0][~mine]))
    total = x.grad.clone()
    dist.all_reduce(total, group=group)
    assert torch.equal(total, weights)
    _magi_errors(group, shape, version)


def _magi_errors(group, shape, version):
    import magi_attention
    from magi_attention import api

    magi_cls = get_cp_handler_cls("magi", "p2p")
    with pytest.raises(ValueError, match="needs num_heads_q, num_heads_kv and head_dim"):
        magi_cls(cp_group=group)
    with pytest.raises(ValueError, match=r"head_dim=192 must be <= 128"):
        magi_cls(cp_group=group, num_heads_q=4, num_heads_kv=2, head_dim=192)
    h = magi_cls(cp_group=group, **shape)
    local = h.dispatch(torch.randn(2, 16, 4, 16), 1)
    # reused for a batch that is longer on rank 1 only: every rank raises the named error (dispatch agrees at every
    # call; rank 0 would otherwise go on into MagiAttention's collectives alone)
    with pytest.raises(RanksRefused, match=r"dispatch: the inputs of some ranks of the CP group were refused \(rank 1: "
                                           r"ValueError: dispatch: a tensor of \(2, 24\) tokens \(dim 1\), but this "
                                           r"handler dispatched \(2, 16\)"):
        h.dispatch(torch.randn(2, 24 if dist.get_rank(group) == 1 else 16, 4, 16), 1)
    assert h.dispatch(torch.randn(2, 16, 4, 16), 1).shape == local.shape  # the same batch's other tensors pass
    with pytest.raises(ValueError, match=r"q has dtype torch.float32; MagiAttention computes in float16 or bfloat16"):
        h.core_attn(torch.nn.Module(), local, local[..., :2, :], local[..., :2, :])
    with pytest.raises(ValueError, match=r"backend='magi': v head dim 8 differs from the q/k head dim 16 \(multi-head "
                                         r"latent attention\)"):
        h.core_attn(torch.nn.Module(), *(t.to(BF16) for t in (local, local[..., :2, :], local[..., :2, :8])))
    with pytest.raises(ValueError, match=r"backend='magi': v_head_dim=24 differs from head_dim=16"):
        magi_cls.check_config(ContextParallelConfig(context_parallel_size=2), AttentionShape(4, 2, 16, 24))
    windowed = torch.nn.Module()
    windowed.window_size = (7, 0)  # not wired to MagiAttention's masks: refused by name, never ignored
    with pytest.raises(ValueError, match=r"window_size=\(7, 0\) \(sliding window\) not supported by this backend"):
        magi_cls(cp_group=group, **shape).core_attn(windowed, local, local[..., :2, :], local[..., :2, :])
    magi_attention.__version__ = "1.0.2"
    with pytest.raises(RuntimeError, match=r"magi_attention 1.0.2 is installed; backend='magi' supports "
                                           r"MagiAttention 1.0.4 to 1.1.1"):
        magi_cls(cp_group=group, **shape)
    magi_attention.__version__ = "1.1.8"  # newer than the range: refused, naming what was not verified
    with pytest.raises(RuntimeError, match=r"magi_attention 1.1.8 is installed; .* to 1.1.1 .*newer releases are "
                                           r"refused as unverified: 1.1.2 to 1.1.8"):
        magi_cls(cp_group=group, **shape)
    api.install_version(version)
    from cp_handler.handlers import requirements  # the real check (replaced in the magi module above)

    with pytest.raises(RuntimeError, match="needs an NCCL process group, got 'gloo'"):
        requirements.require_nccl("magi", group)


@pytest.mark.parametrize("version", ["2.17.1", "2.20.2"])
@pytest.mark.parametrize("world", [2, 4])
def test_transformer_engine_handler_matches_local(world, version):
    run_distributed(_te_worker, world, version)


def _te_odd_heads_worker(rank, world):
    """An a2a size of 3 lets 3 heads divide: odd heads disable FusedAttention, and without flash_attn
    TE would have no backend left."""
    use_fakes()
    from cp_handler import TEContextParallelHandler
    from cp_handler.models.gpt import SelfAttention

    q = torch.randn(1, 6, 3, 16, dtype=BF16)
    attn = SelfAttention(GPTConfig(hidden_size=48, num_attention_heads=3, num_query_groups=3), 1)
    group = build_dp_cp_groups(world).cp_group
    with pytest.raises(ValueError, match=r"odd head counts \(3, 3\) disable FusedAttention, and no FlashAttention "
                                         r"that TE 2.20.2 runs under CP with qkv_format='bshd' is installed "
                                         r"\(installed: \[\]"):
        TEContextParallelHandler(cp_group=group, cp_comm_type="a2a").core_attn(attn, q, q, q)
    sys.path.insert(0, FAKES_FA4)  # flash-attn-4 (its dist-info): TE runs FA4 under CP for thd from 2.21 only
    with pytest.raises(ValueError, match=r"no FlashAttention that TE 2.20.2 runs under CP with qkv_format='bshd' is "
                                         r"installed \(installed: \['FA4'\]"):
        TEContextParallelHandler(cp_group=group, cp_comm_type="a2a").core_attn(attn, q, q, q)


def test_transformer_engine_odd_heads_need_flash_attn():
    run_distributed(_te_odd_heads_worker, 3)


@pytest.mark.parametrize("version", ["1.0.4", "1.1.0", "1.1.1"])
@pytest.mark.parametrize("world", [2, 4])
def test_magi_handler_matches_local(world, version):
    run_distributed(_magi_worker, world, version)


@pytest.mark.parametrize("version, thd", [((2, 17, 1), ("p2p", "a2a")), ((2, 18), ("p2p", "a2a", "all_gather")),
                                          ((2, 19, 0), ("p2p", "a2a", "all_gather", "a2a+p2p"))])
def test_te_thd_comm_types_by_release(version, thd):
    """thd: all_gather from 2.18 (v2.18), a2a+p2p from 2.19 (commit 8ff60f8de, #3290, on release_v2.19)."""
    assert te_releases.thd_comm_types(version) == thd


def test_te_fp8_thd_rule_by_release():
    """Release notes v2.19 / PR #2994: FP8 + thd under CP from 2.19, two recipes, SM100+, cuDNN 9.23+."""
    rule = te_releases.fp8_thd_refusal
    assert "is not supported (TE disables" in rule((2, 18), "DelayedScaling", (10, 0), (9, 26, 0))
    assert rule((2, 19), "DelayedScaling", (10, 0), (9, 23, 0)) is None
    assert rule((2, 21, 0), "Float8CurrentScaling", (10, 3), (9, 26, 0)) is None
    assert "MXFP8BlockScaling" in rule((2, 21), "MXFP8BlockScaling", (10, 0), (9, 26, 0))
    assert "NVFP4BlockScaling is unverified" in rule((2, 21), "NVFP4BlockScaling", (10, 0), (9, 26, 0))
    assert "compute capability 9.0 is unverified" in rule((2, 21), "DelayedScaling", (9, 0), (9, 26, 0))


@pytest.mark.parametrize("version, comm, fmt, installed, usable", [
    ((2, 20, 2), "a2a", "bshd", ("FA2", "FA3", "FA4"), ("FA2", "FA3")),  # FA4 disabled under CP up to main d0067d0
    ((2, 21, 0), "a2a", "bshd", ("FA4",), ()),  # FA4 under CP for bshd: in no release note reached, unverified
    ((2, 16), "a2a", "thd", ("FA2", "FA3"), ()),  # padded thd: never FA2; FA3 from 2.17 (#2596)
    ((2, 17), "a2a", "thd", ("FA2", "FA3"), ("FA3",)),
    ((2, 20, 2), "a2a", "thd", ("FA4",), ()),
    ((2, 21, 0), "a2a", "thd", ("FA4",), ("FA4",)),  # release notes v2.21.0 (#3205)
    ((2, 21, 0), "a2a+p2p", "thd", ("FA3", "FA4"), ()),  # thd + a2a+p2p with FlashAttention: unverified
])
def test_te_flash_under_cp_by_release(version, comm, fmt, installed, usable):
    assert te_releases.flash_under_cp(version, comm, fmt, installed) == usable
