"""Per-block ``torch.compile`` (``cp-train --compile``): every transformer layer compiled in place, whole
(``fullgraph=True``), as torchtitan's ``--compile`` does. Under CP each layer's attention is one operator in its
graph (:mod:`cp_handler.handlers.opaque`); the embedding, the rotary table, the head and the loss stay eager, as
do the handler's per-batch layout work (dispatch, positions), so a handler built per batch recompiles nothing
while the shapes, the format, the comm type and the mask kind stay the same (docs/compile.md)."""

from __future__ import annotations

from torch import nn

from .fsdp import layer_modules


def compile_layers(model: nn.Module, backend: str = "inductor", fullgraph: bool = True) -> int:
    """Compile each of ``model``'s layers (:func:`~.fsdp.layer_modules`: the reference GPT's ``layers``, a
    Hugging Face model's decoder layers) in place with ``nn.Module.compile`` (parameter names unchanged);
    returns how many. Compilation happens at each layer's first call; with ``fullgraph=True`` a graph break
    there raises ``torch._dynamo.exc.Unsupported`` naming it."""
    layers = layer_modules(model)
    for layer in layers:
        layer.compile(backend=backend, fullgraph=fullgraph)
    return len(layers)
