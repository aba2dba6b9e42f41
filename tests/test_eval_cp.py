"""Evaluation at another CP degree than training.

Regression for the silent bug class (a rotary table or cache sized by a static CP degree): train at
cp=2 and evaluate at cp=1, 2, 4, and train at cp=4 and evaluate at cp=4, 2, 1; every evaluation
equals a single-process evaluation of the same held-out batches, also with the loss in chunks of 5 tokens
(``loss_chunks``: the head never sees more than 5 rows at once). Training resumes bit-identically
after evaluation, also when evaluation raises. Each held-out sequence is evaluated exactly once.

Tolerance: evaluation losses rtol 1e-6 (float32; only attention sums are reordered, measured
< 1e-7); resume checks are exact (torch.equal).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt_reference import CONFIG

from cp_handler import ContextParallelConfig, build_dp_cp_groups, get_cp_handler_cls
from cp_handler.models import GPTModel
from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch
from cp_handler.training.eval_cp import EvalContextParallel, check_eval_layout, eval_config


class Rows:
    """A batch of sequences supporting ``rows(list)``, as cp-train's Batch."""

    def __init__(self, tokens, seen=None):
        self.tokens, self.seen = tokens, seen

    def __len__(self):
        return self.tokens.shape[0]

    def rows(self, index):
        if self.seen is not None:
            self.seen.extend(self.tokens[index, 0].tolist())
        return Rows(self.tokens[index])


def inputs(batch):
    return batch.tokens, {}


def train_step(model, train_cp, tokens, lr=0.05):
    """One SGD step at the training layout (rows split over DP replicas, grads summed over all ranks)."""
    rows = list(range(train_cp.groups.dp_rank, tokens.shape[0], train_cp.groups.dp_size))
    handler = train_cp.handler()
    input_ids, labels, loss_mask = next_token_batch(handler, tokens[rows])
    loss = masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask)
    (loss / global_token_count(loss_mask, dist.group.WORLD)).backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p -= lr * p.grad
            p.grad = None


def single_process_eval(model, batches):
    handler = get_cp_handler_cls("local", "p2p")(cp_group=None)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            input_ids, labels, loss_mask = next_token_batch(handler, batch.tokens)
            total += masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask).item()
            count += loss_mask.sum().item()
    return total / count


def _eval_worker(rank, world, train_size, eval_sizes):
    gen = torch.Generator().manual_seed(11)
    train_batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(2)]
    heldout = [Rows(torch.randint(0, 256, (4, 32), generator=gen)) for _ in range(3)]
    config = ContextParallelConfig(context_parallel_size=train_size)
    train_cp = EvalContextParallel(build_dp_cp_groups(train_size), config)
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    for tokens in train_batches:
        train_step(model, train_cp, tokens)
    expected = single_process_eval(model, heldout)
    for size in eval_sizes:
        evaluator = EvalContextParallel.build(eval_config(config, size))
        loss = evaluator.evaluate(model, heldout, inputs)
        assert loss == pytest.approx(expected, rel=1e-6), (train_size, size, loss, expected)
        rows = []
        hook = model.lm_head.register_forward_hook(lambda m, args, out, seen=rows: seen.append(
            out.flatten(0, -2).shape[0]))
        chunked = evaluator.evaluate(model, heldout, inputs, loss_chunks=lambda input_ids: 5)
        hook.remove()
        assert chunked == pytest.approx(expected, rel=1e-6) and 0 < max(rows) <= 5, (size, chunked, expected, rows)
    _check_resume(model, train_cp, EvalContextParallel.build(eval_config(config, eval_sizes[-1])), heldout,
                  train_batches[0])


def _check_resume(model, train_cp, evaluator, heldout, tokens):
    """After evaluation (and after one that raises) training continues exactly as without it."""
    reference = copy.deepcopy(model)
    model.train()
    rng = torch.get_rng_state()
    evaluator.evaluate(model, heldout, inputs)

    def failing(batch):
        raise RuntimeError("evaluation data failed")

    with pytest.raises(RuntimeError, match="evaluation data failed"):
        evaluator.evaluate(model, heldout, failing)
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    train_step(model, train_cp, tokens)
    train_step(reference, train_cp, tokens)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name


def _each_once_worker(rank, world):
    evaluator = EvalContextParallel.build(eval_config(ContextParallelConfig(), 2))  # dp=2 x cp=2
    seen = []
    batches = [Rows(torch.arange(5).view(5, 1).repeat(1, 8) + 10 * i, seen) for i in range(2)]
    torch.manual_seed(0)
    evaluator.evaluate(GPTModel(CONFIG), batches, inputs)
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    replicas = [everyone[0], everyone[2]]  # one rank per DP replica (CP ranks see the same rows)
    assert everyone[0] == everyone[1] and everyone[2] == everyone[3]
    assert sorted(replicas[0] + replicas[1]) == sorted(list(range(5)) + list(range(10, 15)))


@pytest.mark.parametrize("train_size, eval_sizes", [(2, [1, 2, 4]), (4, [4, 2, 1])])
def test_eval_at_other_degrees_matches_single_process(train_size, eval_sizes):
    run_distributed(_eval_worker, 4, train_size, eval_sizes)


def test_each_heldout_sequence_evaluated_once():
    run_distributed(_each_once_worker, 4)


def test_eval_layout_errors():
    train = ContextParallelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p",
                                  hierarchical_context_parallel_sizes=[2, 2])
    assert eval_config(train, 4).hierarchical_context_parallel_sizes == [2, 2]  # reused: same product
    with pytest.raises(ValueError, match="needs hierarchical_context_parallel_sizes"):
        eval_config(train, 2)
    assert eval_config(train, 2, [2, 1]).hierarchical_context_parallel_sizes == [2, 1]
    with pytest.raises(ValueError, match="world size 4 is not a multiple of context_parallel_size=3"):
        check_eval_layout(4, eval_config(ContextParallelConfig(), 3), 48)
    with pytest.raises(ValueError, match=r"seq_len=100 is not divisible by 2 \* context_parallel_size = 8"):
        check_eval_layout(4, eval_config(ContextParallelConfig(), 4), 100)
