"""Reference GPT on packed documents (thd): loss and every gradient at cp=2 and cp=4, with a different
cp_comm_type in every layer, equal (1) the cp=1 thd run and (2) running every document alone
(bshd, cp=1) and summing: no token sees another document, RoPE restarts per document, padding and
the documents' last tokens stay out of the loss; zero-length documents change nothing; values of another head
dim than queries and keys (MLA). Tolerances: see gpt_reference.py.
"""

import pytest
import torch
from dist_utils import run_distributed
from gpt_reference import CONFIG, assert_parity, loss_and_grads

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from cp_handler.models import GPTConfig, GPTModel
from cp_handler.training import masked_token_loss_sum, next_token_batch

LENGTHS = [5, 0, 1, 17, 2, 30, 9, 0]  # none a multiple of 2*cp; zero-length documents (a loader's padding)
COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]


def documents_alone(config, tokens, lengths):
    """Sum over documents of each one's loss sum, / total loss tokens; summed gradients."""
    torch.manual_seed(0)
    model = GPTModel(config)
    handler = get_cp_handler_cls("local", "p2p")(cp_group=None)
    sums, count, start = [], 0, 0
    for n in (n for n in lengths if n):  # a zero-length document has no token
        doc = tokens[:, start:start + n]
        input_ids, labels, loss_mask = next_token_batch(handler, doc)
        sums.append(masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask))
        count, start = count + loss_mask.sum(), start + n
    loss = torch.stack(sums).sum() / count.double()  # float64, as global_token_count
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _thd_gpt_worker(rank, world):
    config = GPTConfig(**{**vars(CONFIG), "num_layers": len(COMM_TYPES), "v_head_dim": 24})  # MLA: Dv 24, Dqk 16
    tokens = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(3))
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    handler_cls = get_cp_handler_cls("local", COMM_TYPES)
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    alone = documents_alone(config, tokens, LENGTHS)
    single = loss_and_grads(config, handler_cls(cp_group=None, qkv_format="thd", cu_seqlens=cu_seqlens,
                                                cp_comm_type=COMM_TYPES), tokens, None)
    assert_parity(single, alone, "thd cp=1 vs documents alone")
    handler = handler_cls(cp_group=groups.cp_group, qkv_format="thd", cu_seqlens=cu_seqlens,
                          cp_comm_type=COMM_TYPES, hierarchical_cp_groups=groups.hierarchical_cp_groups)
    assert_parity(loss_and_grads(config, handler, tokens, groups.cp_group), alone, f"thd cp={world} {COMM_TYPES}")


@pytest.mark.parametrize("world", [2, 4])
def test_thd_gpt_matches_documents_alone(world):
    run_distributed(_thd_gpt_worker, world)
