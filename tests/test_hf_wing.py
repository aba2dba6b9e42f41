"""The Hugging Face wing's plumbing (issue 51): how the handler reaches the attention function, how often a mask
is probed, and where hooks go.

* The handler travels in the forward's keyword arguments (``cp_handler``) to the attention function, given as a
  keyword or by ``cp_attention(handler)``; a model whose decoder layers drop them (StableLM) gets it from its mask.
* The mask classification is cached under the key of everything the mask function reads (hf_mask.reads_key): a
  second forward with the same layout is not probed; two batches with the same layout whose masks read other
  contents are classified apart (the negative case), and a function holding what no key captures is probed
  every time.
* Hooks: none on a Llama's decoder layers (the model's, the rotary module's, a recompute pair around the rotary
  module); a hybrid's routed mixers one pair each.
"""

import types

import hf_zoo
import pytest
import torch
from test_hf_integration import build

from cp_handler import get_cp_handler_cls
from cp_handler.integrations import hf_attention, hf_mask
from cp_handler.integrations.hf_model import recompute_hosts
from cp_handler.integrations.transformers import cp_attention, cp_model_inputs, register

WINDOW = 4  # read as a global by _global_window_mask


def _global_window_mask(batch_idx, head_idx, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (kv_idx > q_idx - WINDOW)


def _hooks(module):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def _handler():
    return get_cp_handler_cls("local", "p2p")(cp_group=None)


@pytest.fixture
def probes(monkeypatch):
    """How many times hf_mask.classify ran (a fresh cache)."""
    count = [0]
    classify = hf_mask.classify

    def counted(mask_function, n):
        count[0] += 1
        return classify(mask_function, n)

    monkeypatch.setattr(hf_mask, "classify", counted)
    monkeypatch.setattr(hf_mask, "_cache", type(hf_mask._cache)())
    return count


def test_llama_decoder_layers_get_no_hooks_and_hybrid_mixers_one_pair():
    model = build("llama", "sdpa")
    before = _hooks(model)
    register(model)
    # the model's pre / post hooks, the rotary module's, and a recompute pair on the base model around it
    assert _hooks(model) - before == 6 and recompute_hosts(model) == [model.model]
    assert [_hooks(layer) for layer in model.model.layers] == [0, 0]
    hybrid = build("qwen3_next", "sdpa")  # a gated delta rule layer and an attention layer
    register(hybrid)
    mixers = [m for m in hybrid.modules() if getattr(m, "_cp_mixer", False)]
    assert len(mixers) == 1 and {id(m) for m in recompute_hosts(hybrid)} == {id(hybrid.model), id(mixers[0])}
    assert [_hooks(layer) for layer in hybrid.model.layers] == [2, 0]


@pytest.mark.parametrize("name, source", [("llama", "keyword"), ("stablelm", "mask")])
def test_attention_takes_the_handler_from_its_call(monkeypatch, name, source):
    """Given as a keyword or by the context manager, the handler reaches the attention function in the
    forward's keyword arguments; StableLM's decoder layers drop them, its mask carries the handler."""
    seen = []
    call_handler = hf_attention.call_handler

    def spy(cp_handler, attention_mask):
        seen.append("keyword" if cp_handler is not None else "mask" if attention_mask.forward_handler else "none")
        return call_handler(cp_handler, attention_mask)

    model = build(name, "sdpa") if name == "llama" else hf_zoo.build(name)
    register(model)
    monkeypatch.setattr(hf_attention, "call_handler", spy)
    tokens = torch.randint(0, 100, (1, 16))
    handler = _handler()
    with torch.no_grad():
        model(tokens, **cp_model_inputs(handler, tokens), cp_handler=handler)
        with cp_attention(handler):
            model(tokens, **cp_model_inputs(handler, tokens))
    assert seen == [source] * (2 * model.config.num_hidden_layers)


def test_a_second_forward_with_the_same_layout_is_not_probed(probes):
    model = build("llama", "sdpa")
    register(model)
    probes[0] = 0
    with torch.no_grad():
        for tokens in (64, 64, 96, 64):
            ids = torch.randint(0, 256, (1, tokens))
            handler = _handler()
            model(ids, **cp_model_inputs(handler, ids), cp_handler=handler)
    assert probes[0] == 2  # 64 and 96 once each


def _layer_mask(config, tokens: int, **mask_functions):
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config, torch.zeros(1, tokens, 8), None, None,
                              position_ids=torch.arange(tokens)[None], **mask_functions)


def test_the_same_layout_with_other_contents_is_classified_per_batch(probes):
    """The negative case: mask functions that read per-batch data (here a 1-D tensor of the keys a batch
    allows, and Llama 4's chunks after a left-padding tensor) built for batches of the same layout; the
    cache must not answer for one batch what it found for another."""
    from transformers import LlamaConfig
    from transformers.masking_utils import chunked_causal_mask_function

    register()
    config = LlamaConfig(hidden_size=8, num_attention_heads=1)
    config._attn_implementation = "cp_handler"
    module, handler = torch.nn.Linear(1, 1), _handler()
    module.layer_idx = 0

    def keys_allowed(allowed):
        return _layer_mask(config, 32, and_mask_function=lambda b, h, q, kv: allowed[kv])

    everything, one_blocked = torch.ones(32, dtype=torch.bool), torch.ones(32, dtype=torch.bool)
    one_blocked[5] = False
    assert keys_allowed(everything).spec(32).kind == "causal"
    blocked = keys_allowed(one_blocked)
    assert blocked.spec(32).kind == "unknown"
    with pytest.raises(ValueError, match=r"layer 0 asks for a mask cp_handler cannot express \(it masks query 5 -> "
                                         r"key 5"):
        hf_attention._mask_type(module, blocked, None, handler, 32)
    assert keys_allowed(everything.clone()).spec(32).kind == "causal"  # the same content: the cached answer
    assert probes[0] == 2
    chunks = [hf_mask.CPMask(chunked_causal_mask_function(8, torch.tensor([pad])), 0, 0, None).spec(32)
              for pad in (0, 3, 0)]
    assert chunks == [hf_mask.MaskSpec("chunked", 8), chunks[1], hf_mask.MaskSpec("chunked", 8)]
    assert chunks[1].kind == "unknown" and probes[0] == 4


def test_reads_key_captures_everything_the_function_reads(probes):
    """Globals, closure values and tensor contents are in the key; what no key captures makes it ``None``
    (probed every time)."""
    global WINDOW
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_causal_mask_function

    key = hf_mask.reads_key
    assert key(sliding_window_causal_mask_function(4)) == key(sliding_window_causal_mask_function(4))
    assert key(sliding_window_causal_mask_function(4)) != key(sliding_window_causal_mask_function(8))
    first = key(_global_window_mask)
    assert hf_mask.classified(_global_window_mask, 32) == hf_mask.MaskSpec("sliding", 4)
    WINDOW = 6
    try:
        assert key(_global_window_mask) != first
        assert hf_mask.classified(_global_window_mask, 32) == hf_mask.MaskSpec("sliding", 6)
    finally:
        WINDOW = 4
    assert hf_mask.classified(_global_window_mask, 32) == hf_mask.MaskSpec("sliding", 4) and probes[0] == 2

    class Window:  # an object: its state is not in any key
        size = 4

        def __call__(self, b, h, q, kv):
            return (kv <= q) & (kv > q - self.size)

    window = Window()
    assert key(window) is None and key(lambda b, h, q, kv: window(b, h, q, kv)) is None
    specs = []
    for size in (4, 4, 5):
        window.size = size
        specs.append(hf_mask.classified(window, 32))
    assert [s.size for s in specs] == [4, 4, 5] and probes[0] == 5  # every call probed
    settings = types.ModuleType("settings")  # a module two composed functions read other attributes of
    settings.UNUSED, settings.LIMIT = 0, 3

    def first(b, h, q, kv):
        return kv >= settings.UNUSED

    def second(b, h, q, kv):
        return q - kv < settings.LIMIT

    both = and_masks(causal_mask_function, first, second)
    assert hf_mask.classified(both, 32) == hf_mask.MaskSpec("sliding", 3)
    settings.LIMIT = 5
    assert hf_mask.classified(both, 32) == hf_mask.MaskSpec("sliding", 5)
    large = torch.zeros(hf_mask.KEY_TENSOR_ELEMENTS + 1, dtype=torch.bool)
    assert key(lambda b, h, q, kv: (kv <= q) | large[kv]) is None
    shift = torch.tensor([0])
    assert key(shift.add) != key(torch.tensor([1]).add) and key(shift.add) == key(torch.tensor([0]).add)
