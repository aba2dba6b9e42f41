"""``core_attn`` as one operator to torch.compile: Dynamo traces the model around it, never into it.

Under ``torch.compile`` a handler's ``core_attn`` (:meth:`~.base.ContextParallelHandler.core_attn`) calls
:func:`opaque_core_attn` instead of running: one ``torch.library`` custom operator, ``cp_handler::core_attn``,
with a fake implementation (the output's shape: q's with the values' head dim) and a registered autograd formula
(``cp_handler::core_attn_backward``). Dynamo, AOTAutograd and Inductor see one node; its implementation runs the
handler's eager ``core_attn`` (guard, pre-flight, the ranks' agreement, the backend's ``attend`` with its
collectives and kernels), outside the graph, at run time. So every backend that implements ``attend`` compiles
whole (``fullgraph=True``) with no work of its own, and what it checks it still checks, by name, at run time.

What the graph holds of a call, and so what Dynamo guards on (a new handler per batch recompiles nothing when
these are equal):

* q, k, v and ``attn_mod.sinks`` (tensors: guarded on shape, dtype, device and strides, as every graph input);
* ``handler.compile_handle``: an int64 tensor of one element naming the handler in a table of live handlers
  (guarded like any tensor, so not on the handler's identity);
* ``attn_mask_type`` and the variant attributes of ``attn_mod`` as one string (``softmax_scale``,
  ``window_size``, ``attention_chunk_size``, ``softcap``, the aliases :data:`~.checks.VARIANT_ALIASES` refuses,
  and ``layer_number`` only when the handler's ``cp_comm_type`` is a per-layer list: a graph per comm type);
* the handler's class, ``qkv_format`` and ``cp_comm_type`` (read by the traced branch).

The backward: the implementation runs the eager call with autograd on (inputs detached, as leaves) and keeps
its autograd graph until the backward operator runs ``torch.autograd.grad`` on it. The graph is held by the
storage of a one-element "token" tensor that the forward returns and AOTAutograd saves for the backward: when
that storage is freed (after the backward, or when the autograd graph is dropped, or when activation
checkpointing discards it and recomputes the forward), so is the eager graph. Nothing is recomputed and nothing
is saved twice: the eager graph holds what the algorithm saves (q, k, v, out, lse), as in eager mode.

Not opaque (``handler.opaque_under_compile`` false): a backend whose ``attend`` reads more of ``attn_mod`` than
its variant attributes (Transformer Engine's registers a child module on it), and a local handler filling a KV
cache (it stores per ``layer_number``). Their ``core_attn`` is traced as in eager mode (graph breaks, same
results). The ranks' agreement under compile is keyed by the call's index in the handler, not the layer
(the layer number is not in the graph): one small all-gather per attention call, not per layer.
"""

from __future__ import annotations

import contextlib
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


def _numbers(value, pair: bool) -> list | None:
    items = value if pair and isinstance(value, (tuple, list)) and len(value) == 2 else None if pair else (value,)
    if items is None or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
        return None
    return list(items)


def variant_args(handler, attn_mod) -> tuple[str, list] | None:
    """The variant of ``attn_mod`` as the graph holds it (module doc): the names of the numeric attributes set
    (a constant) and their values (a float64 tensor input, so a value is not guarded on: layers with other
    windows or scales share a graph); ``None`` when an attribute is set to anything else, or an alias of another
    library is set (the eager call then raises its error by name)."""
    if any(getattr(attn_mod, alias, None) is not None for alias in VARIANT_ALIASES):
        return None
    names, values = [], []
    for name in VARIANT_NUMBERS:
        if name == "layer_number" and not handler.layer_in_compiled_calls:
            continue
        value = getattr(attn_mod, name, None)
        if value is None:
            continue
        numbers = _numbers(value, pair=name == "window_size")
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
        raise RuntimeError("cp_handler::core_attn: the handler of this compiled call no longer exists (a graph "
                           "called with a handle tensor of a handler that was freed)")
    return handler


@torch.library.custom_op("cp_handler::core_attn", mutates_args=())
def _core_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, handle: torch.Tensor,
               values: torch.Tensor, names: str, attn_mask_type: str, needs_grad: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    handler = _handler(handle)
    if not needs_grad:
        with torch.no_grad():
            out = handler.core_attn(OpaqueAttnModule(names, values, sinks), q, k, v, attn_mask_type=attn_mask_type)
        return _unaliased([out], (q, k, v, sinks))[0], _token(None)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sinks_leaf = None if sinks is None else sinks.detach().requires_grad_()
    with autograd_recording():
        out = handler.core_attn(OpaqueAttnModule(names, values, sinks_leaf), *leaves,
                                attn_mask_type=attn_mask_type)
    inputs = (*leaves, *(() if sinks_leaf is None else (sinks_leaf,)))
    return _unaliased([out.detach()], (q, k, v, sinks))[0], _token((out, inputs))


@_core_attn.register_fake
def _(q, k, v, sinks, handle, values, names, attn_mask_type, needs_grad):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("cp_handler::core_attn_backward", mutates_args=())
def _core_attn_backward(dout: torch.Tensor, token: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        sinks: torch.Tensor | None) -> list[torch.Tensor]:
    graph = _graphs.get(int(token.item()))
    if graph is None:
        raise RuntimeError("cp_handler::core_attn_backward: the forward of this call kept no autograd graph (it ran "
                           "without grad, or its backward already ran: backward through a graph twice needs "
                           "retain_graph, which the compiled attention does not keep)")
    out, inputs = graph
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    return _unaliased([torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)],
                      (dout, token, q, k, v, sinks))


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


@_core_attn_backward.register_fake
def _(dout, token, q, k, v, sinks):
    return [t.new_empty(t.shape) for t in (q, k, v, *(() if sinks is None else (sinks,)))]


def _setup_context(ctx, inputs, output):
    q, k, v, sinks = inputs[:4]
    ctx.save_for_backward(output[1], q, k, v, sinks)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dtoken):
    token, q, k, v, sinks = ctx.saved_tensors
    grads = _core_attn_backward(dout.contiguous(), token, q, k, v, sinks)
    return grads[0], grads[1], grads[2], (grads[3] if sinks is not None else None), None, None, None, None, None


_core_attn.register_autograd(_backward, setup_context=_setup_context)


def opaque_core_attn(handler, attn_mod, q, k, v, attn_mask_type: str, variant: tuple[str, list]) -> torch.Tensor:
    """``handler.core_attn(attn_mod, q, k, v)`` as the operator (under torch.compile; ``variant`` from
    :func:`variant_args`)."""
    sinks = getattr(attn_mod, "sinks", None)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    names, values = variant
    return _core_attn(q, k, v, sinks, handler.compile_handle, torch.tensor(values, dtype=torch.float64), names,
                      attn_mask_type, needs_grad)[0]
