"""Reference models: single-device code that is context-parallel through a handler argument."""

from .gpt import GPTConfig, GPTModel

__all__ = ["GPTConfig", "GPTModel"]
