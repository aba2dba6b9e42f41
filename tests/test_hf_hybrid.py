"""Unmodified Hugging Face hybrid models under context parallelism (tests/hf_zoo.py's ``HYBRIDS``: Qwen3-Next's
gated delta rule, Kimi delta attention, Bamba's Mamba2, Jamba's Mamba, LFM2's short convolution, each beside
an attention layer): logits and every parameter gradient equal the unmodified single-process model (all five at
cp 2, Qwen3-Next and Bamba at cp 4), bshd and thd (thd reference: each document run alone, so the mixers' state
restarts per document), the attention layers' comm type taking every value in turn over the models and formats
(tests/test_hf_integration.py holds attention itself to every comm type). Tolerances as
tests/test_hf_integration.py (fp32; the mixers' state passing reorders float32 sums as the ring does). Also: the
routing is per instance, a changed mixer is refused by name, decode kernels and cache arguments are refused, and a
mixer that mixes tokens outside the routed kernels is refused by the probe (the negative control).
"""

import hf_zoo
import pytest
import torch
from dist_utils import run_distributed
from test_hf_integration import _parity_worker, build

from cp_handler.handlers.local import LocalContextParallelHandler
from cp_handler.integrations import hf_mixers
from cp_handler.integrations.hf_active import handler_context
from cp_handler.integrations.hf_model import check_mixer_documents
from cp_handler.integrations.transformers import register


@pytest.mark.parametrize("world, models", [(2, list(hf_zoo.HYBRIDS)), (4, ["qwen3_next", "bamba"])])
def test_hf_hybrids_match_the_unmodified_model(world, models):
    """cp 1: tests/test_hybrid.py (the mixer methods alone, thd); cp 4 for two of the models (the gated delta rule
    and Mamba2's scan; every mixer method runs at cp 4 with transformers' kernels in tests/test_hybrid.py)."""
    run_distributed(_parity_worker, world, models, True)


def _qwen3_next():
    return build("qwen3_next", "sdpa").eval()


def test_routing_is_per_instance_and_leaves_transformers_unchanged():
    from transformers.models.qwen3_next import modeling_qwen3_next as module

    kernels = (module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn)
    routed, plain = _qwen3_next(), _qwen3_next()
    register(routed)
    mixer = routed.model.layers[0].linear_attn
    assert "forward" in vars(mixer) and mixer._cp_mixer  # the instance's own forward
    assert "forward" not in vars(plain.model.layers[0].linear_attn)
    assert (module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn) == kernels
    x = torch.randn(1, 24, routed.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # without a handler every route is the kernel itself: the same output, bitwise
        assert torch.equal(mixer(x), plain.model.layers[0].linear_attn(x))


def test_mixers_are_decided_by_behaviour_not_by_their_class_or_source():
    """A mixer class cp_handler has never seen (here a renamed subclass, as a new transformers release would bring)
    is routed when its forward calls known kernels, and runs when the probe passes: no list of classes or source
    digests. (The negative control below shows the probe refusing one that mixes outside the kernels.)"""
    model = _qwen3_next()
    for layer in model.model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            mixer.__class__ = type("UnseenGatedDeltaNet", (type(mixer),), {})
    register(model)
    assert any(type(m).__name__ == "UnseenGatedDeltaNet" and m._cp_mixer for m in model.modules())


def test_a_cache_is_refused_by_type_and_use_cache_defaults_to_false_under_a_handler():
    """Under a handler a cache is refused whatever its argument is called (transformers 5.24 renamed
    ``cache_params`` / ``past_key_values`` to ``cache``); without ``use_cache`` the forward keeps no cache (the
    config's default would build one holding this rank's shard)."""
    from transformers import DynamicCache

    model = _qwen3_next()
    register(model)
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    handler = LocalContextParallelHandler()
    for name in ("past_key_values", "cache", "cache_params"):
        with pytest.raises(ValueError, match=f"{name} is a cache \\(DynamicCache"):
            model(ids, **{name: DynamicCache(config=model.config)}, cp_handler=handler)
    with pytest.raises(ValueError, match="use_cache=True under context parallelism"):
        model(ids, use_cache=True, cp_handler=handler)
    model.config.use_cache = True  # the usual default (the zoo's tiny config turns it off)
    assert model(ids, cp_handler=handler).past_key_values is None


def test_decode_kernels_and_state_arguments_are_refused_under_a_handler():
    handler = LocalContextParallelHandler()
    mixer = _qwen3_next().model.layers[0].linear_attn
    route = hf_mixers._route(mixer, "causal_conv1d_update", lambda *a, **k: None)
    with handler_context(handler), pytest.raises(ValueError, match="causal_conv1d_update is a single-token decode"):
        route(torch.zeros(1, 4, 1), torch.zeros(1, 4, 3))
    x, weight = torch.randn(1, 4, 8), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"conv_state=tensor \(1, 4, 3\)"):
        handler.causal_conv1d(x, weight, conv_state=torch.zeros(1, 4, 3))
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="initial_state=tensor"):
        handler.gated_delta_rule(q, q, q, -torch.rand(1, 8, 2), torch.rand(1, 8, 2),
                                 initial_state=torch.zeros(1, 2, 4, 4))


def test_negative_control_a_mixer_mixing_tokens_outside_the_kernels_is_refused():
    model = _qwen3_next()
    register(model)
    mixer = model.model.layers[0].linear_attn
    routed_forward = mixer.forward
    mixer.forward = lambda hidden_states, **kwargs: routed_forward(hidden_states.cumsum(1), **kwargs)  # inline mixing
    with pytest.raises(ValueError, match=r"token mixer 'model.layers.0.linear_attn' \(Qwen3NextGatedDeltaNet\) gives, "
                                         "on two documents packed together, another result"):
        check_mixer_documents(model)


def test_mixers_on_cuda_are_opt_in_until_a_gpu_run(monkeypatch):
    from types import SimpleNamespace

    from cp_handler.handlers.mixers import CUDA_OPT_IN, check_device

    on_cuda = SimpleNamespace(device=torch.device("cuda", 0))  # no GPU here: only the device is read
    monkeypatch.delenv(CUDA_OPT_IN, raising=False)
    with pytest.raises(ValueError, match="ssd_scan: the mixer methods have not yet been run on a GPU .* "
                                         "CP_HANDLER_CUDA_MIXERS=1"):
        check_device("ssd_scan", on_cuda)
    monkeypatch.setenv(CUDA_OPT_IN, "1")
    check_device("ssd_scan", on_cuda)
    check_device("ssd_scan", torch.zeros(1))


def test_routes_survive_hub_kernels_at_train_and_eval(tmp_path):
    """transformers' ``from_pretrained`` turns the ``kernels`` library on by default (5.2x), and its ``kernelize`` runs
    at every ``train()`` / ``eval()``, replacing the forward of each layer it knows: Qwen3.5's gated delta net's
    routed forward was popped at the first ``train()`` (the per-forward guard then stopped training). ``register``
    resets the hub kernels of a model with routed mixers, so the routes stay. Control: on a model whose kernels are
    left on, ``train()`` drops an instance forward of that layer (the premise, so the test can fail)."""
    import transformers

    config = hf_zoo.tiny_config("qwen3_5_text", {"layer_types": ["linear_attention", "full_attention"]})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path) for _ in range(2)]
    if not loaded[0].use_kernels:
        pytest.skip("this transformers release does not turn hub kernels on in from_pretrained")
    model, control = loaded
    register(model)
    mixer = model.model.layers[0].linear_attn
    for mode in (True, False, True):
        model.train(mode)
        assert "forward" in vars(mixer) and mixer._cp_mixer, mode
    assert not model.use_kernels
    control_mixer = control.model.layers[0].linear_attn
    control_mixer.forward = hf_mixers._routed_forward(control_mixer).__get__(control_mixer)
    control.train()
    assert "forward" not in vars(control_mixer)
