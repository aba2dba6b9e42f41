"""Unmodified Hugging Face causal LMs (Llama, Qwen2, Mistral, built from configs, GQA 4/2) under
context parallelism through ``cp_handler.integrations.transformers``: logits and every parameter
gradient at cp 1, 2 and 4 equal the unmodified single-process model (attn_implementation="sdpa"),
for p2p, all_gather, a2a and a2a+p2p, bshd and thd (thd reference: each document run alone).

Tolerances (fp32): logits atol = rtol = 1e-5 (the attention sums are reordered, one merge per ring
step, a few float32 roundings of O(1) values through two layers); loss and gradients as
tests/gpt_reference.py (loss rtol 1e-6, gradients atol 1e-6 + rtol 1e-4).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from gpt_reference import assert_parity

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from cp_handler.integrations.transformers import (
    CPCausalLM,
    check_transformers_version,
    cp_attention,
    local_position_ids,
    register,
)
from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch

DOCUMENTS = [5, 17, 2, 30, 10]  # thd pack of 64 tokens


def configs():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    return {"llama": (LlamaConfig(**shape), LlamaForCausalLM), "qwen2": (Qwen2Config(**shape), Qwen2ForCausalLM),
            "mistral": (MistralConfig(**shape), MistralForCausalLM)}


def build(name, attn):
    config, cls = configs()[name]
    config = copy.deepcopy(config)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config)


def _next_token_loss(logits, tokens):
    """Reference: mean next-token cross entropy of one sequence (sum and count)."""
    return F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="sum"), tokens.shape[1] - 1


def reference_step(name, tokens, cu_seqlens=None):
    """Unmodified model on one process: logits (B, S, V) and loss/grads of the token-weighted loss;
    thd: every document alone."""
    model = build(name, "sdpa")
    if cu_seqlens is None:
        logits = model(tokens).logits
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
        count = tokens.shape[0] * (tokens.shape[1] - 1)
    else:
        bounds = cu_seqlens.tolist()
        parts, losses, count = [], 0.0, 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            doc_logits = model(tokens[:, a:b]).logits
            parts.append(doc_logits)
            loss, n = _next_token_loss(doc_logits, tokens[:, a:b])
            losses, count = losses + loss, count + n
        logits = torch.cat(parts, dim=1)
    loss = losses / count
    loss.backward()
    return logits.detach(), (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})


def cp_step(name, handler, tokens, group):
    model = CPCausalLM(build(name, "sdpa"))
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    logits = model(input_ids, cp_handler=handler)
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)
    loss.backward()
    grads = {n.removeprefix("model."): p.grad.clone() for n, p in model.named_parameters()}
    loss = loss.detach().float()  # the token count is float64
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return handler.combine(logits.detach(), 1), (loss, grads)


def _parity_worker(rank, world, names):
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2] if world >= 4 else None)
    group = groups.cp_group if world > 1 else None
    comm_types = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if world >= 4 else [])
    tokens = torch.randint(0, 256, (2, 16 * max(world, 2)), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    packed = torch.randint(0, 256, (1, int(cu[-1])), generator=torch.Generator().manual_seed(4))
    for name in names:
        for fmt, batch, meta in (("bshd", tokens, {}), ("thd", packed, {"qkv_format": "thd", "cu_seqlens": cu})):
            want_logits, want = reference_step(name, batch, meta.get("cu_seqlens"))
            for comm in comm_types:
                handler = get_cp_handler_cls("local", comm)(
                    cp_group=group, cp_comm_type=comm, hierarchical_cp_groups=groups.hierarchical_cp_groups, **meta)
                logits, got = cp_step(name, handler, batch, group)
                label = f"{name} {fmt} {comm} cp={world}"
                torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, x=label: f"{x}: {m}")
                assert_parity(got, want, label)
                if world == 1:
                    break  # the comm type does not matter alone


@pytest.mark.parametrize("world", [1, 2, 4])
def test_hf_models_match_the_unmodified_model(world):
    run_distributed(_parity_worker, world, ["llama", "qwen2", "mistral"])


def test_handler_reaches_attention_per_batch_and_errors():
    """The handler comes from the forward's kwargs or the context manager, and nothing stays active
    after the block; no handler, dropout or a short sliding window are errors."""
    model = build("llama", register())
    reference = build("llama", "sdpa")
    tokens = torch.randint(0, 256, (1, 16))
    handler = get_cp_handler_cls("local", "p2p")(cp_group=None)
    positions = local_position_ids(handler, tokens)
    want = reference(tokens).logits
    torch.testing.assert_close(model(tokens, position_ids=positions, cp_handler=handler, use_cache=False).logits,
                               want, atol=0, rtol=0)
    with cp_attention(handler):
        torch.testing.assert_close(model(tokens, position_ids=positions, use_cache=False).logits, want, atol=0,
                                   rtol=0)
    with pytest.raises(RuntimeError, match=r"needs a handler: pass cp_handler=handler"):
        model(tokens, use_cache=False)
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention dropout=0.1 is not supported"), cp_attention(handler):
        model(tokens, use_cache=False)
    mistral = build("mistral", register())
    mistral.config.sliding_window = 8
    for layer in mistral.model.layers:
        layer.self_attn.sliding_window = 8
    with pytest.raises(ValueError, match=r"attn_mod.window_size=\(7, 0\): the local backend has no sliding-window"):
        CPCausalLM(mistral)(tokens)


def test_transformers_version_range():
    with pytest.raises(ImportError, match=r"transformers 4.40.0 is installed; cp_handler's integration was tested "
                                          r"with 4.57 to 5.23"):
        check_transformers_version("4.40.0")
    check_transformers_version("5.23.0")
    check_transformers_version("4.57.6")
