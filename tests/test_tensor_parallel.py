"""Tensor parallelism x context parallelism on one DeviceMesh (training/tensor_parallel.py): the reference GPT split
over tp ranks with PyTorch's ColwiseParallel / RowwiseParallel, the CP handler on the TP rank's heads, against one
process on the same inputs: the loss and every parameter's whole gradient (a split weight's gradient gathered from
its TP shards), at tp 2 x cp 2 (4 ranks) for p2p, all_gather and a2a, bshd and thd, and dp 2 x tp 2 x cp 2 (8 ranks).
A plan that forgets the row-wise reduction must fail (negative control). The collectives per layer are counted
against the formula: TP's all-reduces (DTensor's, counted by PyTorch's CommDebugMode) plus CP's pattern.

Tolerances: tests/gpt_reference.py (loss rtol 1e-6; gradients atol 1e-6 + rtol 1e-4): TP adds float32 reorderings
only (the row-wise all-reduce sums partial products in another order).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt_reference import CONFIG, assert_parity
from test_cli import cp_train

from cp_handler import AttentionShape, ContextParallelConfig, ParallelLayout, build_cp_handler
from cp_handler.models import GPTConfig, GPTModel
from cp_handler.models.loss import masked_token_loss_sum, next_token_batch
from cp_handler.runtime.groups import data_context_parallel_groups
from cp_handler.runtime.reductions import global_token_count
from cp_handler.training.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    gpt_tp_plan,
    local_attention_shape,
)

SHAPE = AttentionShape(CONFIG.num_attention_heads, CONFIG.num_query_groups, CONFIG.kv_channels)
SEQ, ROWS = 32, 2  # per dp replica: ROWS sequences of SEQ tokens (thd: documents of 5, 11 and 16 tokens)
DOCS = [5, 11, 16]


def _tokens(dp: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (dp * ROWS, SEQ), generator=torch.Generator().manual_seed(3))


def _cu(rows: int) -> torch.Tensor:
    lengths = torch.tensor(DOCS * rows)
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)


def _step(model, handler, tokens, count_group):
    """The token-weighted loss share of this rank and its backward; ``(loss, logits in global token order)``."""
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    logits = model(input_ids, cp_handler=handler)
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, count_group)
    loss.backward()
    return loss.detach(), handler.combine(logits.detach(), 1)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


MLA = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, kv_channels=16, v_head_dim=24)
"""Multi-head latent attention's head dims: values 24 wide, queries and keys 16."""


def _worker(rank, world, tp, cp, comm_type, qkv_format, plan_name, config=CONFIG):
    levels = [2, cp // 2] if comm_type == "a2a+p2p" else None  # a2a inside pairs of CP ranks, p2p across them
    layout = ParallelLayout(world, tensor_model_parallel_size=tp, context_parallel_size=cp,
                            hierarchical_context_parallel_sizes=levels)
    built = layout.build("cpu")
    groups = data_context_parallel_groups(built)
    dp_cp = built.groups["dp_cp"]
    torch.manual_seed(0)
    model = GPTModel(config)
    reference = copy.deepcopy(model)  # one process: the whole model, the whole global batch
    plan = gpt_tp_plan(model, tp, sequence_parallel=plan_name == "sequence parallel", ordered=plan_name == "ordered")
    if plan_name == "forgets the reduction":  # the row-wise outputs kept as partial sums: no all-reduce
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor.parallel import RowwiseParallel

        plan = {k: RowwiseParallel(output_layouts=Partial()) if isinstance(v, RowwiseParallel) else v
                for k, v in plan.items()}
    summed = apply_tensor_parallel(model, built.meshes["attention"]["tp"], plan)
    tokens = _tokens(layout.data_parallel_size)
    rows = tokens[groups.dp_rank * ROWS:(groups.dp_rank + 1) * ROWS]
    cp_config = ContextParallelConfig(context_parallel_size=cp, cp_comm_type=comm_type, qkv_format=qkv_format,
                                      hierarchical_context_parallel_sizes=levels)
    batch = {"qkv_format": "thd", "cu_seqlens": _cu(ROWS)} if qkv_format == "thd" else {}
    local = rows.reshape(1, -1) if qkv_format == "thd" else rows
    shape = AttentionShape(config.num_attention_heads, config.num_query_groups, config.kv_channels, config.v_head_dim)
    handler = build_cp_handler(cp_config, groups.cp_group, groups.hierarchical_cp_groups or None,
                               attn_shape=local_attention_shape(shape, tp), **batch)
    loss, logits = _step(model, handler, local, dp_cp)
    grads = {name: _whole(p.grad) for name, p in model.named_parameters()}  # split weights: gathered over tp
    for name in summed:  # replicated key-value projections (Hkv < tp): each rank's share from its query heads
        dist.all_reduce(grads[name], group=built.groups["tp"])
    dist.all_reduce(loss, group=dp_cp)
    for g in grads.values():
        dist.all_reduce(g, group=dp_cp)
    whole_batch = {"qkv_format": "thd", "cu_seqlens": _cu(len(tokens))} if qkv_format == "thd" else {}
    alone = build_cp_handler(ContextParallelConfig(qkv_format=qkv_format), None, **whole_batch)
    want_loss, want_logits = _step(reference, alone, tokens.reshape(1, -1) if qkv_format == "thd" else tokens, None)
    want = (want_loss, {name: p.grad for name, p in reference.named_parameters()})
    mine = slice(groups.dp_rank * ROWS * (SEQ if qkv_format == "thd" else 1),
                 (groups.dp_rank + 1) * ROWS * (SEQ if qkv_format == "thd" else 1))  # this dp replica's rows
    want_logits = want_logits[:, mine] if qkv_format == "thd" else want_logits[mine]
    label = f"tp {tp} x cp {cp} {comm_type} {qkv_format} rank {rank}"
    if plan_name == "forgets the reduction":
        with pytest.raises(AssertionError):
            assert_parity((loss, grads), want, "negative control")
        with pytest.raises(AssertionError):
            torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        return
    # logits: float32 sums reordered by the row-wise all-reduce and CP's merges, values O(1): 1e-5 absolute
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} logits: {m}")
    assert_parity((loss, grads), want, label)


PADDED = GPTConfig(vocab_size=256, hidden_size=96, num_layers=2, num_attention_heads=6, num_query_groups=2,
                   ffn_hidden_size=128)
"""6 query and 2 key-value heads: a TP rank's 3 and 1, which a2a over 2 CP ranks pads (3 query heads to 4, the one
key-value head replicated to 2: the uneven-head plan, ``a2a_head_plan(3, 1, 2)``)."""


@pytest.mark.parametrize("comm_type,qkv_format,config", [("p2p", "bshd", CONFIG), ("all_gather", "thd", CONFIG),
                                                         ("a2a", "bshd", PADDED), ("p2p", "thd", CONFIG)],
                         ids=["p2p-bshd", "all_gather-thd", "a2a-bshd-padded-heads", "p2p-thd"])
def test_tp2_cp2_equals_one_process(comm_type, qkv_format, config):
    run_distributed(_worker, 4, 2, 2, comm_type, qkv_format, "megatron", config)


@pytest.mark.parametrize("comm_type,qkv_format", [("p2p", "bshd"), ("a2a", "thd")])
def test_sequence_parallel_tp2_cp2_equals_one_process(comm_type, qkv_format):
    """Megatron-LM's sequence parallelism on the TP group (tensor_parallel's module doc): norms and residuals on each
    TP rank's share of the CP rank's tokens (uneven for the thd packs: 32 tokens over cp 2 then tp 2, and bshd rows
    of 16), gathered before the attention and the MLP, reduce-scattered after them; the norms' gradients summed over
    the TP group."""
    run_distributed(_worker, 4, 2, 2, comm_type, qkv_format, "sequence parallel")


def test_tp2_with_hierarchical_cp4_equals_one_process():
    """a2a+p2p on the TP rank's heads: tp 2 x cp 4 (8 ranks), a2a inside pairs of CP ranks over the 2 local heads
    (GQA 4:2 split by tp, then by the a2a level) and p2p across the pairs, thd packs."""
    run_distributed(_worker, 8, 2, 4, "a2a+p2p", "thd", "megatron")


def test_row_wise_sums_in_tp_rank_order_equal_one_process():
    """The deterministic mode's row-wise style above 2 TP ranks (``ordered_rowwise_parallel``: an all-gather of the
    partial sums, added in TP-rank order): tp 4 x cp 1, the loss and every gradient against one process (its
    backward passes the output's gradient to each rank's partial once, as the all-reduce's does)."""
    run_distributed(_worker, 4, 4, 1, "a2a", "bshd", "ordered")


MQA = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=1,
                ffn_hidden_size=128)
"""One key-value head: replicated over the TP ranks (Megatron-LM's rule for Hkv < tp)."""


@pytest.mark.parametrize("tp,cp,config", [(2, 2, MQA), (4, 1, CONFIG)], ids=["mqa-tp2-cp2", "gqa2-tp4"])
def test_key_value_heads_replicated_when_fewer_than_tp(tp, cp, config):
    run_distributed(_worker, 4, tp, cp, "p2p", "bshd", "megatron", config)


def test_mla_head_dims_tp2_cp2_equals_one_process():
    run_distributed(_worker, 4, 2, 2, "a2a", "thd", "megatron", MLA)


@pytest.mark.parametrize("comm_type,qkv_format,config", [("p2p", "bshd", CONFIG), ("a2a", "thd", MLA)],
                         ids=["gqa-p2p-bshd", "mla-a2a-thd"])
def test_dp2_tp2_cp2_equals_one_process(comm_type, qkv_format, config):
    """8 ranks: GQA 4:2, and multi-head latent attention's head dims (values 24, queries and keys 16)."""
    run_distributed(_worker, 8, 2, 2, comm_type, qkv_format, "megatron", config)


def test_a_plan_that_forgets_the_reduction_fails():
    run_distributed(_worker, 4, 2, 2, "p2p", "bshd", "forgets the reduction")


def test_tp_rules_name_the_field():
    check_tensor_parallel(CONFIG, 2)
    check_tensor_parallel(CONFIG, 4)  # 2 key-value heads replicated over 4 ranks
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by it"):
        check_tensor_parallel(CONFIG, 3)
    odd = GPTConfig(hidden_size=96, num_attention_heads=6, num_query_groups=3, ffn_hidden_size=128)
    with pytest.raises(ValueError, match="num_query_groups=3 is not divisible by it nor divides it"):
        check_tensor_parallel(odd, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be an integer >= 1"):
        check_tensor_parallel(CONFIG, 0)


def test_ordered_row_wise_style_refuses_what_it_does_not_order():
    """The deterministic mode's row-wise style returns the replicated local output or a sharded one (sequence
    parallelism's ordered reduce-scatter): a replicated DTensor output is refused, naming the setting."""
    from torch.distributed.tensor import Replicate

    from cp_handler.runtime.reductions import ordered_rowwise_parallel

    with pytest.raises(ValueError, match=r"OrderedRowwiseParallel: output_layouts=\(Replicate\(\),\), "
                                         "use_local_output=False: it returns the replicated local output or a "
                                         r"Shard\(dim\)"):
        ordered_rowwise_parallel()(output_layouts=Replicate(), use_local_output=False)


def _count_worker(rank, world, comm_type, variant):
    """TP's collectives per layer against Megatron-LM's formula (PyTorch's CommDebugMode counts them): each block's
    input is a replicated DTensor, so the column-wise projections' input gradients (q, k, v; gate, up) add up as
    partial sums before one reduction per block. Without sequence parallelism: 2 all-reduces per layer forward (the
    row-wise outputs) and 2 backward (the blocks' input gradients); one key-value head replicated over TP
    (``"mqa"``) adds none (its input gradient joins the block's). Sequence parallelism: per layer 2 all-gathers and 2
    reduce-scatters each way (forward: gather before the block, reduce-scatter its output; backward: the reverse),
    plus one all-gather each way (forward: the head's input; backward: the embedding output's gradient), no
    all-reduce. CP's collectives: its pattern's formula (below), the same calls as without TP, carrying the TP rank's
    heads (fewer bytes)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from cp_handler.ops.collectives import count_comms

    built = ParallelLayout(world, tensor_model_parallel_size=2, context_parallel_size=2).build("cpu")
    groups = data_context_parallel_groups(built)
    config = MQA if variant == "mqa" else CONFIG
    counts = {}
    for tp in (1, 2):
        torch.manual_seed(0)
        model = GPTModel(config)
        if tp == 2:
            apply_tensor_parallel(model, built.meshes["attention"]["tp"],
                                  gpt_tp_plan(model, tp, sequence_parallel=variant == "sequence parallel"))
        cp_config = ContextParallelConfig(context_parallel_size=2, cp_comm_type=comm_type)
        shape = AttentionShape(config.num_attention_heads, config.num_query_groups, config.kv_channels)
        handler = build_cp_handler(cp_config, groups.cp_group, attn_shape=local_attention_shape(shape, tp))
        input_ids, labels, loss_mask = next_token_batch(handler, _tokens(1))
        with CommDebugMode() as tp_fwd, count_comms() as cp_fwd:
            loss = masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask)
        with CommDebugMode() as tp_bwd, count_comms() as cp_bwd:
            loss.backward()
        tp_ops = [{kind: sum(n for op, n in mode.get_comm_counts().items() if str(op).split(".")[-1] == name)
                   for kind, name in (("all_reduce", "all_reduce"), ("all_gather", "all_gather_into_tensor"),
                                      ("reduce_scatter", "reduce_scatter_tensor"))} for mode in (tp_fwd, tp_bwd)]
        counts[tp] = (tp_ops, dict(cp_fwd.ops), dict(cp_bwd.ops), cp_fwd.bytes_sent + cp_bwd.bytes_sent)
    layers = config.num_layers
    none = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    assert counts[1][0] == [none, none], counts[1]
    if variant == "sequence parallel":
        each_way = {"all_reduce": 0, "all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers}
        assert counts[2][0] == [each_way, each_way], counts[2]
    else:
        assert counts[2][0] == [{**none, "all_reduce": 2 * layers}] * 2, counts[2]
    assert counts[2][1:3] == counts[1][1:3], (counts[1], counts[2])  # CP's pattern: the same calls
    # CP's own formula at cp 2, per layer: p2p one ring step forward (K / V to the next rank: one send, one recv) and
    # two backward (K / V again and their gradients home); a2a two all-to-alls each way (q / k / v in, the output
    # back; the gradients the same); plus the handler's agreement all-gathers (a few small ones per forward)
    ring = {"p2p": ({"send": 1, "recv": 1}, {"send": 2, "recv": 2}),
            "a2a": ({"all_to_all": 2}, {"all_to_all": 2})}[comm_type]
    for ops, per_layer in zip(counts[2][1:3], ring, strict=True):
        assert {op: n for op, n in ops.items() if op != "all_gather"} == \
            {op: n * layers for op, n in per_layer.items()}, (comm_type, ops)
    # on the TP rank's half of the query heads: about half the bytes for p2p (one key-value head of two; "mqa": the
    # one key-value head on every TP rank, the same K / V bytes); a2a replicates the one local key-value head to the
    # a2a size of 2, so its K / V bytes stay
    bound = {"p2p": 0.51, "a2a": 0.9}[comm_type] if variant != "mqa" else 1.0
    assert counts[2][3] <= counts[1][3] * bound, (counts[1][3], counts[2][3])


@pytest.mark.parametrize("comm_type,variant", [("p2p", "megatron"), ("a2a", "megatron"),
                                               ("p2p", "sequence parallel"), ("p2p", "mqa")])
def test_collectives_per_layer_follow_the_formula(comm_type, variant):
    run_distributed(_count_worker, 4, comm_type, variant)


@pytest.mark.parametrize("extra", [[], ["--fsdp", "--num-kv-heads", "1", "--cp-comm-type", "auto",
                                         "--sequence-parallel", "--recompute", "--loss-chunk-tokens", "16"]],
                         ids=["allreduce", "fsdp2-mqa-auto-sp"])
def test_cp_train_tp_size_parity_every_step(tmp_path, extra):
    """cp-train --tp-size 2 --cp-size 2 at 4 ranks (thd packing, a2a, gradient clipping, evaluation at the training
    degree; and with FSDP2 over the dp x cp ranks of each TP position, one key-value head replicated over TP,
    ``auto`` choosing the pattern on the local heads, sequence parallelism, every layer recomputed in the backward
    and the loss in checkpointed chunks of 16 tokens): every step against one process from
    the same parameters (parity's float32 tolerance 1e-5)."""
    import json

    out = tmp_path / "metrics.json"
    flags = ["--nproc", "4", "--tp-size", "2", "--cp-size", "2", "--cp-comm-type", "a2a", "--packing", "thd",
             "--steps", "3", "--seq-len", "64", "--hidden-size", "64", "--ffn-hidden-size", "128",
             "--max-corpus-bytes", "2000000", "--clip-grad", "0.5", "--eval-every", "3", "--check-parity",
             "--metrics-out", str(out), *extra]
    result = cp_train(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 4 = tp 2 x dp 1 x cp 2" in result.stderr and "parity passed" in result.stderr
    assert ("FSDP2 over the 2 dp x cp ranks" in result.stderr) == bool(extra)
    assert ("sequence parallel" in result.stderr) == bool(extra)
    assert ("every layer recomputed" in result.stderr) == bool(extra)
    metrics = json.loads(out.read_text())
    assert metrics["tp_size"] == 2 and metrics["parity"]["passed"] and "eval_loss" in metrics["steps"][-1]


@pytest.mark.parametrize("flags,rule", [
    (["--nproc", "6", "--tp-size", "4"], "--tp-size 4 does not divide the 6 ranks"),
    (["--nproc", "4", "--tp-size", "2", "--hidden-size", "96", "--num-heads", "6", "--num-kv-heads", "3"],
     "--tp-size 2: --num-kv-heads 3 is not divisible by it nor divides it"),
    (["--nproc", "4", "--tp-size", "2", "--compile"], "--tp-size 2 with --compile: not implemented"),
    (["--nproc", "4", "--tp-size", "2", "--export-hf", "x"], "--tp-size 2 with --export-hf: not implemented"),
    (["--nproc", "4", "--tp-size", "2", "--cp-size", "2", "--eval-cp-size", "1"], "evaluation at another CP"),
    (["--nproc", "4", "--sequence-parallel"], "--sequence-parallel splits the tokens over the TP group: it needs "
                                              "--tp-size above 1"),
    (["--nproc", "4", "--tp-size", "2", "--sequence-parallel", "--moe-experts", "4"],
     "--sequence-parallel is built for the reference GPT's dense layers"),
])
def test_cp_train_tp_rules_before_any_rank(flags, rule):
    from cp_handler.cli.args import parse

    with pytest.raises(SystemExit, match=rule):
        parse([*flags, "--steps", "1"])


def test_a_checkpoint_saved_at_tp2_resumes_at_another_tp(tmp_path):
    """Saved at tp 2 x cp 2 (split weights: DTensors, through torch.distributed.checkpoint) and resumed at tp 1 x cp 4
    (TP and CP changed together) and at tp 2 x cp 2 with FSDP2 (the weights sharded over dp x cp as well, on the 2-D
    mesh): steps 3 and 4 have the losses of the uninterrupted run (float32: the same to 1e-6), and the resumed steps
    pass --check-parity."""
    import json

    common = ["--steps", "4", "--seq-len", "64", "--hidden-size", "64", "--ffn-hidden-size", "128",
              "--max-corpus-bytes", "2000000"]

    def run(*flags):
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.json"
        result = cp_train(*common, *flags, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        return [r["loss"] for r in json.loads(out.read_text())["steps"]]

    whole = run("--nproc", "4", "--tp-size", "2", "--cp-size", "2")
    run("--nproc", "4", "--tp-size", "2", "--cp-size", "2", "--steps", "2", "--save", str(tmp_path / "ck"))
    for layout in (["--nproc", "4", "--cp-size", "4"], ["--nproc", "4", "--tp-size", "2", "--cp-size", "2", "--fsdp"]):
        resumed = run(*layout, "--resume", str(tmp_path / "ck"), "--check-parity")
        assert resumed == pytest.approx(whole[2:], rel=1e-6), (layout, resumed, whole)


MOE = GPTConfig(vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.1)
"""tests/test_moe.py's MoE model: 8 experts, top 2, a load-balancing loss weighing 0.1."""


def _moe_worker(rank, world, tp, cp, ep, comm_type):
    """MoE layers under TP (tensor_parallel's module doc): attention split over tp, the experts whole on each TP rank
    and sharded over the ep ranks of its TP position; the loss (token loss + load-balancing loss) and every gradient
    (split weights gathered over tp; experts summed over edp) against one process holding every expert."""
    from cp_handler.runtime.moe import ExpertParallelHandler

    layout = ParallelLayout(world, tensor_model_parallel_size=tp, context_parallel_size=cp,
                            expert_model_parallel_size=ep)
    built = layout.build("cpu")
    groups, dp_cp = data_context_parallel_groups(built), built.groups["dp_cp"]
    torch.manual_seed(0)
    model = GPTModel(MOE)
    reference = copy.deepcopy(model)
    assert not any(".mlp." in path for path in gpt_tp_plan(model, tp))  # every layer's MLP is a MoE layer: whole
    apply_tensor_parallel(model, built.meshes["attention"]["tp"])
    moe = ExpertParallelHandler(num_experts=8, ep_group=built.groups["ep"], stats_group=dp_cp)
    model.shard_experts(moe.local_expert_ids)
    tokens = _tokens(layout.data_parallel_size)
    rows = tokens[groups.dp_rank * ROWS:(groups.dp_rank + 1) * ROWS]
    shape = AttentionShape(MOE.num_attention_heads, MOE.num_query_groups, MOE.kv_channels)
    handler = build_cp_handler(ContextParallelConfig(context_parallel_size=cp, cp_comm_type=comm_type),
                               groups.cp_group, attn_shape=local_attention_shape(shape, tp))

    def step(net, cp_handler, moe_handler, batch, count_group):
        input_ids, labels, loss_mask = next_token_batch(cp_handler, batch)
        loss = masked_token_loss_sum(net(input_ids, cp_handler=cp_handler, moe_handler=moe_handler), labels,
                                     loss_mask) / global_token_count(loss_mask, count_group)
        loss = loss + sum(moe_handler.aux_losses)
        loss.backward()
        return loss.detach()

    loss = step(model, handler, moe, rows, dp_cp)
    grads = {name: _whole(p.grad) for name, p in model.named_parameters()}
    experts = {name for name in grads if ".experts." in name}
    assert len(experts) == 2 * 3 * 8 // ep  # 2 layers x 3 matrices x this rank's experts
    dist.all_reduce(loss, group=dp_cp)
    for name, g in grads.items():  # dense: over the dp x cp ranks of this TP position; experts: over their replicas
        dist.all_reduce(g, group=built.groups["edp"] if name in experts else dp_cp)
    alone = build_cp_handler(ContextParallelConfig(), None)
    want_loss = step(reference, alone, ExpertParallelHandler(num_experts=8), tokens, None)
    want = {name: p.grad for name, p in reference.named_parameters() if name in grads}
    assert_parity((loss, grads), (want_loss, want), f"MoE tp {tp} x cp {cp} ep {ep} {comm_type} rank {rank}")


@pytest.mark.parametrize("world,tp,cp,ep,comm_type", [(4, 2, 2, 2, "p2p"), (8, 2, 2, 4, "a2a")],
                         ids=["tp2-cp2-ep2", "dp2-tp2-cp2-ep4"])
def test_moe_layers_under_tp_equal_one_process(world, tp, cp, ep, comm_type):
    run_distributed(_moe_worker, world, tp, cp, ep, comm_type)


def test_cp_train_moe_under_tp_resumes_at_another_expert_layout(tmp_path):
    """``cp-train --tp-size 2 --moe-experts 4``: saved at dp 2 x tp 2 x cp 2 with the experts over ep 4 and resumed at
    tp 2 x cp 2 over ep 2 (the same global batch): steps 3 and 4 have the uninterrupted run's losses (1e-6) and pass
    --check-parity (loss, rank 0's gradients, the gradient norm against one process)."""
    import json

    common = ["--seq-len", "64", "--hidden-size", "64", "--ffn-hidden-size", "128", "--max-corpus-bytes", "2000000",
              "--tp-size", "2", "--cp-size", "2", "--moe-experts", "4"]

    def run(*flags):
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.json"
        result = cp_train(*common, *flags, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        return [r["loss"] for r in json.loads(out.read_text())["steps"]], result.stderr

    whole, _ = run("--nproc", "4", "--expert-parallel-size", "2", "--batch-size", "4", "--steps", "4")
    run("--nproc", "8", "--expert-parallel-size", "4", "--batch-size", "2", "--steps", "2", "--cp-comm-type", "a2a",
        "--save", str(tmp_path / "ck"))
    resumed, log = run("--nproc", "4", "--expert-parallel-size", "2", "--batch-size", "4", "--steps", "4",
                       "--resume", str(tmp_path / "ck"), "--check-parity")
    assert "4 experts over ep 2" in log and "parity passed" in log, log[-2000:]
    assert resumed == pytest.approx(whole[2:], rel=1e-6), (resumed, whole)


def _saved_worker(rank, world):
    """What one TP rank saves for the backward is exactly what the layer of its share (``bench.memory.tp_local_shape``)
    saves alone (its saved tensors' local shards counted), recomputation off and on. With sequence parallelism it
    keeps ``1 / tp`` of the two norms' saved tensors and of each checkpointed layer's hidden-state input
    (``bench.memory.tp_bytes_per_token``'s rule, which the TP projection of ``cp-bench --modes memory`` applies at
    Llama-3 shapes): the rule's numbers, measured here on real ranks."""
    from cp_handler.bench import memory

    built = ParallelLayout(world, tensor_model_parallel_size=world).build("cpu")
    shape = {"hidden_size": 64, "num_layers": 1, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 128, "vocab_size": 256}  # one layer: the projection's measurement
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    got, want = {}, {}
    for sequence_parallel in (False, True):
        for recompute in (False, True):
            torch.manual_seed(0)
            split = GPTModel(GPTConfig(**shape))
            apply_tensor_parallel(split, built.meshes["attention"]["tp"],
                                  gpt_tp_plan(split, world, sequence_parallel=sequence_parallel))
            share = GPTModel(GPTConfig(**memory.tp_local_shape(shape, world)))
            for model in (split, share):
                if recompute:
                    model.gradient_checkpointing_enable()
            key = (sequence_parallel, recompute)
            got[key], want[key] = memory.saved_bytes(split, ids, chunk=8), memory.saved_bytes(share, ids, chunk=8)
    for recompute in (False, True):
        assert got[False, recompute] == want[False, recompute], (recompute, got, want)
    whole = [{"tp": world, "recompute": recompute, **got[False, recompute]} for recompute in (False, True)]
    outside = got[False, False]["other_bytes_per_token"]
    for layers in (1, 80):  # the rule's bytes per token (float32 here: 4 bytes a value) against the measured ones
        measured = layers * (got[True, True]["other_bytes_per_token"] - outside) + \
            got[True, False]["layer_bytes_per_token"] + outside
        rule = memory.tp_bytes_per_token(whole, world, layers, shape["hidden_size"], True, 4)
        assert rule == measured, (layers, rule, measured, got)
    assert rule < memory.tp_bytes_per_token(whole, world, layers, shape["hidden_size"], False, 4)


def test_a_tp_rank_saves_what_the_layer_of_its_share_saves():
    run_distributed(_saved_worker, 2)


def test_a_train_config_with_tp_refuses_what_it_does_not_implement():
    """The library route (a TrainConfig built without cp-train) refuses the same combinations by field name, in
    Trainer.build before any collective."""
    from dataclasses import replace

    from cp_handler.training import TrainConfig
    from cp_handler.training.tensor_parallel import check_train_config

    cp = ContextParallelConfig(context_parallel_size=2)
    config = TrainConfig(world_size=4, cp=cp, eval_cp=cp, attn_shape=SHAPE, model=CONFIG, tensor_parallel_size=2)
    check_train_config(config)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with offload_activations=True: not implemented"):
        check_train_config(replace(config, offload_activations=True))
    check_train_config(replace(config, tensor_parallel_size=1, offload_activations=True))


def test_backend_auto_is_local_under_tp_where_transformer_engine_runs(monkeypatch):
    """``--backend auto`` picks Transformer Engine where it can run, but tensor parallelism runs on the local backend
    only: with --tp-size above 1 ``auto`` is local (the two-node examples use the default backend)."""
    from cp_handler import get_cp_handler_cls
    from cp_handler.cli.args import parse, resolve_backend

    monkeypatch.setattr(get_cp_handler_cls("transformer_engine", "p2p"), "check_available", classmethod(lambda c: None))
    assert resolve_backend("auto") == "transformer_engine"  # the patch took: TE "can run here"
    config, _ = parse(["--nproc", "4", "--tp-size", "2", "--steps", "1"])
    assert config.cp.backend == "local" and config.tensor_parallel_size == 2
    with pytest.raises(SystemExit, match="--tp-size 2 with --backend transformer_engine: tensor parallelism is tested"):
        parse(["--nproc", "4", "--tp-size", "2", "--backend", "transformer_engine", "--steps", "1"])
