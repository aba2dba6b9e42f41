"""A cache in a Hugging Face forward under a handler: refused by its type, whatever the argument is called.

Under context parallelism a model's own KV or state cache would hold this rank's shard of the keys and states
(and a decode step would attend to it alone): generation under CP is :mod:`cp_handler.inference` (a KV cache
sharded over the group, ``cp-generate``). transformers renames its cache arguments across releases
(``past_key_values``, ``past_key_value``, ``cache_params``; ``cache`` since 5.24), so the guard looks at values,
not names: any instance of ``transformers.cache_utils.Cache`` or of a class named ``*Cache`` (the Mamba caches of
earlier releases, which do not derive from it), and a legacy tuple under a known cache name. The bottom of the
integration beside :mod:`.hf_active`: it imports nothing of it.
"""

from __future__ import annotations

CACHE_NAMES = ("past_key_values", "past_key_value", "cache_params", "cache")
"""The names transformers has given its cache argument (a legacy tuple cache is recognised only by these)."""


def is_cache(value) -> bool:
    """Whether ``value`` is a cache object (module doc)."""
    if value is None:
        return False
    try:
        from transformers.cache_utils import Cache

        if isinstance(value, Cache):
            return True
    except ImportError:
        pass
    return any(cls.__name__.endswith("Cache") for cls in type(value).__mro__)


def refuse_cache(where: str, arguments: dict) -> None:
    """Raises ValueError naming the first of ``arguments`` (name -> value) that is a cache: a cache object under any
    name, or a non-empty value under one of :data:`CACHE_NAMES`."""
    for name, value in arguments.items():
        legacy = name in CACHE_NAMES and value is not None and not isinstance(value, bool) and \
            not (isinstance(value, (tuple, list)) and not value)
        if is_cache(value) or legacy:
            raise ValueError(f"{where}: {name} is a cache ({type(value).__name__}); a model's own cache is not "
                             "implemented under context parallelism (each rank would keep only its shard's keys and "
                             "states): pass use_cache=False and no cache when training; generate with "
                             "cp_handler.inference (cp-generate), whose KV cache is sharded over the CP group")
