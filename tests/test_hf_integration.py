"""Unmodified Hugging Face causal LMs (Llama, Qwen2, Mistral, built from configs, GQA 4/2) under
context parallelism through ``cp_handler.integrations.transformers``: logits and every parameter
gradient at cp 1, 2 and 4 equal the unmodified single-process model (attn_implementation="sdpa"),
for p2p, all_gather, a2a and a2a+p2p, bshd and thd (thd reference: each document run alone).

Tolerances (fp32): logits atol = rtol = 1e-5 (the attention sums are reordered, one merge per ring
step, a few float32 roundings of O(1) values through two layers); loss and gradients as
tests/gpt_reference.py (loss rtol 1e-6, gradients atol 1e-6 + rtol 1e-4).
"""

import copy
import json

import hf_zoo
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from gpt_reference import assert_parity

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from cp_handler.integrations.transformers import (
    CPCausalLM,
    check_transformers,
    cp_attention_forward,
    cp_model_inputs,
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
            "mistral": (MistralConfig(**shape), MistralForCausalLM), **hf_zoo.hybrid_configs()}


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


def cp_step(name, handler, tokens, group, prepare=None):
    """``prepare``: given the model first (e.g. to compile its decoder layers)."""
    model = CPCausalLM(build(name, "sdpa"))
    if prepare is not None:
        prepare(model)
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


def _parity_worker(rank, world, names, rotate=False):
    """``rotate``: one comm type per model and format, in turn (the models' other layers are what is tested)."""
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2] if world >= 4 else None)
    group = groups.cp_group if world > 1 else None
    comm_types = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if world >= 4 else [])
    tokens = torch.randint(0, 256, (2, 16 * max(world, 2)), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    packed = torch.randint(0, 256, (1, int(cu[-1])), generator=torch.Generator().manual_seed(4))
    for i, name in enumerate(names):
        for j, (fmt, batch, meta) in enumerate((("bshd", tokens, {}),
                                                ("thd", packed, {"qkv_format": "thd", "cu_seqlens": cu}))):
            want_logits, want = reference_step(name, batch, meta.get("cu_seqlens"))
            for comm in [comm_types[(2 * i + j) % len(comm_types)]] if rotate else comm_types:
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
    """The handler comes from the forward's keyword; no handler, an unchecked model and dropout are errors."""
    model = build("llama", "sdpa")
    register(model)
    reference = build("llama", "sdpa")
    tokens = torch.randint(0, 256, (1, 16))
    handler = get_cp_handler_cls("local", "p2p")(cp_group=None)
    want = reference(tokens).logits
    inputs = cp_model_inputs(handler, tokens)
    torch.testing.assert_close(model(tokens, **inputs, cp_handler=handler).logits, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match=r"needs a handler: pass cp_handler=handler"):
        model(tokens)
    unchecked = build("llama", register())  # attn_implementation set, register(model) never called
    with pytest.raises(ValueError, match=r"this model was not checked for context parallelism: call "
                                         r"cp_handler.integrations.transformers.register\(model\)"):
        unchecked(tokens, cp_handler=handler)
    model.train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention dropout=0.1 is not supported"):
        model(tokens, **inputs, cp_handler=handler)


def _recompute_worker(rank, world):
    """Gradient checkpointing re-runs each decoder layer in the backward, after the forward (and its
    handler's state) ended: two forwards with two handlers (bshd p2p, thd a2a), one backward of the summed loss;
    each recomputed layer must use its own forward's handler. Reference: the unmodified model, each batch alone,
    the same summed loss."""
    group = dist.new_group(list(range(world)))
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    packed = torch.randint(0, 256, (1, int(cu[-1])), generator=torch.Generator().manual_seed(4))
    reference = build("llama", "sdpa")
    (_, (loss_a, _)), (_, (loss_b, _)) = reference_step("llama", tokens), reference_step("llama", packed, cu)
    reference.zero_grad()
    want_loss = F.cross_entropy(reference(tokens).logits[0, :-1], tokens[0, 1:])
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):  # thd: the packed documents' token mean
        doc = packed[:, a:b]
        want_loss = want_loss + _next_token_loss(reference(doc).logits, doc)[0] / (int(cu[-1]) - len(DOCUMENTS))
    want_loss.backward()
    torch.testing.assert_close(want_loss, loss_a + loss_b)
    want = (want_loss.detach(), {n: p.grad for n, p in reference.named_parameters()})
    for reentrant in (False, True):
        model = build("llama", "sdpa")
        register(model)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        first = get_cp_handler_cls("local", "p2p")(cp_group=group, cp_comm_type="p2p")
        second = get_cp_handler_cls("local", "a2a")(cp_group=group, cp_comm_type="a2a", qkv_format="thd", cu_seqlens=cu)
        loss = 0.0
        for handler, batch in ((first, tokens), (second, packed)):
            input_ids, labels, loss_mask = next_token_batch(handler, batch)
            inputs = cp_model_inputs(handler, input_ids)
            logits = model(input_ids, **inputs, cp_handler=handler, use_cache=False).logits
            loss = loss + masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)
        loss.backward()  # recomputes both forwards' layers, outside both
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        loss = loss.detach().float()
        for t in (loss, *grads.values()):
            dist.all_reduce(t, group=group)
        assert_parity((loss, grads), want, f"gradient checkpointing (use_reentrant={reentrant}) cp={world}")


def test_gradient_checkpointing_recomputes_with_each_forwards_handler():
    run_distributed(_recompute_worker, 2)


def _tiny(model_type, **fields):
    from transformers import AutoConfig

    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return AutoConfig.for_model(model_type, **{**shape, **fields})


REFUSED = [  # Jamba's Mamba layers run since the hybrid mixers (tests/test_hf_hybrid.py); these mix tokens inline
    ("recurrent_gemma", {},
     r"module 'model.layers.0.temporal_block.conv_1d' is a convolution over the sequence \(kernel 4\) outside a "
     "routed token mixer"),
    ("minimax", {"layer_types": ["linear_attention", "full_attention"]},
     r"config.layer_types has \['linear_attention'\] layers"),
]


VARIANTS = {
    "mistral": {"sliding_window": 5},
    "gemma2": {"sliding_window": 5, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 3.0},
    "gemma3_text": {"sliding_window": 5},
    "gpt_oss": {"sliding_window": 5, "num_local_experts": 4},
    "llama4_text": {"attention_chunk_size": 6, "num_local_experts": 2, "interleave_moe_layer_step": 2},
    # multi-head latent attention: q/k head dim 8 + 8 (no RoPE + RoPE), values 12; MoE layers after the first
    "deepseek_v2": {"num_key_value_heads": 4, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "kv_lora_rank": 16, "q_lora_rank": None, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "deepseek_v3": {"num_key_value_heads": 4, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "kv_lora_rank": 16, "q_lora_rank": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}
"""Model types with windows / chunks shorter than the sequence (and a shard), soft-capping (Gemma 2),
learnable sinks (GPT-OSS) and multi-head latent attention (DeepSeek-V2/V3: a value head dim other than the
query/key one); before the attention variants (issue 27) and MLA (issue 42) each of these was refused."""


def _variant_worker(rank, world, names):
    from transformers import AutoModelForCausalLM

    groups = build_dp_cp_groups(world, "cpu", [2, world // 2] if world >= 4 else None)
    group = groups.cp_group
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 11, 40, 48], dtype=torch.int32)

    def model():
        torch.manual_seed(0)
        config = _tiny(name, **VARIANTS[name])
        config._attn_implementation = "eager"  # implements every variant in the reference
        return AutoModelForCausalLM.from_config(config).eval()

    for name in names:
        for fmt, meta in (("bshd", {}), ("thd", {"qkv_format": "thd", "cu_seqlens": cu})):
            reference = model()
            bounds = cu.tolist() if meta else [0, tokens.shape[1]]
            parts, loss = [], 0.0
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                logits = reference(tokens[:, a:b]).logits
                parts.append(logits.detach())
                loss = loss + F.cross_entropy(logits[0, :-1].float(), tokens[0, a + 1:b], reduction="sum")
            (loss / (tokens.shape[1] - len(bounds) + 1)).backward()
            want = (loss.detach() / (tokens.shape[1] - len(bounds) + 1),
                    {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None})
            for comm in ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if world >= 4 else []):
                handler = get_cp_handler_cls("local", comm)(
                    cp_group=group, cp_comm_type=comm, hierarchical_cp_groups=groups.hierarchical_cp_groups, **meta)
                cp_model = CPCausalLM(model())
                input_ids, labels, loss_mask = next_token_batch(handler, tokens)
                logits = cp_model(input_ids, cp_handler=handler)
                cp_loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)
                cp_loss.backward()
                grads = {n.removeprefix("model."): p.grad.clone() for n, p in cp_model.named_parameters()
                         if p.grad is not None}
                cp_loss = cp_loss.detach().float()
                for t in [cp_loss, *grads.values()]:
                    dist.all_reduce(t, group=group)
                label = f"{name} {fmt} {comm} cp={world}"
                torch.testing.assert_close(handler.combine(logits.detach(), 1), torch.cat(parts, dim=1), atol=1e-5,
                                           rtol=1e-5, msg=lambda m, x=label: f"{x}: {m}")
                assert_parity((cp_loss, grads), want, label)


@pytest.mark.parametrize("world", [2, 4])
def test_hf_attention_variants_match_the_unmodified_model(world):
    """Sliding windows (Mistral, Gemma 2/3, GPT-OSS), soft-capping (Gemma 2), sinks (GPT-OSS), chunked
    attention (Llama 4) and multi-head latent attention (DeepSeek-V2/V3) through the documented route: logits
    and every gradient vs the unmodified model (eager attention, each thd document alone), every comm type, bshd
    and thd."""
    run_distributed(_variant_worker, world, list(VARIANTS))


@pytest.mark.parametrize("model_type, fields, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_features_that_do_not_run_under_cp_are_refused_by_name(model_type, fields, message):
    """Before the guard these produced output silently wrong (issue 24); now each is a ValueError
    naming the feature, from register(model) or the first forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_tiny(model_type, **fields)).eval()
    with pytest.raises(ValueError, match=message):
        CPCausalLM(model)(torch.randint(0, 256, (1, 16)))


def test_attention_refuses_what_it_does_not_implement():
    """Unknown arguments (a future release's), a materialised mask and output_attentions are refused by name."""
    model = build("llama", "sdpa")
    register(model)
    handler = get_cp_handler_cls("local", "p2p")(cp_group=None)
    tokens = torch.randint(0, 256, (1, 16))
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 16, 16)
    kv = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match=r"attention arguments cp_handler does not implement: new_feature=3"):
        cp_attention_forward(attn, q, kv, kv, None, cp_handler=handler, new_feature=3)
    with pytest.raises(ValueError, match=r"output_attentions=True"):
        cp_attention_forward(attn, q, kv, kv, None, cp_handler=handler, output_attentions=True)
    with pytest.raises(ValueError, match=r"a materialised attention mask \(Tensor \(1, 1, 16, 16\)\)"):
        cp_attention_forward(attn, q, kv, kv, torch.ones(1, 1, 16, 16, dtype=torch.bool), cp_handler=handler)
    with pytest.raises(ValueError, match=r"the attention_mask marks padding tokens"):
        model(tokens, position_ids=cp_model_inputs(handler, tokens)["position_ids"], cp_handler=handler,
              attention_mask=torch.tensor([[0] * 4 + [1] * 12]))


def test_from_config_with_attn_implementation_after_register():
    from transformers import AutoModelForCausalLM

    register()
    config = _tiny("llama")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="cp_handler")
    register(model)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(CPCausalLM(model)(tokens), reference(tokens).logits, atol=1e-6, rtol=1e-6)


LENGTH_DEPENDENT = {
    "dynamic NTK": ("llama", {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                                   "rope_theta": 10000.0}}),
    "LongRoPE": ("phi3", {"max_position_embeddings": 64, "original_max_position_embeddings": 24, "pad_token_id": 0,
                          "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                              "short_factor": [1.0] * 4, "long_factor": [3.0] * 4,
                                              "original_max_position_embeddings": 24}}),
    "Llama 4 temperature tuning": ("llama4_text", {"attn_temperature_tuning": True, "floor_scale": 4,
                                                   "attn_scale": 0.5, "no_rope_layers": [1, 0],
                                                   "num_local_experts": 2}),
}
"""Models whose math reads the sequence length or the absolute position (32 tokens, beyond the
original context of the RoPE configs): each rank must see the global length / positions. Llama 4's
temperature tuning reads the *local* length inside the model (transformers 5.23): refused at cp > 1."""
LENGTH_DEPENDENT_OUTCOMES = {"dynamic NTK": "exact", "LongRoPE": "exact",
                             "Llama 4 temperature tuning": "refused: layer 1: Llama 4's attention temperature tuning"}


def _length_dependent_worker(rank, world, out):
    import hf_zoo

    group = dist.new_group(list(range(world)))
    outcomes = {name: hf_zoo.run_case(_tiny(model_type, **fields), group)
                for name, (model_type, fields) in LENGTH_DEPENDENT.items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(outcomes, f)


def test_length_dependent_rope_exact_and_temperature_tuning_refused(tmp_path):
    """Logits and every gradient equal the unmodified model at cp 2, p2p and a2a (tests/hf_zoo.py); the
    rotary modules see the global length (without it, dynamic NTK and LongRoPE differ: checked by hand)."""
    out = tmp_path / "outcomes.json"
    run_distributed(_length_dependent_worker, 2, str(out))
    outcomes = json.loads(out.read_text())
    for name, expected in LENGTH_DEPENDENT_OUTCOMES.items():
        assert outcomes[name].startswith(expected), (name, outcomes[name])


def test_releases_are_refused_below_the_oldest_only():
    """Older than the oldest supported release: refused with the install that works here; newer ones are not refused
    by their number (the per-model probes decide)."""
    with pytest.raises(ImportError, match=r"transformers 4.57.6 is installed; cp_handler's integration needs 5.23 or "
                                          r"newer: pip install 'transformers>=5.23'"):
        check_transformers("4.57.6")
    for version in ("5.23.0", "5.25.0", "9.0.0"):
        check_transformers(version)
