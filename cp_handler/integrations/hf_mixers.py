"""Unmodified Hugging Face token mixers other than attention under CP: every kernel call of a mixer *instance*
goes to the active handler's mixer methods (:mod:`cp_handler.handlers.mixers`); transformers is not changed.

The hybrid mixers of transformers reach their sequence mixing through a few kernel functions (:data:`ROUTES`):
``causal_conv1d_fn`` (Qwen3-Next, Qwen3.5, Kimi Linear, LFM2, every Mamba), ``torch_chunk_gated_delta_rule``
/ ``chunk_kimi_delta_attention`` (gated delta rule), ``mamba2_chunk_scan`` (Mamba2 family),
``mamba_selective_scan`` (Mamba family). transformers 5 binds them as module globals: the instance gets a
``forward`` built from its class's own code with those names bound to routes (same bytecode and decorators, only
name resolution differs; other instances and other models are untouched). Earlier releases hold them as
instance attributes (``self.chunk_gated_delta_rule = ...``): those attributes are replaced on the instance (a
``causal_conv1d_fn`` attribute of ``None``, which makes such a forward call its ``nn.Conv1d`` module instead,
becomes the route of the plain convolution).

Under a handler a route calls the handler's method with the model's own kernel; the fused kernels
(``mamba2_split_conv1d_scan_combined``, ``mamba_inner_fn``) return ``None``, which sends the mixer down its unfused
path, and the decode-only kernels (a KV cache's single-token step) are refused. Without a handler every route is
the kernel itself. A mixer class whose forward calls a kernel name is routed only when its forward's source is the
one reviewed (:data:`REVIEWED`, a digest per class: a later transformers release that changes a mixer is refused
by name until someone checks it); :func:`check_split` then runs each routed mixer whole and as two halves whose
state passes between them, alone, before any training, so a mixer mixing tokens outside the routed kernels (an
inline shift, a convolution module) is refused by name.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
import types

from torch import nn

from ..handlers.base import ContextParallelHandler
from .hf_active import active_handler, record_attention_call

HARMLESS = ("position_ids", "cache_position", "use_cache", "output_router_logits", "position_embeddings",
            "shift_labels", "num_items_in_batch", "cp_handler")
"""Keywords a model forwards to a kernel that change nothing under the handler (its layout has the positions;
Zamba2's hybrid layers pass their rotary tables on to every kernel, which ignores them; the model-level
flags of the attention function's ``HARMLESS``, the loss's arguments Trainer passes down every layer, and the
handler itself, which the model's hook leaves in the forward's keyword arguments; a cache itself is refused as
``cache_params``)."""


def _split_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in HARMLESS}


def _conv(handler: ContextParallelHandler, kernel, *args, **kwargs):
    names = ("hidden_states", "weight", "bias", "activation")
    bound = dict(zip(names, args, strict=False))
    if "x" in kwargs:  # Dao's causal_conv1d_fn names its input x
        bound["hidden_states"] = kwargs.pop("x")
    bound.update({k: kwargs.pop(k) for k in names if k in kwargs})
    return handler.causal_conv1d(bound["hidden_states"], bound["weight"], bound.get("bias"), bound.get("activation"),
                                 conv_fn=kernel, **_split_kwargs(kwargs))


def _delta_rule(handler: ContextParallelHandler, kernel, query, key, value, g=None, beta=None, **kwargs):
    return handler.gated_delta_rule(query, key, value, g, beta, kernel=kernel, **_split_kwargs(kwargs)), None


def _ssd(handler: ContextParallelHandler, kernel, hidden_states, dt, A, B, C, chunk_size=None, **kwargs):
    return handler.ssd_scan(hidden_states, dt, A, B, C, chunk_size, kernel=kernel, **_split_kwargs(kwargs))


def _selective(handler: ContextParallelHandler, kernel, hidden_states, dt, A, B, C, **kwargs):
    return handler.selective_scan(hidden_states, dt, A, B, C, kernel=kernel, **_split_kwargs(kwargs))


ROUTES = {"causal_conv1d_fn": _conv, "torch_chunk_gated_delta_rule": _delta_rule,
          "chunk_gated_delta_rule": _delta_rule, "chunk_kimi_delta_attention": _delta_rule,
          "mamba2_chunk_scan": _ssd, "mamba_selective_scan": _selective}
"""Kernel name -> how its call reaches the handler (the kernel's own signature)."""
FUSED = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")
"""Fused training kernels: ``None`` under a handler (the mixer's unfused path; their torch stubs return it too)."""
DECODE = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention",
          "mamba2_selective_state_update", "mamba_selective_state_update", "fused_recurrent_gated_delta_rule")
"""Single-token decode kernels (a cache): refused under a handler."""
KERNELS = frozenset(ROUTES) | frozenset(FUSED) | frozenset(DECODE)

REVIEWED = {
    "BailingHybridDeltaAttention": "9259f51077b42ace",
    "BambaMixer": "5d05f582f3ab2c20",
    "FalconH1Mixer": "250b28b68b29c41b",
    "FalconMambaMixer": "b2b1a7f45e275722",
    "GraniteMoeHybridMambaLayer": "5d05f582f3ab2c20",
    "JambaMambaMixer": "9af852bfac6210a5",
    "KimiLinearDeltaAttention": "f30418641527c668",
    "Lfm2MoeShortConv": "dd7ac368ef34f5ab",
    "Lfm2ShortConv": "dd7ac368ef34f5ab",
    "Lfm3ShortConv": "dd7ac368ef34f5ab",
    "Mamba2Mixer": "5d05f582f3ab2c20",
    "MambaMixer": "586e7c7f3e9f31be",
    "NemotronHMamba2Mixer": "5d05f582f3ab2c20",
    "OlmoHybridGatedDeltaNet": "1c77261ce5e9e957",
    "Qwen3NextGatedDeltaNet": "a5c1b27444531b31",
    "Qwen3_5GatedDeltaNet": "e9febb8c7d8be936",
    "Qwen3_5MoeGatedDeltaNet": "e9febb8c7d8be936",
    "Qwen4ExpTextGatedDeltaNet": "e9febb8c7d8be936",
    "Zamba2MambaMixer": "5d05f582f3ab2c20",
    "ZambaMambaMixer": "8ca1f4de849653c7",
}
"""Mixer class -> the sha256 (first 16 hex digits) of its forward's source as reviewed (transformers 5.23.0)."""


def _unwrap(function):
    """The innermost function under ``functools.wraps`` decorators, and the decorators' wrappers outermost first."""
    chain = []
    while hasattr(function, "__wrapped__"):
        chain.append(function)
        function = function.__wrapped__
    return function, chain


def forward_digest(cls: type) -> str:
    """The digest :data:`REVIEWED` keeps: sha256 of the (unwrapped) forward's dedented source, 16 hex digits."""
    source = textwrap.dedent(inspect.getsource(_unwrap(cls.forward)[0]))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def kernel_names(module: nn.Module) -> set[str]:
    """The kernel names a module's forward calls, as module globals or instance attributes."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return set()
    names = set(_unwrap(forward)[0].__code__.co_names) & KERNELS
    return names | (set(vars(module)) & KERNELS)


def _route(module: nn.Module, name: str, kernel):
    """What the mixer calls under the name ``name``: ``kernel`` without a handler, its route with one."""
    def routed(*args, **kwargs):
        handler = active_handler()
        if handler is None:
            return kernel(*args, **kwargs)
        record_attention_call(module, "causal", core_attn=False)  # a recurrence or a causal convolution
        if name in FUSED:
            return None
        if name in DECODE:
            raise ValueError(f"{type(module).__name__}: {name} is a single-token decode step with a cache; a cache is "
                             "not supported under context parallelism (generation of hybrid models is not "
                             "implemented)")
        return ROUTES[name](handler, kernel, *args, **kwargs)

    routed.__name__ = f"cp_handler_{name}"
    return routed


def _rebuilt(function, globals_: dict):
    new = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__,
                             function.__closure__)
    new.__kwdefaults__ = function.__kwdefaults__
    new.__qualname__, new.__doc__ = function.__qualname__, function.__doc__
    return new


def instrument(module: nn.Module) -> bool:
    """Route ``module``'s kernel calls (module doc); ``False`` when its forward calls none.

    Raises:
        ValueError: a mixer class not in :data:`REVIEWED`, or whose forward's source changed since.
    """
    names = kernel_names(module)
    if not names:
        return False
    cls = type(module)
    digest = forward_digest(cls)
    if REVIEWED.get(cls.__name__) != digest:
        reason = "is not one cp_handler reviewed" if cls.__name__ not in REVIEWED else \
            f"has another forward than the one reviewed (source digest {digest})"
        raise ValueError(f"{cls.__module__}.{cls.__name__} ({sorted(names)}) {reason}: its token mixing under "
                         "context parallelism is unchecked; refused (docs/hybrid.md lists the mixers that run)")
    inner, chain = _unwrap(cls.forward)
    bound = {n: _route(module, n, inner.__globals__[n]) for n in names if n in inner.__code__.co_names}
    if bound:
        forward = _rebuilt(inner, {**inner.__globals__, **bound})
        for wrapper in reversed(chain):  # the decorators' closures around the rebuilt function
            cells = tuple(types.CellType(forward) if c.cell_contents is wrapper.__wrapped__ else c
                          for c in wrapper.__closure__ or ())
            inner_forward, forward = forward, types.FunctionType(wrapper.__code__, wrapper.__globals__,
                                                                 wrapper.__name__, wrapper.__defaults__, cells)
            forward.__wrapped__ = inner_forward  # as functools.wraps: the signature (attention_mask) stays visible
        module.forward = types.MethodType(forward, module)
    for name in set(vars(module)) & KERNELS:  # earlier releases: kernels as instance attributes
        kernel = vars(module)[name]
        if kernel is None and name == "causal_conv1d_fn":
            from ..ops.mixers.conv import depthwise_causal_conv1d as kernel
        setattr(module, name, _route(module, name, kernel) if kernel is not None else None)
    module._cp_mixer = True
    return True


def instrument_model(model: nn.Module) -> list[nn.Module]:
    """Route every mixer of ``model`` (idempotent); returns the routed mixers.

    Raises:
        ValueError: :func:`instrument`.
    """
    return [m for m in model.modules() if getattr(m, "_cp_mixer", False) or instrument(m)]


def is_routed(module: nn.Module, model: nn.Module) -> bool:
    """Whether ``module`` of ``model`` lies inside a routed mixer (its convolution's weight is used by a route)."""
    return any(getattr(m, "_cp_mixer", False) and any(c is module for c in m.modules()) for m in model.modules())


def uses_mixers(model: nn.Module) -> bool:
    """Whether ``model`` has routed mixers (generation refuses them)."""
    return any(getattr(m, "_cp_mixer", False) for m in model.modules())

