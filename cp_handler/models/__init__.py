"""Reference models: single-device code that is context-parallel through a handler argument.

Layer 6 (model-facing, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from .gpt import GPTConfig, GPTModel

__all__ = ["GPTConfig", "GPTModel"]
