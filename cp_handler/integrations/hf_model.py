"""The model half of the Hugging Face guard: a model is checked once and watched at every forward, so
that under a handler every token-mixing layer goes through CP, or the forward raises.

:func:`prepare_model` (called by ``register(model)`` and :class:`~.transformers.CPCausalLM`):

* **Token mixers other than attention** (:mod:`.hf_mixers`): every mixer whose forward calls a known kernel
  (gated delta rule, Mamba scans, causal convolutions) is routed to the handler's mixer methods, whatever its class
  or its source; then each routed mixer must give, on two documents packed in one sequence, what it gives on
  each alone (:func:`check_mixer_documents`): a mixer that mixes tokens outside the routed kernels is refused.
* **Static checks** (:func:`check_model`), before any forward: a convolution over the sequence outside a
  routed mixer (``nn.Conv1d`` with a kernel longer than 1) or a ``config.layer_types`` entry that is not an
  attention layer in a model without routed mixers is refused, naming the module or layer: such a mixer
  would see only this rank's shard.
* **Every forward** (two hooks on the model, public ``register_forward_pre_hook`` / ``register_forward_hook``
  APIs, no monkeypatching): the handler is taken from the ``cp_handler=`` keyword (its one channel: a forward
  without it runs no CP, and its attention raises), made the active handler for the forward (:mod:`.hf_active`,
  for the callbacks transformers makes without the keyword arguments), and kept in the forward's keyword
  arguments when the model's forward takes extra ones: transformers passes
  them on through the decoder layers to the attention function (every model of tests/test_hf_zoo.py that runs
  but StableLM and Nemotron, whose decoder layers drop them: their attention takes the handler of the forward
  that built its mask). The attention calls are recorded, and when the forward ends every decoder layer must
  have called cp_handler's attention (a layer that bypasses the attention registry, or a non-attention mixer
  missed by the static checks, raises naming the layers); under torch.compile the attention runs as one operator
  that records no layer: the layers recorded plus the handler's calls that were not recorded must then equal the
  layer count exactly (a model that runs some layers' attention twice and others not at all is refused).
* **Activation recomputation** (gradient checkpointing re-runs a decoder layer in the backward, after the
  forward and its active handler are gone): the recomputed layer gets its keyword arguments again, so its
  attention gets the ``cp_handler`` keyword (or its mask's handler) again: no hook on decoder layers or
  attention modules. A module that reads the active handler (a routed mixer, a rotary module) gets a pre / post
  hook pair on itself or the module around it that is given the forward's keyword arguments or mask
  (:func:`recompute_hosts`, :func:`_recompute_pre_hook`): a Llama-like model one pair on its base model (around
  the rotary module), a hybrid one pair per mixer, Moshi one per attention module (its rotary module is inside).
* **The route's inputs change nothing at cp=1** (:func:`check_route_inputs`, once, when the weights
  are real): the model run alone on 16 tokens gives the same logits with :func:`cp_model_inputs`
  (positions ``0..S-1``, an all-ones mask) as with its own defaults. A model that derives positions
  otherwise (RoBERTa's start after ``padding_idx``) would be silently wrong under CP: refused.
* **RoPE that reads the sequence length** (dynamic NTK, LongRoPE: ``max(position_ids) + 1``): each
  rotary-embedding module gets, for the forward, one extra position appended to ``position_ids``, the
  largest *global* position of the batch (the handler knows it), and its output row for that position
  dropped. Every rank then derives the same frequencies as one process over the whole sequence; the
  positions themselves are untouched, so every RoPE type stays exact, including ones added later.
  Under a handler with a KV cache (generation) a probe position is appended too: its rows must be those
  of every sequence alone (its own length; the pack's largest position would otherwise set every
  sequence's frequencies) and, at every decode step, those kept at the prefill (else the cached keys
  were rotated with other frequencies). :func:`~cp_handler.inference.generate` then prefills again, or
  runs the prompts one at a time.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

from ..handlers.base import ContextParallelHandler
from ..handlers.registry import build_cp_handler
from ..runtime.config import ContextParallelConfig
from .hf_active import ForwardRecord, active_handler, enter_forward, exit_forward, forward_state, handler_context
from .hf_attention import call_handler
from .hf_cache import refuse_cache
from .hf_inputs import cp_model_inputs, text_config
from .hf_loss_probe import check_model_loss
from .hf_loss_probe import record as record_loss
from .hf_mask import CPMask
from .hf_mixers import instrument_model, is_routed, uses_mixers
from .hf_rotary import install_rotary_hooks, is_rotary
from .hf_router_loss import prepare_router_loss
from .hf_vlm import is_vision_language, prepare_vision_language, vision_modules

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
"""``config.layer_types`` entries that are softmax attention (their CP goes through the handler)."""
MIXER_LAYER_TYPES = frozenset({"linear_attention", "mamba", "hybrid", "conv"})
"""``config.layer_types`` entries whose token mixers run through routed kernels (when the model has routed
mixers; the per-forward check holds every such layer to having run one)."""
LOG = logging.getLogger("cp_handler")
TOKENLESS_LAYER_TYPES = frozenset({"mlp", "moe"})
"""``config.layer_types`` entries without a token mixer (Nemotron-H's feed-forward blocks): nothing to route."""


def check_model(model: nn.Module) -> None:
    """The static checks of the module doc (after the mixers were routed).

    Raises:
        ValueError: naming the sequence convolution or the non-attention layer types.
    """
    routed = uses_mixers(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1 and not is_routed(module, model):
            raise ValueError(f"{type(model).__name__}: module {name!r} is a convolution over the sequence (kernel "
                             f"{module.kernel_size[0]}) outside a routed token mixer: under context parallelism it "
                             "would see only this rank's shard; refused (docs/hybrid.md lists the mixers that run)")
    allowed = ATTENTION_LAYER_TYPES | TOKENLESS_LAYER_TYPES | (MIXER_LAYER_TYPES if routed else frozenset())
    other = sorted({t for t in layer_types(model) if t not in allowed})
    if other:
        raise ValueError(f"{type(model).__name__}: config.layer_types has {other} layers: only softmax attention "
                         f"layers ({sorted(ATTENTION_LAYER_TYPES)}) and routed token mixers run context-parallel; a "
                         f"{other[0]} token mixer would see only this rank's shard")


def layer_types(model: nn.Module) -> list[str]:
    """The text config's ``layer_types`` (or ``layers_block_type``), ``[]`` without."""
    config = text_config(model)
    return list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])


def check_mixer_documents(model: nn.Module, tokens: int = 16, first: int = 7) -> None:
    """Each routed mixer, alone at cp=1 and in eval mode, gives on two documents packed in one sequence (thd)
    what it gives on each document alone: all its token mixing goes through the routed kernels (which keep
    documents apart and pass states between ranks). Skipped for weights on the ``meta`` device.

    Raises:
        ValueError: naming the mixer and the difference.
    """
    for name, mixer in model.named_modules():
        weight = next(mixer.parameters(), None)
        if not getattr(mixer, "_cp_mixer", False) or weight is None or weight.device.type == "meta":
            continue
        x = torch.randn(1, tokens, text_config(model).hidden_size, generator=torch.Generator().manual_seed(0))
        x = x.to(weight)
        packed, plain, was_training = _two_documents(tokens, first), build_cp_handler(ContextParallelConfig()), \
            mixer.training
        mixer.eval()
        try:
            with torch.no_grad():
                with handler_context(packed):
                    together = mixer(x)
                with handler_context(plain):
                    alone = torch.cat([mixer(x[:, :first]), mixer(x[:, first:])], dim=1)
        finally:
            mixer.train(was_training)
        together, alone = (t[0] if isinstance(t, tuple) else t for t in (together, alone))
        difference = (together - alone).abs().max().item()
        if not difference <= 1e-4 * alone.abs().max().item() + 1e-6:
            raise ValueError(f"{type(model).__name__}: token mixer {name!r} ({type(mixer).__name__}) gives, on two "
                             f"documents packed together, another result than on each alone (by {difference:.3g}): "
                             "it mixes tokens outside the kernels cp_handler routes; refused")


def check_route_inputs(model: nn.Module, tokens: int = 16, gap: int = 5) -> None:
    """At cp=1 (module doc): the model gives the same logits with :func:`cp_model_inputs` as with its
    own default positions (and the all-ones ``attention_mask`` a tokenizer gives: transformers 4.57
    re-derives a one-document mask from default positions otherwise), and other logits when the
    positions passed jump by ``gap`` halfway, as a zigzag shard's do (so it takes its positions from
    ``position_ids`` / ``cache_position``, which carry the global ones under CP; a uniform shift would
    not tell, RoPE being relative). Skipped for weights on the ``meta`` device.

    Raises:
        ValueError: naming which of the two failed and by how much.
    """
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return
    accepted = inspect.signature(model.forward).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        missing = [name for name in ("position_ids", "cache_position") if name not in accepted]
        if missing:
            raise ValueError(f"{type(model).__name__}.forward takes no {' / '.join(missing)}: the model derives "
                             "positions from its input's length, so a rank would use its shard's local positions; "
                             "the model is not supported under context parallelism")
    vocab = min(int(getattr(text_config(model), "vocab_size", 100) or 100), 100)
    ids = torch.randint(1, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(weight.device)
    handler, was_training = build_cp_handler(ContextParallelConfig()), model.training
    inputs = cp_model_inputs(handler, ids)
    jump = torch.arange(tokens, device=ids.device) >= tokens // 2
    shifted = {**inputs, "position_ids": inputs["position_ids"] + gap * jump,
               "cache_position": inputs["cache_position"] + gap * jump}
    model.eval()
    try:
        with torch.no_grad():
            own, routed, moved = (model(input_ids=ids, **kwargs, use_cache=False, cp_handler=handler).logits.float()
                                  for kwargs in ({"attention_mask": inputs["attention_mask"]}, inputs, shifted))
        ignores_positions = torch.equal(moved, routed) and not _takes_no_positions(model, ids)  # bitwise: no change
    finally:
        model.train(was_training)
    difference = (own - routed).abs().max().item()  # the same computation when the route is right: ~0
    if difference > 1e-4 * own.abs().max().item():
        raise ValueError(f"{type(model).__name__}: alone, its logits with cp_handler's inputs (positions 0..S-1, no "
                         f"padding) differ from its own defaults by {difference:.3g}: it derives positions or masks "
                         "from its inputs another way (e.g. RoBERTa's positions start after padding_idx), which a "
                         "sharded sequence cannot reproduce; the model is not supported under context parallelism")
    if ignores_positions:
        raise ValueError(f"{type(model).__name__}: its logits do not change when position_ids jump: it takes "
                         "positions from the input length (e.g. BART-style learned positions) rather than from "
                         "position_ids, so a rank would use its shard's local positions; the model is not supported "
                         "under context parallelism")


def _takes_no_positions(model: nn.Module, ids: torch.Tensor) -> bool:
    """Whether ``model`` (in eval mode, at cp=1) uses no positions at all (Mamba, Jamba: no RoPE): a second document
    packed after a first (thd, its positions restarting) gives the logits it gives alone. A model taking
    positions from its input's length sees the packed document's rows at their index and fails this."""
    if is_vision_language(model):  # it takes no packed documents (:mod:`.hf_vlm`): a model with RoPE is assumed
        return False
    first = ids.shape[1] // 2
    packed = _two_documents(ids.shape[1], first)
    alone, rest = build_cp_handler(ContextParallelConfig()), ids[:, first:]
    with torch.no_grad():
        together = model(input_ids=ids, **cp_model_inputs(packed, ids), use_cache=False,
                         cp_handler=packed).logits[:, first:]
        apart = model(input_ids=rest, **cp_model_inputs(alone, rest), use_cache=False, cp_handler=alone).logits
    return bool((together - apart).abs().max() <= 1e-4 * apart.abs().max())


def _two_documents(length: int, first: int) -> ContextParallelHandler:
    """A cp = 1 handler of two documents packed in ``length`` tokens, the first ``first`` long (the probes)."""
    return build_cp_handler(ContextParallelConfig(), qkv_format="thd",
                            cu_seqlens=torch.tensor([0, first, length], dtype=torch.int32))


def _recompute_pre_hook(module, args, kwargs, last: dict):
    """Activation recomputation (gradient checkpointing) re-runs a layer during the backward, outside the
    model's forward and its active handler. On a module that reads the active handler inside such a layer
    (:func:`recompute_hosts`), this makes one active for the module's call: the ``cp_handler`` keyword
    it was given, else the handler of the forward that built the :class:`~.hf_mask.CPMask` it was given,
    else (a hybrid's convolution or recurrent layers get no such mask) the handler of the model's last
    forward with gradients (``last``: one dict per model), the forward being recomputed unless two forwards
    with different handlers ran before one backward; never while a forward of the model runs (a forward
    without a handler stays without one)."""
    if active_handler() is not None:
        return None
    mask = next((v for v in (*args, *kwargs.values()) if isinstance(v, CPMask)), None)
    handler = call_handler(kwargs.get("cp_handler"), mask) or (None if last.get("running") else last.get("handler"))
    if handler is not None:
        module.__dict__.setdefault("_cp_recompute", []).append(enter_forward(handler=handler))
    return None


def _recompute_hook(module, args, kwargs, output):
    tokens = module.__dict__.get("_cp_recompute")
    if tokens:
        exit_forward(tokens.pop())
    return None


def _takes(module: nn.Module, name: str) -> bool:
    """Whether ``module.forward`` has a parameter ``name`` (``"**"``: takes extra keyword arguments)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD if name == "**" else p.name == name for p in parameters)


def recompute_hosts(model: nn.Module, skip: frozenset = frozenset()) -> list[nn.Module]:
    """The modules that get :func:`_recompute_pre_hook`: for every module that reads the active handler when
    it runs (a routed mixer, a rotary module), the innermost module from it up to, not including, the decoder
    layer holding it (a ``GradientCheckpointingLayer``: transformers 5 runs a layer's own hooks outside its
    recomputation) or the model that takes ``attention_mask`` (it is given the forward's
    :class:`~.hf_mask.CPMask` or ``cp_handler`` keyword), else the reader itself. So whatever recomputes a
    reader runs its host's hooks too. The attention function needs no host: it takes the handler from its
    ``cp_handler`` keyword or its mask."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    parents = {child: parent for parent in model.modules() for child in parent.children()}
    hosts = {}
    for reader in model.modules():
        if id(reader) in skip or not (getattr(reader, "_cp_mixer", False) or is_rotary(reader)):
            continue
        path = [reader]
        while path[-1] in parents and parents[path[-1]] is not model and \
                not isinstance(parents[path[-1]], GradientCheckpointingLayer):
            path.append(parents[path[-1]])
        host = next((m for m in path if _takes(m, "attention_mask")), reader)
        hosts[id(host)] = host
    return list(hosts.values())


def _model_pre_hook(model, args, kwargs, last: dict):
    """The forward's handler (module doc): the ``cp_handler`` keyword, its one channel; made active for the
    forward (the mask function, rotary hooks, mixer routes and router loss read it) and, when the model's
    forward takes extra keyword arguments, left in them: transformers passes them on through the decoder
    layers to the attention function (a recomputed layer gets them again). Under a handler a cache is refused by
    its type, whatever the argument's name (:mod:`.hf_cache`), as is ``use_cache=True``; without ``use_cache`` the
    forward gets ``use_cache=False`` (the config's default would build a cache of this rank's shard; said once per
    model, a warning of the ``cp_handler`` logger, when the config says ``use_cache=True``). At cp > 1,
    ``labels`` without ``shift_labels`` are refused (the model would shift its shard's labels), and so are labels
    given to a model whose own loss is not the token cross-entropy (:mod:`.hf_loss_probe`)."""
    handler = kwargs.pop("cp_handler", None)
    last["running"] = last.get("running", 0) + 1
    if handler is None:
        return args, kwargs
    refuse_cache(type(model).__name__, {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs})
    if kwargs.get("use_cache"):
        raise ValueError(f"{type(model).__name__}: use_cache=True under context parallelism: the model's own cache "
                         "would keep only this rank's shard; pass use_cache=False (generation: cp_handler.inference)")
    if handler.cp_size > 1 and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(f"{type(model).__name__}: labels without shift_labels under context parallelism: the model "
                         "would shift this rank's shard of the labels (its next tokens sit on other ranks); pass "
                         "shift_labels, shifted in global order before dispatch (and num_items_in_batch, the global "
                         "token count), or compute the loss from the logits (docs/huggingface.md)")
    if handler.cp_size > 1 and (kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None):
        check_model_loss(model, "a forward given labels returns it")
    if "use_cache" not in kwargs and model.__dict__.get("_cp_takes_use_cache"):
        kwargs["use_cache"] = False  # the config's default (use_cache=True) would build a cache of this rank's shard
        if getattr(text_config(model), "use_cache", False) and not model.__dict__.get("_cp_said_use_cache"):
            model._cp_said_use_cache = True
            LOG.warning("%s: its config says use_cache=True; its forwards under a handler run with use_cache=False "
                        "(a cache would hold this rank's shard; training needs none)", type(model).__name__)
    if model.__dict__.get("_cp_takes_kwargs"):
        kwargs["cp_handler"] = handler
    if torch.is_grad_enabled():
        last["handler"] = handler
    model._cp_tokens = (enter_forward(handler=handler, record=ForwardRecord()), handler, handler.attention_calls)
    return args, kwargs


def _model_hook(model, args, kwargs, output, last: dict):
    last["running"] -= 1
    tokens = model.__dict__.pop("_cp_tokens", None)
    if tokens is None:
        return None
    record = forward_state().record
    exit_forward(tokens[0])
    if output is None:  # the forward raised: its own error propagates
        return None
    model.__dict__["_cp_mask_types"] = dict(record.mask_types)
    seen = record.layers
    layers = text_config(model).num_hidden_layers - sum(t in TOKENLESS_LAYER_TYPES for t in layer_types(model))
    compiled = tokens[1].attention_calls - tokens[2] - record.core_attn_calls  # compiled layers' calls: not recorded
    if compiled and len(seen) + compiled != layers:
        raise ValueError(f"{type(model).__name__}: {compiled} attention calls ran compiled (torch.compile records no "
                         f"layer) beside {len(seen)} recorded layers, for {layers} layers: not one call per layer, so "
                         "whether every layer ran cp_handler's attention cannot be told; refused under torch.compile "
                         "(run it without compiling)")
    if not compiled and len(seen) < layers:
        missing = sorted(set(range(layers)) - seen) if all(isinstance(x, int) for x in seen) else \
            f"{layers - len(seen)} of them"
        raise ValueError(f"{type(model).__name__}: of its {layers} layers, {missing} did not run cp_handler's "
                         "attention in this forward: their token mixer (a layer outside transformers' attention "
                         "registry, or a non-attention mixer) saw only this rank's shard; the model is not "
                         "supported under context parallelism")
    if getattr(output, "aux_loss", None) is not None and not record.router_loss:
        raise ValueError(f"{type(model).__name__}: its forward returned an aux_loss that cp_handler did not compute "
                         "from the whole sequence (each rank's would come from its own shard); refused: turn it off "
                         "(output_router_logits=False; TRL: router_aux_loss_coef=0)")
    return None


def prepare_model(model: nn.Module) -> nn.Module:
    """Check ``model`` and install the forward hooks of the module doc (idempotent); returns it.

    Raises:
        ValueError: :func:`check_model`, :func:`check_route_inputs`, or the per-forward checks of
            the module doc failing on the cp=1 forward of :func:`check_route_inputs`.
    """
    if getattr(model, "_cp_handler_checked", False):
        return model
    instrument_model(model)
    check_model(model)
    prepare_router_loss(model)
    last = {}  # the handler of the model's last forward with gradients (recomputation of layers without a mask)
    handles = [model.register_forward_pre_hook(functools.partial(_model_pre_hook, last=last), with_kwargs=True),
               model.register_forward_hook(functools.partial(_model_hook, last=last), with_kwargs=True,
                                           always_call=True)]
    vision = frozenset()
    if is_vision_language(model):  # after the generic pre-hook: the forward's handler is active then
        vision = frozenset(vision_modules(model))
        handles += prepare_vision_language(model)
    handles += install_rotary_hooks(model, vision)
    for host in recompute_hosts(model, vision):  # before a rotary module's own pre-hook, when it is its host
        handles += [host.register_forward_pre_hook(functools.partial(_recompute_pre_hook, last=last),
                                                   with_kwargs=True, prepend=True),
                    host.register_forward_hook(_recompute_hook, with_kwargs=True, always_call=True)]
    model._cp_takes_kwargs = _takes(model, "**")
    model._cp_takes_use_cache = _takes(model, "use_cache") or model._cp_takes_kwargs
    for module in model.modules():
        module._cp_handler_prepared = True  # the attention function refuses modules of unchecked models
    try:
        check_mixer_documents(model)
        check_route_inputs(model)  # a forward at cp=1: also runs the per-forward checks once
        record_loss(model)  # what its own loss is, for the forwards given labels and the trainers
    except BaseException:
        for handle in handles:
            handle.remove()
        for module in model.modules():
            module.__dict__.pop("_cp_handler_prepared", None)
            module.__dict__.pop("_cp_name", None)
        raise
    model._cp_handler_checked = True
    return model
