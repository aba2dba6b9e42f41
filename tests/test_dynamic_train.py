"""Dynamic CP training step at 4 ranks: loss and every gradient (reduced once over all ranks) equal
one process training on the same global batch (the parity reference: no cp_handler code); the
schedule mixes group sizes 1, 2 and 4 and
leaves some ranks with empty micro-batches. Group pool: every aligned group, looked up by
(size, first rank). Tolerances: see gpt_reference.py.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from gpt_reference import CONFIG

from cp_handler import AttentionShape, ContextParallelConfig
from cp_handler.dynamic import GroupPool, schedule_sequences
from cp_handler.models import GPTModel
from cp_handler.runtime.reductions import all_reduce_grads
from cp_handler.training import DynamicCP, TrainConfig
from cp_handler.training.steps import DynamicBatches, forward_backward, gpt_logits, reference_step

LENGTHS = [120, 7, 60, 33, 1, 250, 15, 18]  # budget 64: needs CP sizes 4, 1, 1, 1, 1, 4(+), 1, 1


class FixedDocuments:
    def __init__(self):
        gen = torch.Generator().manual_seed(9)
        self.docs = [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]

    def global_batch(self, step, n):
        return self.docs[:n]


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _dynamic_worker(rank, world):
    pool = GroupPool()
    assert pool.group(1, rank) is None
    with pytest.raises(KeyError, match="GroupPool.prepare"):
        pool.group(4, 0)
    pool.prepare(schedule_sequences([300, 40, 40, 20, 500, 30], world, 200, 2))  # groups of 2 and 4
    assert dist.get_process_group_ranks(pool.group(4, 0)) == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="is not in the group"):
        pool.group(2, (rank // 2 * 2 + 2) % 4)
    cp = ContextParallelConfig(context_parallel_size=world, qkv_format="thd")
    shape = AttentionShape(CONFIG.num_attention_heads, CONFIG.num_query_groups, CONFIG.kv_channels)
    config = TrainConfig(world_size=world, cp=cp, eval_cp=cp, attn_shape=shape, model=CONFIG, batch_size=2,
                         dynamic=DynamicCP(max_seqlen_per_rank=64))
    schedule = schedule_sequences(LENGTHS, world, 64, 1)
    assert {g.size for mb in schedule.micro_batches for g in mb.groups if g.sequences} >= {1, 4}
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    parts, total, _ = DynamicBatches(config, FixedDocuments(), pool, "cpu").parts(0)
    loss = forward_backward(model, parts, total, config, "cpu")
    all_reduce_grads(list(model.parameters()))  # what the trainer does after a dynamic step
    dist.all_reduce(loss)
    torch.manual_seed(0)
    reference = GPTModel(CONFIG)  # plain PyTorch attention, the documents as one pack (training.reference)
    ref_loss, _ = reference_step(reference, config, gpt_logits, FixedDocuments())(0)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), rtol=1e-6, atol=0)
    for (name, _), got, want in zip(model.named_parameters(), _grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}")


def test_dynamic_step_matches_single_process():
    run_distributed(_dynamic_worker, 4)
