"""Reference GPT: loss and every parameter gradient at cp=2 and cp=4 equal the cp=1 run, also with a
different cp_comm_type in every layer (p2p, all_gather, a2a, a2a+p2p) inside one model and handler (with a
value head dim other than the q/k head dim: MLA).

Also registers a new backend from outside the package (a contiguous-layout, all-gather handler
written here, its layout the conformance kit's contiguous one) and runs the unchanged model with it: the
contract is all the model needs.

Tolerances: see gpt_reference.py.
"""

import pytest
import torch
import torch.nn.functional as F
from conformance_backends import ContiguousLayout  # rank r holds the r-th contiguous block of every row
from device_cases import GPU_CASES
from dist_utils import GatherSumGrad, new_cp_group, run_distributed

from cp_handler import ContextParallelHandler, build_dp_cp_groups, get_cp_handler_cls, register_cp_handler
from cp_handler.models import GPTConfig


class ContiguousAllGatherHandler(ContextParallelHandler):
    """Its own layout (:class:`ContiguousLayout`) and attention step: all-gathers K/V (autograd reduce-scatters
    dK/dV) and masks by global position."""

    token_layout_cls = ContiguousLayout

    def attend(self, call):
        q, k, v = call.q, call.k, call.v  # (B, H, S_local, D)
        if self.cp_size > 1:
            k, v = (GatherSumGrad.apply(t.transpose(0, 2), self.cp_group).transpose(0, 2) for t in (k, v))
        q_pos = torch.arange(self.cp_rank * q.shape[2], (self.cp_rank + 1) * q.shape[2], device=q.device)
        mask = q_pos[:, None] >= torch.arange(k.shape[2], device=q.device)[None, :]
        return call.restore(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=call.scale, enable_gqa=True))


register_cp_handler("contiguous_allgather", ContiguousAllGatherHandler, ["all_gather"])

from gpt_reference import CONFIG, GPT_GPU_TOLERANCE, assert_close_by_norm, assert_parity, loss_and_grads  # noqa: E402


def _per_layer_parity(world, tokens):
    """One model, one handler, a different cp_comm_type in each layer; multi-head latent attention (values 24
    wide, queries and keys 16)."""
    comm_types = ["p2p", "all_gather", "a2a", "a2a+p2p"]
    config = GPTConfig(**{**vars(CONFIG), "num_layers": len(comm_types), "v_head_dim": 24})
    handler_cls = get_cp_handler_cls("local", comm_types)
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    reference = loss_and_grads(config, handler_cls(cp_group=None, cp_comm_type=comm_types), tokens, None)
    handler = handler_cls(cp_group=groups.cp_group, cp_comm_type=comm_types,
                          hierarchical_cp_groups=groups.hierarchical_cp_groups)
    assert_parity(loss_and_grads(config, handler, tokens, groups.cp_group), reference, f"per-layer {comm_types}")


def _gpt_worker(rank, world):
    group = new_cp_group()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(7))
    for config in (CONFIG, GPTConfig(**{**vars(CONFIG), "tie_word_embeddings": True, "num_query_groups": 4})):
        local_cls = get_cp_handler_cls("local", "p2p")
        reference = loss_and_grads(config, local_cls(cp_group=None), tokens, None)
        got = loss_and_grads(config, local_cls(cp_group=group, cp_comm_type="p2p"), tokens, group)
        assert_parity(got, reference, "local p2p")
    custom_cls = get_cp_handler_cls("contiguous_allgather", "all_gather")
    reference = loss_and_grads(CONFIG, custom_cls(cp_group=None, cp_comm_type="all_gather"), tokens, None)
    custom = loss_and_grads(CONFIG, custom_cls(cp_group=group, cp_comm_type="all_gather"), tokens, group)
    assert_parity(custom, reference, "custom backend")
    _per_layer_parity(world, tokens)


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_loss_and_grads_match_cp1(world):
    run_distributed(_gpt_worker, world)


def _gpt_gpu_worker(rank, world, case):
    """The GPT step on CUDA (p2p, and one pattern per layer) vs a float64 CPU step."""
    comm_types = ["p2p", "all_gather", "a2a", "a2a+p2p"]
    config = GPTConfig(**{**vars(CONFIG), "num_layers": len(comm_types)})
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(7))
    groups = build_dp_cp_groups(world, case.device, [2, world // 2])
    reference = loss_and_grads(config, get_cp_handler_cls("local", comm_types)(cp_group=None), tokens, None,
                               dtype=torch.float64)
    one_process = loss_and_grads(config, get_cp_handler_cls("local", "p2p")(cp_group=None), tokens, None,
                                 case.device, case.dtype)
    for cp_comm_type in ("p2p", comm_types):
        handler = get_cp_handler_cls("local", cp_comm_type)(cp_group=groups.cp_group, cp_comm_type=cp_comm_type,
                                                            hierarchical_cp_groups=groups.hierarchical_cp_groups)
        got = loss_and_grads(config, handler, tokens, groups.cp_group, case.device, case.dtype)
        worst = assert_close_by_norm(got, reference, GPT_GPU_TOLERANCE[case.dtype], f"{cp_comm_type} {case.dtype}",
                                     one_process)
        if rank == 0:
            print(f"world {world} {cp_comm_type} {case.dtype}: worst error / bound {worst[0]:.3g} ({worst[1]})")


@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_gpt_on_gpu(world, case):
    run_distributed(_gpt_gpu_worker, world, case, device="cuda")


def test_gradient_checkpointing_recomputes_attention_in_the_backward():
    """``gradient_checkpointing_enable()`` (cp-train --recompute): every layer's attention runs again in
    the backward (2 calls per layer instead of 1), with the same loss and gradients bitwise (one process)."""
    from cp_handler.models import GPTModel

    calls = []

    class Counting(get_cp_handler_cls("local", "p2p")):
        def core_attn(self, *args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return super().core_attn(*args, **kwargs)

    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPTModel(CONFIG)
        if recompute:
            model.gradient_checkpointing_enable()
        calls.clear()
        logits = model(tokens, cp_handler=Counting(cp_group=None))
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        results.append((len(calls), logits.detach(), [p.grad for p in model.parameters()]))
    (plain_calls, plain_logits, plain_grads), (calls_with, logits_with, grads_with) = results
    assert (plain_calls, calls_with) == (CONFIG.num_layers, 2 * CONFIG.num_layers)
    assert torch.equal(plain_logits, logits_with) and all(map(torch.equal, plain_grads, grads_with))
