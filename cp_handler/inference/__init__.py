"""Long-context inference under CP: a KV cache sharded over the CP group, prefill and decode through the
handler contract (docs/inference.md).

Layer 6 (model-facing, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from .cache import KVCache
from .decode import DecodeHandler
from .generate import Generation, check_prompts, compare_generations, generate, reference_generate
from .sampling import Sampling

__all__ = ["DecodeHandler", "Generation", "KVCache", "Sampling", "check_prompts", "compare_generations", "generate",
           "reference_generate"]
