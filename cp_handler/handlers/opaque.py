"""A handler's calls as one operator to torch.compile: Dynamo traces the model around them, never into them.

Under ``torch.compile`` a handler's ``core_attn`` (:meth:`~.base.ContextParallelHandler.core_attn`), and its
``causal_conv1d`` / ``gated_delta_rule`` with their default kernels, call :func:`opaque_call` instead of running:
one ``torch.library`` custom operator, ``cp_handler::handler_call``, with a fake implementation (the output's shape
from the inputs': :data:`CALLS`) and a registered autograd formula (``cp_handler::handler_call_backward``).
Dynamo, AOTAutograd and Inductor see one node; its implementation runs the handler's eager method (guard,
pre-flight, the ranks' agreement, the backend's ``attend`` or the mixer with its collectives and kernels), outside
the graph, at run time. So every backend that implements ``attend`` compiles whole (``fullgraph=True``) with no
work of its own, and what it checks it still checks, by name, at run time.

What the graph holds of a call, and so what Dynamo guards on (a new handler per batch recompiles nothing when
these are equal):

* the tensors (q, k, v and ``attn_mod.sinks``; a mixer's inputs): guarded on shape, dtype, device and strides, as
  every graph input;
* ``handler.compile_handle``: an int64 tensor of one element naming the handler in a table of live handlers
  (guarded like any tensor, so not on the handler's identity);
* a string of the call's literal options: the method, ``attn_mask_type`` and the names of the variant attributes
  of ``attn_mod`` that are set (``softmax_scale``, ``window_size``, ``attention_chunk_size``, ``softcap``, and
  ``layer_number`` when the handler needs it: :attr:`~.base.ContextParallelHandler.layer_in_compiled_calls`), a
  mixer's activation and keyword arguments; the variants' values travel as a float64 tensor (not guarded on);
* the handler's class, ``qkv_format``, ``cp_comm_type`` and ``layer_in_compiled_calls`` (read by the traced
  branch).

The backward: the implementation runs the eager call with autograd on (inputs detached, as leaves) and keeps
its autograd graph until the backward operator runs ``torch.autograd.grad`` on it. The graph is held by the
storage of a one-element "token" tensor that the forward returns and AOTAutograd saves for the backward: when
that storage is freed (after the backward, or when the autograd graph is dropped, or when activation
checkpointing discards it and recomputes the forward), so is the eager graph. Nothing is recomputed and nothing
is saved twice: the eager graph holds what the algorithm saves (q, k, v, out, lse), as in eager mode.

Traced as in eager mode instead (graph breaks, same results): a backend whose ``attend`` reads more of
``attn_mod`` than its variant attributes (``opaque_under_compile = False``: Transformer Engine's registers a child
module on it), an attribute that is not a number (the eager call raises its error by name), a mixer given its own
kernel (a callable cannot be an operator's argument), ``ssd_scan`` and ``selective_scan`` (they always take one).
Without ``layer_number`` the ranks' agreement of a compiled call is keyed by the call's index in the handler, not
the layer: one small all-gather per attention call (eager: per layer). docs/compile.md.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import weakref

import torch

from .checks import VARIANT_ALIASES

VARIANT_NUMBERS = {"softmax_scale": float, "window_size": int, "attention_chunk_size": int, "softcap": float,
                   "layer_number": int}
"""The numeric attributes of ``attn_mod`` the pre-flight reads (besides ``sinks``, a tensor input), with their
type; ``window_size`` is a pair."""

_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_graphs: dict[int, tuple] = {}
_ids = itertools.count(1)


def compile_handle(handler) -> torch.Tensor:
    """The int64 ``(1,)`` CPU tensor that names ``handler`` to the operator (built once per handler)."""
    key = next(_ids)
    _live[key] = handler
    return torch.tensor([key], dtype=torch.int64)


class _TokenBuffer(bytearray):
    """The memory of a token tensor; when its storage is freed, the eager graph it names is dropped."""


def _token(graph: tuple | None) -> torch.Tensor:
    key = next(_ids)
    buffer = _TokenBuffer(key.to_bytes(8, "little"))
    if graph is not None:
        _graphs[key] = graph
        weakref.finalize(buffer, _graphs.pop, key, None)
    return torch.frombuffer(buffer, dtype=torch.int64)


class OpaqueAttnModule:
    """What the operator's implementation passes its handler as ``attn_mod``: the variant attributes of the
    module the model passed, read when the graph ran, and ``sinks``."""

    def __init__(self, names: str, values: torch.Tensor, sinks: torch.Tensor | None):
        numbers = iter(values.tolist())
        for name in names.split(",") if names else ():
            kind = VARIANT_NUMBERS[name]
            value = (kind(next(numbers)), kind(next(numbers))) if name == "window_size" else kind(next(numbers))
            setattr(self, name, value)
        self.sinks = sinks


def is_literal(value) -> bool:
    """Whether ``value`` survives ``repr`` / ``ast.literal_eval`` as itself (None, bool, int, float, str, and
    tuples / lists / str-keyed dicts of them): what the operator's ``options`` may hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_literal(v) for k, v in value.items())
    return isinstance(value, (tuple, list)) and all(is_literal(v) for v in value)


def _numbers(value, kind: type, pair: bool) -> list | None:
    """``value`` as the operator's numbers: ints for an int attribute (a float window would otherwise be cut to an
    int; the eager call refuses it by name), ints or floats for a float one, a pair for ``window_size``; ``None`` for
    anything else."""
    if pair and not (isinstance(value, (tuple, list)) and len(value) == 2):
        return None
    items = list(value) if pair else [value]
    allowed = (int,) if kind is int else (int, float)
    if not all(isinstance(x, allowed) and not isinstance(x, bool) for x in items):
        return None
    return items


def variant_args(handler, attn_mod) -> tuple[str, list] | None:
    """The variant of ``attn_mod`` as the graph holds it (module doc): the names of the numeric attributes set
    (a constant) and their values (a float64 tensor input, so a value is not guarded on: layers with other
    windows or scales share a graph); ``None`` when an attribute is set to anything else (``sinks`` to anything but a
    tensor), or an alias of another library is set (the eager call then raises its error by name)."""
    if any(getattr(attn_mod, alias, None) is not None for alias in VARIANT_ALIASES):
        return None
    sinks = getattr(attn_mod, "sinks", None)
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        return None
    names, values = [], []
    for name in VARIANT_NUMBERS:
        if name == "layer_number" and not handler.layer_in_compiled_calls:
            continue
        value = getattr(attn_mod, name, None)
        if value is None:
            continue
        numbers = _numbers(value, VARIANT_NUMBERS[name], pair=name == "window_size")
        if numbers is None:
            return None
        names.append(name)
        values += numbers
    return ",".join(names), values


@contextlib.contextmanager
def autograd_recording():
    """A context where autograd records again inside an operator's implementation (the dispatcher runs it with
    the autograd keys excluded and grad mode off): the eager call builds the graph the backward operator runs."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    include = torch._C._dispatch_tls_local_include_set().remove(keys.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _handler(handle: torch.Tensor):
    handler = _live.get(int(handle.item()))
    if handler is None:
        raise RuntimeError("cp_handler::handler_call: the handler of this compiled call no longer exists (a graph "
                           "called with a handle tensor of a handler that was freed)")
    return handler


def _core_attn_call(handler, inputs, options: dict) -> torch.Tensor:
    q, k, v, sinks, values = inputs
    return handler.core_attn(OpaqueAttnModule(options["names"], values, sinks), q, k, v,
                             attn_mask_type=options["attn_mask_type"])


def _conv_call(handler, inputs, options: dict) -> torch.Tensor:
    x, weight, bias = inputs
    return handler.causal_conv1d(x, weight, bias, options["activation"], **options["kwargs"])


def _delta_rule_call(handler, inputs, options: dict) -> torch.Tensor:
    return handler.gated_delta_rule(*inputs, **options["kwargs"])


CALLS = {"core_attn": (_core_attn_call, lambda q, k, v, *_: (*q[:-1], v[-1])),
         "causal_conv1d": (_conv_call, lambda x, *_: x),
         "gated_delta_rule": (_delta_rule_call, lambda q, k, v, *_: v)}
"""The handler methods the operator runs: method -> (the call of its eager method on the operator's inputs, the
output's shape from the inputs' shapes, ``None`` for an absent input)."""


@functools.lru_cache(maxsize=256)
def _options(text: str) -> dict:
    return ast.literal_eval(text)


def _with_absent(inputs: list, options: dict) -> list:
    """The method's inputs with ``None`` back at the positions ``options["absent"]`` names (an operator's list of
    tensors cannot hold ``None`` and stay differentiable)."""
    inputs = list(inputs)
    for i in options["absent"]:
        inputs.insert(i, None)
    return inputs


@torch.library.custom_op("cp_handler::handler_call", mutates_args=())
def _handler_call(inputs: list[torch.Tensor], handle: torch.Tensor, method: str, options: str,
                  needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    handler, (call, _), parsed = _handler(handle), CALLS[method], _options(options)
    if not needs_grad:
        with torch.no_grad():
            out = call(handler, _with_absent(inputs, parsed), parsed)
        return _unaliased([out], inputs)[0], _token(None)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with autograd_recording():
        out = call(handler, _with_absent(leaves, parsed), parsed)
    graph = (out, [t for t in leaves if t.requires_grad])
    return _unaliased([out.detach()], inputs)[0], _token(graph)


@_handler_call.register_fake
def _(inputs, handle, method, options, needs_grad):
    shape = CALLS[method][1](*_with_absent([t.shape for t in inputs], _options(options)))
    return inputs[0].new_empty(shape), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("cp_handler::handler_call_backward", mutates_args=())
def _handler_call_backward(dout: torch.Tensor, token: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``inputs`` (the forward's floating-point inputs, in order)."""
    graph = _graphs.get(int(token.item()))
    if graph is None:
        raise RuntimeError("cp_handler::handler_call_backward: the forward of this call kept no autograd graph (it "
                           "ran without grad, or its backward already ran: backward through a graph twice needs "
                           "retain_graph, which the compiled call does not keep)")
    out, leaves = graph
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return _unaliased([torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)],
                      [dout, token, *inputs])


@_handler_call_backward.register_fake
def _(dout, token, inputs):
    return [t.new_empty(t.shape) for t in inputs]


def _unaliased(outputs: list[torch.Tensor], inputs) -> list[torch.Tensor]:
    """``outputs`` contiguous, with a copy of each one that shares memory with an input or an earlier output (an
    operator's outputs may not alias; the algorithms return dK and dV as views of one buffer)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    result = []
    for t in outputs:
        t = t.contiguous()  # the fake implementations return contiguous tensors
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        result.append(t)
    return result


def _setup_context(ctx, inputs, output):
    tensors = inputs[0]
    ctx.differentiable = [t.is_floating_point() for t in tensors]
    ctx.save_for_backward(output[1], *(t for t, d in zip(tensors, ctx.differentiable, strict=True) if d))
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dtoken):
    token, *inputs = ctx.saved_tensors
    grads = iter(_handler_call_backward(dout.contiguous(), token, inputs))
    return [next(grads) if d else None for d in ctx.differentiable], None, None, None, None


_handler_call.register_autograd(_backward, setup_context=_setup_context)


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def opaque_call(handler, method: str, inputs: list, options: dict) -> torch.Tensor:
    """``handler.<method>`` of :data:`CALLS` on ``inputs`` as the operator (under torch.compile); ``options``: the
    method's other arguments, literals only (:func:`is_literal`)."""
    present = [t for t in inputs if t is not None]
    options = {**options, "absent": [i for i, t in enumerate(inputs) if t is None]}
    return _handler_call(present, handler.compile_handle, method, repr(options), _needs_grad(present))[0]


def opaque_core_attn(handler, attn_mod, q, k, v, attn_mask_type: str, variant: tuple[str, list]) -> torch.Tensor:
    """``handler.core_attn(attn_mod, q, k, v)`` as the operator (under torch.compile; ``variant`` from
    :func:`variant_args`)."""
    names, values = variant
    inputs = [q, k, v, getattr(attn_mod, "sinks", None), torch.tensor(values, dtype=torch.float64)]
    return opaque_call(handler, "core_attn", inputs, {"names": names, "attn_mask_type": attn_mask_type})
