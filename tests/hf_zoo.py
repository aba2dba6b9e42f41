"""The Hugging Face zoo: every causal-LM architecture the installed transformers ships, built from a tiny
config, run through the documented route at cp 2 and compared with the unmodified model.

:func:`tiny_config` shrinks a model type's default config generically (the standard field names,
and the extra fields in :data:`OVERRIDES`); :func:`run_case` returns what happened to one model type
as one string, which tests/test_hf_zoo.py compares with its table:

* ``exact``: logits and every gradient equal the unmodified model's (its default attention, one
  process, the whole sequence) for p2p and a2a, and for p2p again with gradient checkpointing (train
  mode; each decoder layer recomputed in the backward, outside the forward) where the model supports it;
* ``refused: <message>``: the guard raised (cp_handler's error, before or during the first forward);
* ``mismatch: <what>``: a CP result differs (the guard failed to refuse: a silent wrong answer);
* ``error: <exception>``: something else raised under CP (an unclear error);
* ``not built: <exception>``: the tiny config does not build or run the unmodified model.

Tolerances as tests/test_hf_integration.py: logits atol = rtol = 1e-5, loss rtol 1e-6, gradients
atol 1e-6 + rtol 1e-4 (float32; CP only reorders sums).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import computed_once

from cp_handler import get_cp_handler_cls
from cp_handler.integrations.transformers import cp_model_inputs, register
from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch

SEQ_LEN = 32
VOCAB = 128
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
        "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 16, "q_lora_rank": 16,
        "rotary_dim": 4, "d_model": 32, "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4,
        "encoder_attention_heads": 4, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "num_decoder_layers": 2,
        "num_encoder_layers": 2, "use_cache": False, "router_jitter_noise": 0.0, "input_jitter_noise": 0.0}
"""Standard config fields set wherever a config has them (and can be set); no router noise in train mode."""

_MLA = {"num_key_value_heads": 4}  # multi-head latent attention: as many KV heads as query heads
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 8}
OVERRIDES: dict[str, dict] = {
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # its short-convolution layers, as LFM2 ships them
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # state-space hybrids: heads x head dim = expand x hidden size; a Mamba layer and an attention layer
    "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 2, "chunk_size": 8},
    "bamba": {**_MAMBA2, "attn_layer_indices": [1]},
    "granitemoehybrid": {**_MAMBA2, "layer_types": ["mamba", "attention"]},
    "zamba": {"num_hidden_layers": 3, "layer_types": ["linear_attention", "hybrid", "hybrid"], "n_mamba_heads": 2,
              "mamba_dt_rank": 4,
              "attention_hidden_size": 64, "attention_head_dim": 16},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1], "n_mamba_heads": 4,
               "mamba_headdim": 16, "mamba_ngroups": 1, "mamba_d_state": 8, "attention_hidden_size": 64,
               "attention_head_dim": 16, "chunk_size": 8},
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash",
                     "youtu", "axk1", "axk2", "minicpm3"), _MLA),
    # token mixers at the tiny width (the defaults: Kimi delta attention 32 heads x 128, Falcon-H1's Mamba2 128 heads,
    # state 256, one chunk of 256: 10-25x the zoo's other models' time, and a single partial chunk per rank)
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 8},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 8},
    # encoder towers at the tiny width (their convolutions, which the guard refuses, kept; full size: 870M and 307M
    # parameters, 21 s and 4 s to build)
    "phi4_multimodal": {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                          "num_attention_heads": 4},
                        "audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1,
                                         "num_attention_heads": 4, "ext_pw_out_channel": 32,
                                         "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32}},
    "moss_transcribe_diarize": {"audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                 "num_attention_heads": 4}},
}
"""Extra fields per model type, where the defaults would not show the architecture's mixers."""

HYBRIDS = {"qwen3_next": {"layer_types": ["linear_attention", "full_attention"]}, "kimi_linear": {},
           "bamba": {}, "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2}, "lfm2": {}}
"""tests/test_hf_hybrid.py's models: one token mixer layer (gated delta rule, Kimi delta attention, Mamba2, Mamba,
short convolution) and one attention layer each (Kimi Linear: two delta layers), the vocabulary of
tests/test_hf_integration.py."""


def hybrid_configs() -> dict:
    """:data:`HYBRIDS` as ``{name: (config, model class)}`` (tests/test_hf_integration.py's ``configs``)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, fields in HYBRIDS.items():
        config = tiny_config(name, {**fields, "vocab_size": 256})
        out[name] = (config, AutoModelForCausalLM._model_mapping[type(config)])
    return out


def _settable(config, name: str) -> bool:
    prop = getattr(type(config), name, None)
    return hasattr(config, name) and not (isinstance(prop, property) and prop.fset is None)


def tiny_config(model_type: str, extra: dict | None = None):
    """The model type's config built with :data:`TINY`, :data:`OVERRIDES` and ``extra`` (the fields its default
    config has; passed to the constructor so that derived fields follow), no dropout."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    wanted = {**TINY, **OVERRIDES.get(model_type, {}), **(extra or {})}
    config = AutoConfig.for_model(model_type, **{k: v for k, v in wanted.items() if _settable(default, k)})
    try:
        text = config.get_text_config()
    except ValueError:  # several text configs (e.g. MusicGen): the top-level one is shrunk only
        text = config
    for target in {id(config): config, id(text): text}.values():
        for name, value in wanted.items():
            if _settable(target, name) and getattr(target, name) != value and target is text and text is not config:
                setattr(target, name, value)
        for name in list(vars(target)):
            if name.endswith(("dropout", "_pdrop", "dropout_prob", "dropout_rate")) and \
                    isinstance(getattr(target, name), float):
                setattr(target, name, 0.0)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(target, name, None), int) and getattr(target, name) >= VOCAB:
                setattr(target, name, 0)
    return config


def build(config):
    """The unmodified model of ``config`` (a config, or a model type: its :func:`tiny_config`) with its
    default attention implementation, eval mode, seed 0."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(config) if isinstance(config, str) else config).eval()


def reference(model, tokens):
    """Logits, loss and gradients of the unmodified model on the whole sequence."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens).logits
    loss = F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def _reference_or_failure(model, tokens):
    """:func:`reference`, or the ``not built: ...`` outcome when the unmodified model fails on its own."""
    try:
        return reference(model, tokens)
    except Exception as err:  # noqa: BLE001 - the zoo records every failure as an outcome
        return f"not built: {type(err).__name__}: {str(err)[:200]}"


def cp_run(model, tokens, comm_type: str, group, model_inputs=cp_model_inputs):
    """The documented route at this rank: logits (combined), loss and gradients summed over ``group``."""
    model.zero_grad(set_to_none=True)
    handler = get_cp_handler_cls("local", comm_type)(cp_group=group, cp_comm_type=comm_type)
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    logits = model(input_ids, **model_inputs(handler, input_ids), cp_handler=handler).logits
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loss = loss.detach().float()
    for t in [loss, *grads.values()]:
        dist.all_reduce(t, group=group)
    return handler.combine(logits.detach(), 1), loss, grads


def _compare(got, want) -> str | None:
    (logits, loss, grads), (want_logits, want_loss, want_grads) = got, want
    if not torch.allclose(logits, want_logits, atol=1e-5, rtol=1e-5):
        return f"logits differ by {(logits - want_logits).abs().max().item():.2e}"
    if not torch.allclose(loss, want_loss.float(), rtol=1e-6, atol=0):
        return f"loss {loss.item():.6f} vs {want_loss.item():.6f}"
    if grads.keys() != want_grads.keys():
        return f"gradients of {sorted(set(grads) ^ set(want_grads))[:3]} missing on one side"
    for name in want_grads:
        # a parameter stored in bfloat16 (transformers 4.57's xIELU): torch.testing's bfloat16 tolerances
        rtol, atol = (1e-4, 1e-6) if want_grads[name].dtype == torch.float32 else (1.6e-2, 1e-5)
        if not torch.allclose(grads[name], want_grads[name], rtol=rtol, atol=atol):
            return f"gradient {name} differs by {(grads[name] - want_grads[name]).abs().max().item():.2e}"
    return None


def run_case(config, group, model_inputs=cp_model_inputs) -> str:
    """What happens to a model type (or a config; see the module doc). Every rank of ``group`` calls it;
    ``model_inputs`` replaces the route's model inputs (the negative control)."""
    tokens = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    try:
        model = build(config)
    except Exception as err:  # noqa: BLE001 - the zoo records every failure as an outcome
        return f"not built: {type(err).__name__}: {str(err)[:200]}"
    cp_model = copy.deepcopy(model)  # the same weights, copied before any forward; switched to cp_handler below
    want = computed_once(_reference_or_failure, model, tokens)  # rank 0's, bitwise; every rank built the model
    if isinstance(want, str):
        return want
    try:
        register(cp_model)
        for comm_type in ("p2p", "a2a"):
            problem = _compare(cp_run(cp_model, tokens, comm_type, group, model_inputs), want)
            if problem:
                return f"mismatch: {comm_type}: {problem}"
        if cp_model.supports_gradient_checkpointing:
            cp_model.train()  # no dropout or router noise (tiny_config): the eval-mode reference still holds
            cp_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            problem = _compare(cp_run(cp_model, tokens, "p2p", group, model_inputs), want)
            if problem:
                return f"mismatch: p2p with gradient checkpointing: {problem}"
    except ValueError as err:
        return f"refused: {err}"
    except Exception as err:  # noqa: BLE001
        return f"error: {type(err).__name__}: {str(err)[:300]}"
    return "exact"


GENERATION_PROMPTS = (7, 12)
GENERATION_TOKENS = 3


def run_generation_case(config, group) -> str:
    """Greedy generation (cp_handler.inference) of a model type whose training is exact: two prompts of
    :data:`GENERATION_PROMPTS` tokens, :data:`GENERATION_TOKENS` new ones at cp = ``group``'s size (p2p
    prefill), against the unmodified model re-run on each whole sequence (teacher-forced). ``exact``
    (the same tokens, logits within 1e-5, one prefill), ``refused: <message>``, ``mismatch: <what>`` or
    ``error: ...``."""
    from cp_handler.inference import generate, reference_generate
    from cp_handler.integrations.hf_inputs import text_config
    from cp_handler.integrations.transformers import CPCausalLM
    from cp_handler.training.reference import hf_logits

    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in GENERATION_PROMPTS]
    model = build(config)
    try:
        layers = text_config(model).num_hidden_layers
        got = generate(CPCausalLM(copy.deepcopy(model)).eval(), prompts, GENERATION_TOKENS, cp_group=group,
                       num_layers=layers)
    except ValueError as err:
        return f"refused: {err}"
    except Exception as err:  # noqa: BLE001 - recorded as an outcome
        return f"error: {type(err).__name__}: {str(err)[:300]}"
    want = computed_once(reference_generate, model, prompts, GENERATION_TOKENS, follow=got.tokens,
                         logits_of=hf_logits)  # got.tokens: the same on every rank
    if got.tokens != want.tokens:
        return f"mismatch: tokens {got.tokens} != {want.tokens}"
    if got.prefills != 1:  # no tiny config has RoPE that depends on the length: a decode step was wasted
        return f"mismatch: {got.prefills} prefills"
    worst = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    return "exact" if worst <= 1e-5 else f"mismatch: logits differ by {worst:.2e}"


REASONS = {
    "did not run cp_handler's attention": "some layer did not run cp_handler's attention (its attention is outside "
                                          "transformers' registry, or a token mixer it does not route)",
    "do not change when position_ids jump": "its positions come from the input's length, not position_ids (a shard "
                                            "would use local positions)",
    "differ from its own defaults": "it derives positions or masks from its inputs another way (RoBERTa's positions "
                                    "start after padding_idx)",
    "config.layer_types has": "a layer type other than attention without a routed mixer (a mixer written inline)",
    "config.layer_types has ['hybrid_sliding']": "hybrid_sliding layers: short convolutions inside attention, not "
                                                 "routed",
    "convolution over the sequence": "a convolution over the sequence outside a routed mixer",
    "attention mask as a tensor": "it builds its attention mask as a tensor itself (the handler's layout is the mask)",
    "not a causal language model": "not a causal language model",
    "generation of hybrid models is not implemented": "generation of hybrid models is not implemented",
}
"""A reader's sentence for each refusal of the zoo table (its key: the text the guard's error contains)."""


def support_matrix(zoo: dict[str, str], not_attempted: str, generation: dict[str, str], release: str) -> str:
    """docs/huggingface.md's support matrix: one row per model type of ``zoo`` (tests/test_hf_zoo.py, recorded on
    transformers ``release``), with its generation outcome where training is exact (``generation``: the refused ones;
    the rest exact); each refusal written out (:data:`REASONS`)."""
    rows = [f"Generated from tests/test_hf_zoo.py's table (transformers {release}): exact = logits and every "
            "gradient equal the unmodified model at cp 2 (p2p, a2a); refused = the guard's error names the reason. "
            "Generation (cp_handler.inference, cp 2): exact = the same tokens and logits within 1e-5 as the "
            "unmodified model on each whole sequence.",
            "", "| model type | under CP | generation |", "|---|---|---|"]

    def shown(outcome: str) -> str:
        if outcome.startswith("refused: "):
            return "refused: " + REASONS[outcome.removeprefix("refused: ")]
        return {"not built": "not built from the generic tiny config (untested)",
                "not attempted": f"not attempted: {not_attempted}",
                "vision-language": "with images: see the vision-language table"}.get(outcome, outcome)

    for name, outcome in sorted(zoo.items()):
        generated = shown(generation.get(name, "exact")) if outcome == "exact" else ""
        rows.append(f"| {name} | {shown(outcome)} | {generated} |")
    return "\n".join(rows)
