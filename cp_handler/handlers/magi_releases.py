"""MagiAttention's per-release rules: which releases the handler accepts, and why the others are refused.

Read in SandAI-org/MagiAttention, ``magi_attention/api/magi_attn_interface.py`` and ``api/functools.py`` of tags
v1.0.4, v1.0.5, v1.1.0, v1.1.1 and main at 2c641357 (2026-05-28); the functions the handler calls
(``magi_attn_varlen_key``, ``dispatch``, ``undispatch``, ``calc_attn``, ``get_position_ids``, ``roll``,
``compute_pad_size``) are also unchanged on main at 872717e (2026-07-21, the newest snapshot reached, a fork's
mirror of main) but for an optional ``head_dim_v`` on the key. Releases 1.1.2 to 1.1.8 (v1.1.8: 2026-11-07,
https://github.com/SandAI-org/MagiAttention/releases/tag/v1.1.8) were not reached in source, and the v1.1.8 notes
(DSA kernels, learnable sinks in the CuTeDSL backend, overlap scheduling) do not say whether that API kept its
arguments: they stay refused, named (:data:`UNVERIFIED_AFTER`), until someone reads them.
"""

from __future__ import annotations

import inspect

from .requirements import release

SUPPORTED_RELEASES = ((1, 0, 4), (1, 1, 1))
"""First and last MagiAttention release this handler was checked against (inclusive)."""
UNVERIFIED_AFTER = ("1.1.2 to 1.1.8 (latest, 2026-11-07): their magi_attention.api (magi_attn_varlen_key, dispatch, "
                    "undispatch, calc_attn, get_position_ids, roll) was not read; sources reached end at main "
                    "872717e, 2026-07-21")
"""What a release newer than the supported range is refused for."""


def magi_release(package, api) -> tuple[int, ...]:
    """The installed release: ``magi_attention.__version__`` (leading integers), or, for a source
    build without a version, the release whose API the key function has."""
    version = getattr(package, "__version__", None)
    if version:
        return release(version)
    params = inspect.signature(api.magi_attn_varlen_key).parameters
    if "x" in params:
        return (1, 0, 0)
    if "num_heads_q" not in params:
        return (1, 0, 4) if "softmax_scale" in inspect.signature(api.calc_attn).parameters else (1, 0, 3)
    return (1, 1, 0) if params["chunk_size"].default is inspect.Parameter.empty else (1, 1, 1)


def check_release(package, api) -> tuple[int, ...]:
    """Raises RuntimeError naming the installed release and the supported range when outside it (and, above
    it, what is unverified)."""
    found = magi_release(package, api)
    low, high = SUPPORTED_RELEASES
    if not low <= found[:3] <= high:
        newer = f"; newer releases are refused as unverified: {UNVERIFIED_AFTER}" if found[:3] > high else ""
        raise RuntimeError(
            f"magi_attention {getattr(package, '__version__', None) or '.'.join(map(str, found))} is installed; "
            f"backend='magi' supports MagiAttention {'.'.join(map(str, low))} to {'.'.join(map(str, high))} "
            f"(docs/backends.md){newer}")
    return found
