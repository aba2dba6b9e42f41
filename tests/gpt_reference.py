"""Shared GPT parity helpers: one training step's loss and gradients, and the parity assertion.

Tolerance (float32): loss rtol 1e-6; gradients atol 1e-6 + rtol 1e-4. A CP run reorders float32
sums (ring merges, cross-rank gradient all-reduce, token-count reduction); measured differences
are ~1e-8 absolute on gradients of size ~1e-3..1e-1, so the bounds leave >10x headroom while an
off-by-one position or a missing token changes gradients by >1e-3.
"""

import torch
import torch.distributed as dist

from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch
from models import GPTConfig, GPTModel

CONFIG = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=128)


def loss_and_grads(config, handler, tokens, group):
    """Token-weighted loss of one step and every parameter gradient, summed over ``group``."""
    torch.manual_seed(0)
    model = GPTModel(config)
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    loss = masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask)
    loss = loss / global_token_count(loss_mask, group)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    loss = loss.detach()
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return loss, grads


def assert_parity(got, want, label):
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0, msg=lambda m: f"{label} loss: {m}")
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{label} grad {n}: {m}")


