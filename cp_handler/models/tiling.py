"""Token-wise work over chunks of a rank's tokens, each chunk recomputed in the backward, so that only one chunk's
intermediates exist at a time: the loss (:func:`~cp_handler.models.loss.token_loss_sum`) and the feed-forward blocks
(:func:`tile_mlps`: the tiled MLP of Arctic Long Sequence Training, ALST, Snowflake 2025, DeepSpeed's
``TiledMLP``).

A dense MLP acts on every token alone, so the chunks give the same values and gradients as the whole, up to the
matmuls' float rounding over fewer rows; what the backward keeps of an MLP shrinks from its input and intermediates
(``hidden + 4 x ffn`` values per token for SwiGLU: 122,880 bytes per token of a Llama-3-8B layer in bfloat16, more
than half the layer's; docs/performance.md) to its input, for one more forward of the MLP.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpointed_chunks(fn, chunk_tokens: int, *rows: torch.Tensor) -> list:
    """``fn`` on consecutive chunks of ``chunk_tokens`` rows (dim 0) of every tensor of ``rows``, each call's
    intermediates dropped and recomputed in the backward (non-reentrant ``torch.utils.checkpoint``; without
    gradients, plain calls). Returns the calls' outputs in order."""
    total = rows[0].shape[0]
    parts = [tuple(t[i:i + chunk_tokens] for t in rows) for i in range(0, total, chunk_tokens)]
    if not torch.is_grad_enabled():
        return [fn(*part) for part in parts]
    return [checkpoint(fn, *part, use_reentrant=False) for part in parts]


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The tiled MLP's forward (installed per instance): its class's forward over chunks of the flattened tokens."""
    flat = x.flatten(0, -2)
    out = torch.cat(checkpointed_chunks(type(self).forward.__get__(self), self._cp_chunk_tokens, flat))
    return out.view(*x.shape[:-1], out.shape[-1])


def _refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not a dense, token-wise MLP by its structure (``None``: it is)."""
    for child_name, child in module.named_children():
        if not isinstance(child, nn.Linear) and (any(True for _ in child.parameters()) or any(child.children())):
            return (f"its child {child_name!r} ({type(child).__name__}) is not an nn.Linear (only MLPs built of "
                    "nn.Linear layers and parameter-free activations act on every token alone; a mixture of "
                    "experts routes and balances over all tokens)")
    if not any(isinstance(child, nn.Linear) for child in module.children()):
        return "it has no nn.Linear layer"
    required = [p for p in inspect.signature(module.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) != 1:
        return f"its forward takes {len(required)} required arguments, not one tensor"
    return None


def _probe(name: str, module: nn.Module, chunk: int = 4) -> None:
    """On real weights, before tiling: the module on chunks of ``chunk`` tokens gives what it gives on all of them
    at once (a forward that mixes tokens differs)."""
    weight = next(module.parameters())
    if weight.device.type == "meta":
        return
    width = next(c for c in module.children() if isinstance(c, nn.Linear)).in_features
    x = torch.randn(3 * chunk, width, generator=torch.Generator().manual_seed(0)).to(weight)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            whole = module(x)
            tiled = torch.cat(checkpointed_chunks(module, chunk, x))  # no gradients: plain calls
    finally:
        module.train(was_training)
    tolerance = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 2e-2
    difference = (tiled - whole).abs().max().item()
    if not difference <= tolerance * whole.abs().max().item() + tolerance:
        raise ValueError(f"mlp_chunk_tokens: {name} ({type(module).__name__}) gives, on chunks of {chunk} tokens, "
                         f"another result than on all tokens at once (by {difference:.3g}): it mixes tokens; refused")


def tile_mlps(model: nn.Module, chunk_tokens: int) -> list[str]:
    """Run every feed-forward block of ``model`` (each module named ``mlp``) over chunks of ``chunk_tokens`` of the
    tokens it receives, each chunk recomputed in the backward (:func:`checkpointed_chunks`): at most one chunk's
    MLP intermediates exist at once. Per instance (the module's own ``forward``; parameters, state-dict keys and
    other models untouched); every one checked first, and probed once on real weights (chunks vs whole).

    Args:
        model: the reference GPT (dense layers), or a Hugging Face model (bare or in
            :class:`~cp_handler.integrations.transformers.CPCausalLM`).
        chunk_tokens: tokens per chunk (> 0), over every token of the call (``B x S_local``).

    Returns:
        The tiled modules' names.

    Raises:
        ValueError: ``chunk_tokens`` < 1; no module named ``mlp``; an ``mlp`` that is not built of ``nn.Linear``
            layers and parameter-free activations (a mixture of experts, GPT-2's ``Conv1D``), takes other than one
            tensor, or mixes tokens (the probe); each named, before any module is changed.
    """
    if chunk_tokens < 1:
        raise ValueError(f"mlp_chunk_tokens={chunk_tokens} must be >= 1")
    found = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]
    if not found:
        raise ValueError(f"mlp_chunk_tokens: {type(model).__name__} has no module named 'mlp' to tile")
    for name, module in found:
        reason = _refusal(module)
        if reason:
            raise ValueError(f"mlp_chunk_tokens: {name} ({type(module).__name__}) cannot be tiled: {reason}")
        _probe(name, module)
    for _, module in found:
        module._cp_chunk_tokens = chunk_tokens
        module.forward = types.MethodType(_tiled_forward, module)
    return [name for name, _ in found]
