"""The Hugging Face wing's plumbing (issue 51): how the handler reaches the attention function, how often a mask
is probed, and where hooks go.

* The handler travels in the forward's keyword arguments (``cp_handler``, its one channel) to the attention
  function; a model whose decoder layers drop them (StableLM) gets it from its mask; a forward without it raises.
* Each mask is classified once per forward and never from another forward's answer: two batches with the same
  layout whose masks read other contents are classified apart (the negative case), a global or an object's state
  changed between calls is read as it is now; past 4,096 positions the probe stays within its bound and still
  finds per-token data anywhere in the sequence.
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
from cp_handler.integrations.transformers import cp_model_inputs, register

WINDOW = 4  # read as a global by _global_window_mask


def _global_window_mask(batch_idx, head_idx, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (kv_idx > q_idx - WINDOW)


def _hooks(module):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def _handler():
    return get_cp_handler_cls("local", "p2p")(cp_group=None)


@pytest.fixture
def probes(monkeypatch):
    """How many times hf_mask.classify ran."""
    count = [0]
    classify = hf_mask.classify

    def counted(mask_function, n):
        count[0] += 1
        return classify(mask_function, n)

    monkeypatch.setattr(hf_mask, "classify", counted)
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
    """Given as the forward's keyword, the handler reaches the attention function in the forward's keyword
    arguments; StableLM's decoder layers drop them, its mask carries the handler. A forward without the keyword
    reaches no handler (no scope stands in for it) and raises."""
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
        assert seen == [source] * model.config.num_hidden_layers
        with pytest.raises(RuntimeError, match=r"needs a handler: pass cp_handler=handler"):
            model(tokens, **cp_model_inputs(handler, tokens))
    assert seen[model.config.num_hidden_layers:] == ["none"]


def test_each_forward_probes_its_mask_once(probes):
    model = build("llama", "sdpa")
    register(model)
    probes[0] = 0
    with torch.no_grad():
        for tokens in (64, 64, 96, 64):
            ids = torch.randint(0, 256, (1, tokens))
            handler = _handler()
            model(ids, **cp_model_inputs(handler, ids), cp_handler=handler)
    assert probes[0] == 4  # one causal mask per forward, classified once (memoised on the mask for every layer)


def _layer_mask(config, tokens: int, **mask_functions):
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config, torch.zeros(1, tokens, 8), None, None,
                              position_ids=torch.arange(tokens)[None], **mask_functions)


def test_the_same_layout_with_other_contents_is_classified_per_batch(probes):
    """The negative case: mask functions that read per-batch data (here a 1-D tensor of the keys a batch
    allows, and Llama 4's chunks after a left-padding tensor) built for batches of the same layout: each is
    classified on its own content."""
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
    assert keys_allowed(everything.clone()).spec(32).kind == "causal"
    assert probes[0] == 3
    chunks = [hf_mask.CPMask(chunked_causal_mask_function(8, torch.tensor([pad])), 0, 0, None).spec(32)
              for pad in (0, 3, 0)]
    assert chunks == [hf_mask.MaskSpec("chunked", 8), chunks[1], hf_mask.MaskSpec("chunked", 8)]
    assert chunks[1].kind == "unknown" and probes[0] == 6


def test_what_a_mask_reads_is_read_as_it_is_now(probes):
    """Nothing is cached across calls: a global, an object's state and a module's attributes changed between calls
    are what the next classification sees."""
    global WINDOW
    from transformers.masking_utils import and_masks, causal_mask_function

    assert hf_mask.classify(_global_window_mask, 32) == hf_mask.MaskSpec("sliding", 4)
    WINDOW = 6
    try:
        assert hf_mask.classify(_global_window_mask, 32) == hf_mask.MaskSpec("sliding", 6)
    finally:
        WINDOW = 4
    assert hf_mask.classify(_global_window_mask, 32) == hf_mask.MaskSpec("sliding", 4)

    class Window:
        size = 4

        def __call__(self, b, h, q, kv):
            return (kv <= q) & (kv > q - self.size)

    window, specs = Window(), []
    for size in (4, 4, 5):
        window.size = size
        specs.append(hf_mask.classify(window, 32))
    assert [s.size for s in specs] == [4, 4, 5]
    settings = types.ModuleType("settings")  # a module two composed functions read other attributes of
    settings.UNUSED, settings.LIMIT = 0, 3

    def first(b, h, q, kv):
        return kv >= settings.UNUSED

    def second(b, h, q, kv):
        return q - kv < settings.LIMIT

    both = and_masks(causal_mask_function, first, second)
    assert hf_mask.classify(both, 32) == hf_mask.MaskSpec("sliding", 3)
    settings.LIMIT = 5
    assert hf_mask.classify(both, 32) == hf_mask.MaskSpec("sliding", 5)


def test_a_long_mask_is_probed_within_its_bound_and_per_token_data_is_found_anywhere():
    """Past :data:`hf_mask.DENSE_QUERIES` positions: transformers' masks classified exactly, the evaluations within
    the module doc's bound (3 n + 400k for a function of positions alone, 14 n + 400k for one holding a tensor,
    counted here with a margin), and a 1-D tensor of per-token data that masks one key, or starts a document off
    the chunk grid, far from every sampled query, is found (the negative cases; documents on the grid are chunks)."""
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    n, evaluated = 10_000, [0]

    def counted(mask_function):
        def inner(b, h, q, kv):
            evaluated[0] += q.numel()
            return mask_function(b, h, q, kv)
        return inner

    for function, want, bound in (
            (causal_mask_function, hf_mask.MaskSpec("causal"), 3 * n + 450_000),
            (bidirectional_mask_function, hf_mask.MaskSpec("bidirectional"), 3 * n + 450_000),
            (sliding_window_causal_mask_function(4096), hf_mask.MaskSpec("sliding", 4096), 3 * n + 450_000),
            (chunked_causal_mask_function(3000, torch.tensor([0])), hf_mask.MaskSpec("chunked", 3000),
             14 * n + 450_000)):
        evaluated[0] = 0
        assert hf_mask.classify(counted(function), n) == want
        assert evaluated[0] <= bound, (want, evaluated[0])
    allowed = torch.ones(n, dtype=torch.bool)
    allowed[7001] = False
    spec = hf_mask.classify(lambda b, h, q, kv: (kv <= q) & allowed[kv], n)
    assert spec.kind == "unknown" and "query 7001 -> key 7001" in spec.reason, spec
    for third, want in ((6000, "chunked"), (7001, "unknown")):  # documents from 0, 3000, `third` and 9000
        document = sum((torch.arange(n) >= start).long() for start in (3000, third, 9000))
        spec = hf_mask.classify(and_masks(causal_mask_function, lambda b, h, q, kv, d=document: d[q] == d[kv]), n)
        assert spec.kind == want, (third, spec)
