"""transformers' hub kernels under cp_handler: the ``kernels`` library (``use_kernels``, on by default in
``from_pretrained`` since transformers 5.2x) runs its ``kernelize`` again at every ``train()`` / ``eval()`` and
replaces the forward of every layer it knows (RMSNorm, rotary embeddings, Qwen3.5's gated delta net, ...): by a hub
kernel on a GPU, by popping the instance's own forward elsewhere. A forward cp_handler installs on an instance (the
token mixers' routes, :mod:`.hf_mixers`; the deterministic mode's exact gradient sums, :mod:`.hf_exact_grads`) would
be dropped at the next mode switch (found 2026-12-06: the per-forward guard then stopped Qwen3.5 at its first
training step). :func:`reset_hub_kernels` turns them off through transformers' own setter and says so."""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def reset_hub_kernels(model: nn.Module, why: str) -> bool:
    """Turn ``model``'s hub kernels off (``model.use_kernels = False``: transformers' ``reset_kernels()``, the torch
    layers back; logged with ``why``). Returns whether they were on."""
    if not getattr(model, "use_kernels", False):
        return False
    model.use_kernels = False
    logger.warning("%s: its hub kernels are reset to the torch layers (%s)", type(model).__name__, why)
    return True
