"""Vision-language models under CP (cp_handler/integrations/hf_vlm.py) against the unmodified model in one process.

Each model of tests/hf_vlm_zoo.py runs on the same global batch (two rows, an image each straddling the shards,
Qwen's 3-D mRoPE positions with gaps, Qwen3-VL's deepstack rows, row 1 right-padded) under a local handler at cp 1,
2 and 4 with p2p, a2a and all_gather, and must give the outcome of ``hf_vlm_zoo.OUTCOMES``: ``exact`` (logits of
the real tokens, the loss, and every parameter's gradient summed over the ranks, the vision tower's included, within
the zoo's tolerances) or refused by name. Negative control: Qwen given positions ``0..S-1`` instead of its mRoPE ones
must be reported as a mismatch by the same comparison. At cp 2, Qwen3.5-MoE with its load-balancing loss on in the
docs' hand-written loop (row 1 right-padded): exact, the router gates' gradients included; counting the shard's padding
rows as tokens (the control) must fail. At cp 2, Qwen2.5-VL with dynamic NTK RoPE (its frequencies
read the largest position, which the mRoPE gaps put below ``S - 1``): exact (without the largest position handed to
the rotary hook, 1.1e-4 off in the logits); Qwen2.5-VL with a video beside the image (a2a).
"""

from __future__ import annotations

import json

import hf_vlm_zoo as zoo
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

COMM_TYPES = ("p2p", "a2a", "all_gather")
CHECKPOINTED = ("qwen2_5_vl", "qwen3_5")
"""Also run with gradient checkpointing (each decoder layer recomputed in the backward) at cp 2, p2p."""
NEGATIVE = ("qwen2_5_vl", "qwen3_vl")


def _expected(name: str, outcome: str) -> bool:
    if zoo.broken_upstream(name):  # the unmodified model fails on this release (named in hf_vlm_zoo.BROKEN_UPSTREAM)
        return outcome.startswith("broken upstream: ")
    want = zoo.OUTCOMES[name]
    return outcome == want if want == "exact" else outcome.startswith("refused") and want.split(": ", 1)[1] in outcome


def _worker(rank: int, world: int, out: str) -> None:
    group, outcomes = dist.group.WORLD, {}
    for name in zoo.MODELS:
        inputs = zoo.batch(name)
        if zoo.broken_upstream(name):
            outcomes[name] = zoo.upstream_outcome(name, inputs)
            continue
        ref, model = zoo.reference(name, inputs), None
        for comm in COMM_TYPES:
            if model is None:
                from cp_handler.integrations.transformers import register

                model = zoo.build(name)
                model.load_state_dict(ref[0].state_dict())
                register(model)
            outcomes[f"{name} {comm}"] = zoo.run_case(name, comm, group, inputs, ref, model)
        if world == 2 and name in CHECKPOINTED:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            outcomes[f"{name} checkpointed"] = zoo.run_case(name, "p2p", group, inputs, ref, model)
        if world == 2 and name in NEGATIVE:
            outcomes[f"{name} arange"] = zoo.run_case(name, "p2p", group, inputs, ref, positions="arange")
    if world == 2:
        for name, (base, _) in zoo.VARIANTS.items():
            outcomes[f"{base} {name}"] = zoo.run_case(name, "p2p", group)
        outcomes["qwen2_5_vl video"] = zoo.run_case("qwen2_5_vl", "a2a", group, zoo.batch("qwen2_5_vl", video=True))
        # the router loss's control: the shard's padding rows counted (as before the forward's real-token mask)
        outcomes["qwen3_5_moe_router_loss padding counted"] = zoo.run_case("qwen3_5_moe_router_loss", "p2p", group,
                                                                           router_tokens="all")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(outcomes, f)


@pytest.fixture(scope="module", params=[2, 4])
def outcomes(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm") / f"cp{request.param}.json"
    run_distributed(_worker, request.param, str(out))
    return json.loads(out.read_text())


def test_vision_language_models_under_cp_equal_one_process(outcomes):
    wrong = {case: got for case, got in outcomes.items()
             if not case.endswith(("arange", "counted")) and not _expected(case.split()[0], got)}
    assert not wrong, wrong


def test_negative_control_positions_0_to_s_fail(outcomes):
    controls = {case: got for case, got in outcomes.items() if case.endswith("arange")}
    assert set(controls) <= {f"{n} arange" for n in NEGATIVE}
    assert all(got.startswith("mismatch: logits") for got in controls.values()), controls


def test_negative_control_router_loss_counting_padding_fails(outcomes):
    """A hand-written loop's MoE router loss (Qwen3.5-MoE, right-padded row, the docs' loop): exact with the forward's
    real-token mask (the VARIANTS case above); the same run counting the shard's padding rows, as the router loss did
    when it dropped a mask whose shape was not the shard's, must fail the comparison (the loss moves by about 1e-6 of
    itself, the token loss dominating it; the gradients, the vision tower's included, by 1e-4 of their norm)."""
    if "qwen2_5_vl video" not in outcomes:
        pytest.skip("the controls run at cp 2 (this is the cp 4 run)")
    assert outcomes["qwen3_5_moe qwen3_5_moe_router_loss"] == "exact"
    got = outcomes["qwen3_5_moe_router_loss padding counted"]
    assert got.startswith(("mismatch: loss", "mismatch: gradient")), got


@pytest.mark.parametrize("name", zoo.MODELS)
def test_at_cp_1(name):
    assert _expected(name, zoo.run_case(name, "p2p"))


def test_the_vision_tower_keeps_its_attention():
    from cp_handler.integrations.hf_rotary import is_rotary
    from cp_handler.integrations.hf_vlm import language_model, vision_modules
    from cp_handler.integrations.transformers import register

    model = zoo.build("qwen2_5_vl")
    before = model.config.vision_config._attn_implementation
    register(model)
    assert model.config.get_text_config()._attn_implementation == "cp_handler"
    assert model.config.vision_config._attn_implementation == before != "cp_handler"
    vision = vision_modules(model)
    rotary = [m for m in model.modules() if is_rotary(m)]
    assert any(id(m) in vision for m in rotary) and any(id(m) not in vision for m in rotary)
    for m in rotary:  # the hooks of cp_handler's rotary modules: on the language model's only
        assert bool(m._forward_pre_hooks) == (id(m) not in vision), type(m).__name__
    assert language_model(model) is model.model.language_model


def _refusal(name: str, change, message: str, cp_handler=None):
    from cp_handler import get_cp_handler_cls
    from cp_handler.integrations.transformers import register

    model = zoo.build(name)
    register(model)
    inputs = {k: v for k, v in zoo.batch(name).items() if k != "labels"}
    handler = cp_handler or get_cp_handler_cls("local", "p2p")(cp_comm_type="p2p")
    inputs = change(inputs, model) or inputs
    with pytest.raises(ValueError, match=message):
        model(**inputs, cp_handler=handler)


def _drop(key):
    return lambda inputs, model: {k: v for k, v in inputs.items() if k != key}


def _left_padded(inputs, model):
    inputs["attention_mask"] = inputs["attention_mask"].flip(1)


def _unknown_tensor(inputs, model):
    from cp_handler.integrations.hf_vlm import language_model

    def add(module, args, kwargs):
        return args, {**kwargs, "extra_embeds": torch.zeros(2, zoo.SEQ_LEN)}

    language_model(model).register_forward_pre_hook(add, with_kwargs=True, prepend=True)


def _with_cache(name):
    def add(inputs, model):
        from transformers import DynamicCache

        inputs[name] = DynamicCache(config=model.config)

    return add


REFUSALS = {
    "gemma3 image blocks": ("gemma3", lambda inputs, model: None, "Gemma 3's image blocks"),
    "mRoPE without mm_token_type_ids": ("qwen2_5_vl", _drop("mm_token_type_ids"), "without mm_token_type_ids"),
    "left padding": ("qwen3_vl", _left_padded, "left padding"),
    "inputs_embeds alone": ("llava", lambda inputs, model: {"inputs_embeds": torch.zeros(2, zoo.SEQ_LEN, 64)},
                            "takes input_ids"),
    "unknown tensor to the language model": ("llava", _unknown_tensor, "extra_embeds"),
    "generation (a KV cache)": ("llava", _with_cache("past_key_values"), "past_key_values is a cache \\(DynamicCache"),
    # by type, whatever the argument's name: transformers 5.24 renamed it cache (it once slipped past a check by name)
    "a KV cache under another name": ("llava", _with_cache("cache"), "cache is a cache \\(DynamicCache"),
    "use_cache=True": ("qwen2_5_vl", lambda inputs, model: {**inputs, "use_cache": True}, "use_cache=True"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_by_name(case):
    name, change, message = REFUSALS[case]
    _refusal(name, change, message)


def test_generate_under_a_handler_never_runs():
    """The issue's reproduction (transformers 5.24: ``generate()`` on LLaVA under a handler ran, each rank's cache
    holding its shard, and the ranks drew different tokens): ``generate`` with ``cp_handler=`` raises before a token
    is drawn, by transformers' own check of the keyword arguments (5.25) or, where a release passes them on to the
    forward, by the guard's refusal of the cache it builds, whatever its name."""
    from cp_handler import get_cp_handler_cls
    from cp_handler.integrations.transformers import register

    model = zoo.build("llava")
    register(model)
    inputs = {k: v for k, v in zoo.batch("llava").items() if k != "labels"}
    with pytest.raises(ValueError, match=r"not used by the model: \['cp_handler'\]|is a cache \("):
        model.generate(**inputs, cp_handler=get_cp_handler_cls("local", "p2p")(cp_comm_type="p2p"), max_new_tokens=2)


def _odd_length_worker(rank, world):
    from cp_handler import get_cp_handler_cls

    handler = get_cp_handler_cls("local", "p2p")(cp_group=dist.group.WORLD, cp_comm_type="p2p")
    _refusal("qwen2_5_vl", lambda inputs, model: {k: v[:, :-2] if k in ("input_ids", "attention_mask",
                                                                        "mm_token_type_ids") else v
                                                  for k, v in inputs.items()}, "multiple of 2 \\* cp = 4", handler)


def test_a_length_not_a_multiple_of_2_cp_is_refused_by_name():
    run_distributed(_odd_length_worker, 2)


def test_packed_documents_refused_by_name():
    from cp_handler import ContextParallelConfig, build_cp_handler

    handler = build_cp_handler(ContextParallelConfig(), qkv_format="thd",
                               cu_seqlens=torch.tensor([0, 40, 64], dtype=torch.int32))
    _refusal("llava", lambda inputs, model: None, "packed documents", handler)


def test_docs_vision_language_table_is_the_table():
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "huggingface.md").read_text()
    assert zoo.support_matrix() in docs, "regenerate the table: hf_vlm_zoo.support_matrix()"


def test_the_local_token_route_refuses_a_vision_language_model():
    from cp_handler.integrations.transformers import CPCausalLM, check_architecture

    with pytest.raises(ValueError, match="vision-language model: under context parallelism it takes the whole batch"):
        CPCausalLM(zoo.build("llava"))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration is a vision-language model"):
        check_architecture(zoo.build("gemma3").config)  # cp-train --hf-config, before spawning


def test_a_config_with_use_cache_runs_its_training_forwards_without_a_cache(caplog):
    """Qwen3.5 (a hybrid VLM) with its config's default ``use_cache=True``, in the docs' loop without ``use_cache``:
    the forward under a handler runs with ``use_cache=False`` (said once, a warning), no cache comes back, and its
    logits are the unmodified model's (run with ``use_cache=False``) at cp 1 (atol = rtol = 1e-5, the zoo's). At cp 2
    and 4 the zoo's Qwen3.5 and Qwen3.5-MoE keep ``use_cache=True`` in every comparison with one process (loss and
    every gradient: :func:`hf_vlm_zoo.build`); ``use_cache=True`` passed explicitly is refused (``REFUSALS``)."""
    import logging

    from cp_handler import get_cp_handler_cls
    from cp_handler.integrations.transformers import register

    inputs = zoo.batch("qwen3_5")
    forward = {k: v for k, v in inputs.items() if k != "labels"}
    want = zoo.build("qwen3_5")(**forward, use_cache=False).logits
    model = zoo.build("qwen3_5")
    model.config.use_cache = model.config.get_text_config().use_cache = True
    register(model)
    handler = get_cp_handler_cls("local", "p2p")(cp_comm_type="p2p")
    with caplog.at_level(logging.WARNING, logger="cp_handler"):
        outputs = [model(**forward, cp_handler=handler) for _ in range(2)]
    said = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert all(getattr(out, "past_key_values", None) is None for out in outputs)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(outputs[0].logits[real], want[real], atol=1e-5, rtol=1e-5)


def _labels_worker(rank, world):
    from cp_handler import get_cp_handler_cls
    from cp_handler.integrations.transformers import register

    model = zoo.build("llava")
    register(model)
    inputs = zoo.batch("llava")
    handler = get_cp_handler_cls("local", "p2p")(cp_group=dist.group.WORLD, cp_comm_type="p2p")
    with pytest.raises(ValueError, match="labels without shift_labels under context parallelism: the model would "
                                         "shift this rank's shard"):
        model(**inputs, cp_handler=handler)


def test_labels_without_shift_labels_are_refused_at_cp_2():
    """The model's own loss from ``labels`` would shift this rank's shard of them (its next tokens sit on other ranks):
    refused by name in the hand-written loop (the trainers pass ``shift_labels``, shifted in global order)."""
    run_distributed(_labels_worker, 2)
