"""Training a Hugging Face model under CP never goes silently wrong (issue 50): a MoE model's load-balancing loss is
computed from the whole sequence's router statistics (or refused), a model that is not a causal language model is
refused before the first step, and a forward that keeps a cache names the remedy. The multi-rank exactness of the
router loss (Trainer and TRL, against one process) is in tests/test_hf_trainer.py; cp-train's refusals before any
rank starts in tests/test_cli_hf.py.

Tolerances (float32, one process at cp=1 against transformers' own function on the same logits): the loss 1e-6
relative, the router weights' gradients atol 1e-7 + rtol 1e-5 (the same sums, reordered)."""

import copy

import hf_zoo
import pytest
import torch

from cp_handler.handlers.local import LocalContextParallelHandler
from cp_handler.integrations import hf_router_loss
from cp_handler.integrations.hf_batch import shard_batch
from cp_handler.integrations.transformers import cp_model_inputs, register
from cp_handler.runtime.config import ContextParallelConfig

AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def _moe(fields=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_zoo.tiny_config("qwen3_moe", fields))


def test_router_loss_through_the_handler_equals_transformers_with_padding():
    """Right-padded rows: the handler's rows (the batch padded to 2 * cp, an all-ones mask) count only the real
    tokens, as transformers counts those of its attention_mask."""
    plain = _moe(AUX)
    routed = copy.deepcopy(plain)
    register(routed)
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    want = plain(ids, attention_mask=mask)
    sharded = shard_batch({"input_ids": ids, "attention_mask": mask}, ContextParallelConfig())
    scope = hf_router_loss.RouterLossScope(None, sharded.token_mask)
    with hf_router_loss.router_loss_scope(scope):
        got = routed(**sharded.inputs, cp_handler=sharded.handler)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=0)
    with torch.no_grad():  # the control: padding rows counted
        assert not torch.allclose(routed(**sharded.inputs, cp_handler=sharded.handler).aux_loss, want.aux_loss,
                                  rtol=1e-5, atol=0)
    want.aux_loss.backward()
    got.aux_loss.backward()
    for (name, a), b in zip(plain.named_parameters(), routed.parameters(), strict=True):
        if "gate" in name and a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-5)


def _hand_loop_worker(rank, world):
    """The docs' hand-written loop with a right-padded batch at cp 2: the router loss told the real tokens
    (``router_loss_scope(RouterLossScope(token_mask=...))``, the padding mask dispatched by the handler) equals one
    process given its ``attention_mask``, the loss and the router gates' gradients summed over the group; without the
    scope every slot counts and the loss differs (the control)."""
    import torch.distributed as dist

    from cp_handler import get_cp_handler_cls

    plain = _moe(AUX)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    want = plain(ids, attention_mask=mask)
    want.aux_loss.backward()
    routed = _moe(AUX)
    register(routed)
    handler = get_cp_handler_cls("local", "p2p")(cp_group=dist.group.WORLD, cp_comm_type="p2p")
    local = handler.dispatch(ids, 1)
    scope = hf_router_loss.RouterLossScope(token_mask=handler.dispatch(mask, 1).bool())
    with hf_router_loss.router_loss_scope(scope):
        got = routed(local, **cp_model_inputs(handler, local), cp_handler=handler)
    got.aux_loss.backward()
    loss = got.aux_loss.detach().clone()
    dist.all_reduce(loss)  # the shares sum to the batch's loss
    torch.testing.assert_close(loss, want.aux_loss.detach(), rtol=1e-6, atol=0)
    for (name, a), b in zip(plain.named_parameters(), routed.parameters(), strict=True):
        if "gate" in name and a.grad is not None:
            grad = b.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, a.grad, atol=1e-7, rtol=1e-5)
    with torch.no_grad():  # the control: without the scope the padding rows count
        loss = routed(local, **cp_model_inputs(handler, local), cp_handler=handler).aux_loss.clone()
    dist.all_reduce(loss)
    assert not torch.allclose(loss, want.aux_loss.detach(), rtol=1e-5, atol=0)


def test_router_loss_in_a_hand_written_loop_with_padding_equals_one_process():
    from dist_utils import run_distributed

    run_distributed(_hand_loop_worker, 2)


def test_a_router_loss_cp_handler_does_not_know_is_refused(monkeypatch):
    """Statically when the config turns it on; at the forward when a caller turns it on."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def another_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return sum(g.float().pow(2).mean() for g in gate_logits)

    monkeypatch.setattr(modeling_qwen3_moe, "load_balancing_loss_func", another_loss)
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: output_router_logits=True turns on a router loss .* "
                                         r"set output_router_logits=False"):
        register(_moe(AUX))
    model = _moe()
    register(model)  # the loss is off: the model runs
    handler, ids = LocalContextParallelHandler(), torch.randint(1, 100, (1, 8))
    with pytest.raises(ValueError, match=r"its forward returned an aux_loss that cp_handler did not compute"):
        model(ids, **cp_model_inputs(handler, ids), output_router_logits=True, cp_handler=handler)


def test_a_bidirectional_model_and_an_encoder_decoder_are_not_trained(tmp_path):
    from test_hf_trainer import _cp_trainer
    from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

    bert = AutoModelForCausalLM.from_config(hf_zoo.tiny_config("bert", {"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match=r"BertLMHeadModel is not a causal language model: its attention layers "
                                         r"\['0', '1'\] attend bidirectionally"):
        _cp_trainer(tmp_path, bert)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model, not a causal "
                                         "language model"):
        _cp_trainer(tmp_path, T5ForConditionalGeneration(hf_zoo.tiny_config("t5")))


def test_a_forward_keeping_a_cache_names_the_remedy():
    """A config with use_cache=True (the usual default) keeps no cache under a handler (the forward gets
    use_cache=False: a cache would hold this rank's shard); asking for one explicitly is refused with the remedy."""
    from transformers import AutoModelForCausalLM

    config = hf_zoo.tiny_config("qwen3_next", {"layer_types": ["linear_attention", "full_attention"],
                                               "use_cache": True})
    model = AutoModelForCausalLM.from_config(config)
    register(model)
    handler, ids = LocalContextParallelHandler(), torch.randint(1, 100, (1, 8))
    with pytest.raises(ValueError, match=r"use_cache=True under context parallelism.*pass use_cache=False"):
        model(ids, **cp_model_inputs(handler, ids), use_cache=True, cp_handler=handler)
    assert model(ids, **cp_model_inputs(handler, ids), cp_handler=handler).past_key_values is None
