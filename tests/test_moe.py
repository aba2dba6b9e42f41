"""MoE reference model with expert parallelism: loss (token loss + load-balancing loss) and every
gradient equal a single process holding all experts, with experts sharded over ep ranks and tokens
exchanged by uneven all-to-all; plus the token exchange alone and the handler's rules.

Tolerances as gpt_reference.py (float32: loss rtol 1e-6, gradients atol 1e-6 + rtol 1e-4): the
parallel run reorders sums (attention merges, all-to-all regrouping, gradient all-reduce) only.
Routing is a discrete choice; with this seed no token has two experts within rounding of a tie.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt_reference import assert_parity
from test_cli import cp_train

from cp_handler import LocalContextParallelHandler
from cp_handler.models import GPTConfig, GPTModel
from cp_handler.runtime.moe import ExpertParallelHandler
from cp_handler.runtime.parallel_layout import ParallelLayout
from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch

CONFIG = GPTConfig(vocab_size=256, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=64, num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.1)
SEQ, BATCH = 32, 2


def tokens():
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def step(cp_handler, moe_handler, batch, count_group, shard: bool):
    """Loss share and gradients by parameter name of one training step (this rank only)."""
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    if shard:
        model.shard_experts(moe_handler.local_expert_ids)
    input_ids, labels, loss_mask = next_token_batch(cp_handler, batch)
    loss = masked_token_loss_sum(model(input_ids, cp_handler=cp_handler, moe_handler=moe_handler), labels, loss_mask)
    loss = loss / global_token_count(loss_mask, count_group) + sum(moe_handler.aux_losses)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def reference():
    return step(LocalContextParallelHandler(cp_group=None), ExpertParallelHandler(num_experts=8), tokens(), None,
                shard=False)


def _moe_worker(rank, world, cp, ep):
    layout = ParallelLayout(world, context_parallel_size=cp, expert_model_parallel_size=ep)
    groups = layout.build()
    dp_rank = dist.get_rank(groups.groups["dp"])
    rows = tokens()[dp_rank * BATCH // layout.data_parallel_size:(dp_rank + 1) * BATCH // layout.data_parallel_size]
    moe = ExpertParallelHandler(num_experts=8, ep_group=groups.groups["ep"], stats_group=groups.groups["dp_cp"])
    handler = LocalContextParallelHandler(cp_group=groups.groups["cp"], cp_comm_type="p2p")
    loss, grads, model = step(handler, moe, rows, groups.groups["dp_cp"], shard=True)
    experts = {n for n in grads if ".experts." in n}
    assert len(experts) == 2 * 3 * 8 // ep  # 2 layers x 3 matrices x local experts
    dist.all_reduce(loss)
    for name, g in grads.items():  # dense: summed over every rank; experts: over their replicas
        dist.all_reduce(g, group=groups.groups["edp"] if name in experts else None)
    want_loss, want_grads, _ = reference()
    assert_parity((loss, grads), (want_loss, {n: want_grads[n] for n in grads}), f"cp={cp} ep={ep} rank {rank}")


@pytest.mark.parametrize("cp, ep", [(4, 4), (2, 2), (2, 4)])
def test_moe_expert_parallel_matches_single_process(cp, ep):
    run_distributed(_moe_worker, 4, cp, ep)


@pytest.mark.parametrize("flags", [["--nproc", "2", "--cp-size", "2"],
                                   ["--nproc", "4", "--cp-size", "4", "--expert-parallel-size", "2"]])
def test_cp_train_moe_packed_documents_count_only_the_batch_tokens(flags):
    """thd under CP pads every document to a multiple of 2 cp; that padding used to enter the router statistics (the
    routed counts and the probability sums of the load-balancing loss), so the loss and its gradients differed from
    one process's (``--check-parity`` failed at cp 2: gradient 5.6e-4 relative, measured before the fix). The rows
    that count come from the CP handler's layout (``token_layout.real_token_mask()``): every step equals one process's
    within the parity tolerance."""
    result = cp_train(*flags, "--moe-experts", "4", "--packing", "thd", "--steps", "2", "--seq-len", "128",
                      "--hidden-size", "64", "--num-heads", "8", "--num-kv-heads", "8", "--ffn-hidden-size", "128",
                      "--max-corpus-bytes", "2000000", "--check-parity")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr


def test_reference_aux_loss_is_switch_formula():
    _, _, model = reference()
    layer = model.layers[0].mlp
    x = torch.randn(10, CONFIG.hidden_size)
    handler = ExpertParallelHandler(num_experts=8)
    gates, ids = layer.route(x.view(2, 5, -1), handler)  # (B, S_local, h)
    probs = torch.softmax(layer.router(x).float(), -1)
    f = torch.bincount(ids.flatten(), minlength=8).float() / (10 * 2)
    torch.testing.assert_close(handler.aux_losses[0], 0.1 * 8 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(gates.sum(-1), torch.ones(10))


def _exchange_worker(rank, world):
    group = dist.new_group(list(range(world)))
    handler = ExpertParallelHandler(num_experts=2 * world, ep_group=group)
    g = torch.Generator().manual_seed(rank)
    n = [0, 1, 7, 12][rank]  # uneven, one rank with no tokens at all
    x = torch.randn(n, 3, generator=g, requires_grad=True)
    ids = torch.randint(0, 2 * world, (n,), generator=g)
    got, counts, state = handler.token_dispatch(x, ids)
    assert sum(counts) == got.shape[0] and len(counts) == 2
    back = handler.token_combine(got * 2, state)  # an "expert" that doubles
    torch.testing.assert_close(back, x * 2)
    back.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_uneven_token_exchange_round_trips_with_gradients():
    run_distributed(_exchange_worker, 4)


def test_handler_rules():
    with pytest.raises(ValueError, match="divisible by the expert-parallel size"):
        ExpertParallelHandler(num_experts=0)
    with pytest.raises(ValueError, match="expert ids must lie"):
        ExpertParallelHandler(num_experts=2).token_dispatch(torch.zeros(1, 2), torch.tensor([2]))
    with pytest.raises(ValueError, match="moe_router_topk"):
        GPTModel(GPTConfig(num_moe_experts=2, moe_router_topk=3))


def test_exact_sums_cut_each_expert_by_the_units_of_its_rows():
    """With the deterministic mode's exact sums, the pairs carry their unit through :meth:`token_dispatch` and each
    local expert's rows are cut into runs of one unit (in token order: a unit's rows routed to one expert are the
    same tokens at every CP degree), told to the sums inside :meth:`expert_rows`; rows that are not whole batch rows
    of the told units are refused by name."""
    from cp_handler.runtime.exact_grads import ExactGradients

    sums = ExactGradients(torch.nn.Linear(3, 3))
    sums.units = (2, 3)  # a batch row of 5 local tokens in two units; two batch rows
    handler = ExpertParallelHandler(num_experts=2, exact=sums)
    ids = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])  # (T, k)
    x = torch.arange(20.0)[:, None].expand(20, 3)  # one row per (token, expert) pair
    got, counts, state = handler.token_dispatch(x, ids)
    assert counts == [10, 10]
    assert torch.equal(got[:10, 0], (ids.flatten() == 0).nonzero().flatten().float())  # expert 0's pairs, in order
    seen = []
    for index in range(2):
        with handler.expert_rows(state, index):
            seen.append(sums.units)
    assert seen == [(2, 3, 2, 3), (2, 3, 2, 3)] and sums.units == (2, 3)  # restored after each block
    with pytest.raises(ValueError, match="not whole batch rows of the told units"):
        handler.token_dispatch(x[:12], ids[:6])
