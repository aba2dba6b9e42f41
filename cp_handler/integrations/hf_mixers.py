"""Unmodified Hugging Face token mixers other than attention under CP: every kernel call of a mixer *instance*
goes to the active handler's mixer methods (:mod:`cp_handler.handlers.mixers`); transformers is not changed.

The hybrid mixers of transformers reach their sequence mixing through a few kernel functions (:data:`ROUTES`):
``causal_conv1d_fn`` (Qwen3-Next, Qwen3.5, Kimi Linear, LFM2, every Mamba), ``torch_chunk_gated_delta_rule``
/ ``chunk_kimi_delta_attention`` (gated delta rule), ``mamba2_chunk_scan`` (Mamba2 family),
``mamba_selective_scan`` (Mamba family), which transformers binds as module globals, called from the mixer's
forward or (5.25) from helpers it calls (``causal_conv1d_forward``, ``mamba2_scan_forward``, ``mamba_scan_forward``).
The instance gets a ``forward`` built from its class's own code with those names bound to routes, and each helper
on the way a copy of its own code with its kernels bound to routes (same bytecode and decorators, only name
resolution differs; other instances, other models and transformers' modules are untouched).

Under a handler a route calls the handler's method with the model's own kernel; the fused kernels
(``mamba2_split_conv1d_scan_combined``, ``mamba_inner_fn``) return ``None``, which sends the mixer down its unfused
path, and the decode-only kernels (a KV cache's single-token step) are refused, as is a cache handed to a route
(by type, whatever the argument's name: ``cache_params`` before transformers 5.24, ``cache`` since). Without a
handler every route is the kernel itself. Which mixers run is decided by behaviour, not by their source or the
transformers release: every routed mixer must give, alone at cp = 1, on two documents packed in one sequence what
it gives on each alone (:func:`~.hf_model.check_mixer_documents`): a mixer that mixes tokens outside the routed
kernels (an inline shift, a convolution called as a module, a kernel this module does not know) is refused by
name before any training.
"""

from __future__ import annotations

import types

from torch import nn

from ..handlers.base import ContextParallelHandler
from .hf_active import active_handler, record_attention_call
from .hf_cache import refuse_cache
from .hf_kernels import reset_hub_kernels

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
HELPER_DEPTH = 2
"""How deep the routing follows transformers' helper functions from a mixer's forward to its kernels."""


def _unwrap(function):
    """The innermost function under ``functools.wraps`` decorators, and the decorators' wrappers outermost first."""
    chain = []
    while hasattr(function, "__wrapped__"):
        chain.append(function)
        function = function.__wrapped__
    return function, chain


def _python_function(value) -> types.FunctionType | None:
    """The Python function behind a module-level callable of transformers: a function (under its ``functools.wraps``
    decorators), or the function a hub-kernel wrapper module calls (transformers 5.25 wraps its kernel helpers in
    ``kernels``' ``Func`` modules, whose ``forward`` closes over ``func``); ``None`` for anything else."""
    if isinstance(value, types.FunctionType):
        function = _unwrap(value)[0]
    else:
        forward = getattr(type(value), "forward", None)
        cells = dict(zip(getattr(getattr(forward, "__code__", None), "co_freevars", ()),
                         getattr(forward, "__closure__", None) or (), strict=False))
        inner = cells.get("func")
        function = _unwrap(inner.cell_contents)[0] if inner is not None else None
    if not isinstance(function, types.FunctionType) or not function.__module__.startswith("transformers."):
        return None
    return function


def _global_names(code: types.CodeType) -> set[str]:
    """The global names a code object and the code nested in it (comprehensions, lambdas) load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _routes_of(module: nn.Module, function: types.FunctionType, depth: int = HELPER_DEPTH) -> dict:
    """Name -> route for every kernel ``function`` calls through a module global, and for every transformers helper
    it calls that reaches one within ``depth`` calls (transformers 5.25's ``causal_conv1d_forward``,
    ``mamba2_scan_forward``, ``mamba_scan_forward``: the kernels sit in the helper, not in the mixer's forward)."""
    routes = {}
    for name in _global_names(function.__code__) & set(function.__globals__):
        value = function.__globals__[name]
        if name in KERNELS:
            routes[name] = _route(module, name, value)
        elif depth and (helper := _python_function(value)) is not None:
            inner = _routes_of(module, helper, depth - 1)
            if inner:
                routes[name] = _helper_route(module, name, value, _rebuilt(helper, {**helper.__globals__, **inner}))
    return routes


def kernel_names(module: nn.Module) -> set[str]:
    """The kernel and helper names a module's forward reaches kernels through (empty: not a mixer)."""
    forward = getattr(type(module), "forward", None)
    return set() if forward is None else set(_routes_of(module, _unwrap(forward)[0]))


def _helper_route(module: nn.Module, name: str, helper, routed_helper):
    """What the mixer calls under the helper's name: the helper itself without a handler (a hub kernel that
    ``kernelize`` swapped in included), its copy with the kernels routed with one."""
    def routed(*args, **kwargs):
        if active_handler() is None:
            return helper(*args, **kwargs)
        refuse_cache(f"{type(module).__name__}: {name}", {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs})
        return routed_helper(*args, **kwargs)

    routed.__name__ = f"cp_handler_{name}"
    return routed


def _route(module: nn.Module, name: str, kernel):
    """What the mixer calls under the name ``name``: ``kernel`` without a handler, its route with one."""
    def routed(*args, **kwargs):
        handler = active_handler()
        if handler is None:
            return kernel(*args, **kwargs)
        record_attention_call(module, "causal", core_attn=False)  # a recurrence or a causal convolution
        if name in FUSED:
            return None
        refuse_cache(f"{type(module).__name__}: {name}", {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs})
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


def _routed_forward(module: nn.Module):
    """``module``'s class forward with its kernel calls routed (module doc), or ``None`` when it reaches none."""
    inner, chain = _unwrap(type(module).forward) if hasattr(type(module), "forward") else (None, [])
    routes = _routes_of(module, inner) if isinstance(inner, types.FunctionType) else {}
    if not routes:
        return None
    forward = _rebuilt(inner, {**inner.__globals__, **routes})
    for wrapper in reversed(chain):  # the decorators' closures around the rebuilt function
        cells = tuple(types.CellType(forward) if c.cell_contents is wrapper.__wrapped__ else c
                      for c in wrapper.__closure__ or ())
        inner_forward, forward = forward, types.FunctionType(wrapper.__code__, wrapper.__globals__,
                                                             wrapper.__name__, wrapper.__defaults__, cells)
        forward.__wrapped__ = inner_forward  # as functools.wraps: the signature (attention_mask) stays visible
    return forward


def instrument_model(model: nn.Module) -> list[nn.Module]:
    """Route every mixer of ``model`` (idempotent); returns the routed mixers. Whether a routed mixer is exact is the
    probe's to decide (:func:`~.hf_model.check_mixer_documents`).

    A model with routed mixers has its hub kernels reset first (:func:`~.hf_kernels.reset_hub_kernels`: their
    ``kernelize`` would drop the routes at the next ``train()`` / ``eval()`` and leave the mixer on this rank's shard
    alone).
    """
    routed = {m: f for m in model.modules() if not getattr(m, "_cp_mixer", False) and (f := _routed_forward(m))}
    if routed:
        reset_hub_kernels(model, "kernelize would drop the token mixers' routes at every train() / eval()")
    for module, forward in routed.items():
        module.forward = types.MethodType(forward, module)
        module._cp_mixer = True
    return [m for m in model.modules() if getattr(m, "_cp_mixer", False)]


def is_routed(module: nn.Module, model: nn.Module) -> bool:
    """Whether ``module`` of ``model`` lies inside a routed mixer (its convolution's weight is used by a route)."""
    return any(getattr(m, "_cp_mixer", False) and any(c is module for c in m.modules()) for m in model.modules())


def uses_mixers(model: nn.Module) -> bool:
    """Whether ``model`` has routed mixers (generation refuses them)."""
    return any(getattr(m, "_cp_mixer", False) for m in model.modules())

