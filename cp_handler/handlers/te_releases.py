"""Transformer Engine's per-release rules under context parallelism, each with its source.

Sources: NVIDIA/TransformerEngine tags v2.17, v2.18, branch ``release_v2.19`` (b447576, VERSION 2.19.0) and
main at d0067d0 (2.20.0.dev0, 2026-08-22), read in ``pytorch/attention/dot_product_attention/`` (``utils.py``
``get_attention_backend``, ``context_parallel.py``, ``backends.py``, ``dot_product_attention.py``); the release
notes https://github.com/NVIDIA/TransformerEngine/releases/tag/v2.19 and .../tag/v2.21.0 and the pull requests
they cite, where the released code is not reachable. A rule whose source was not reached stays a refusal
that says what is unverified.
"""

from __future__ import annotations

from importlib import metadata

THD_ALL_GATHER_SINCE = (2, 18)
"""thd with ``all_gather``: v2.17.1's ``context_parallel.py`` asserts "No support for cp_comm_type='all_gather'
and qkv_format='thd'"; gone in v2.18 (release notes v2.18: "Added THD format support for AllGather-based CP")."""
THD_A2A_P2P_SINCE = (2, 19)
"""thd with ``a2a+p2p``: v2.18's ``context_parallel.py`` asserts "thd format is not supported with hierarchical
CP implementation yet!" and ``utils.py`` (L1166) disables FusedAttention for it; both removed by commit 8ff60f8de
"Enable THD with hierarchical context parallelism" (#3290, 2026-08-04), on branch release_v2.19, not in v2.18."""
THD_FP8_SINCE = (2, 19)
"""FP8 attention with thd under CP: up to v2.18 and on release_v2.19 at b447576 ``utils.py`` disables
FusedAttention for ``fp8_dpa`` + thd under CP and FlashAttention for FP8 under CP (no backend left). Release
notes v2.19 (5e52bef, 2026-09-11): "Added cuDNN FP8 fused attention support for packed THD inputs and
context-parallel execution" (#2994, #3441)."""
FP8_THD_RECIPES = ("DelayedScaling", "Float8CurrentScaling")
"""PR #2994's support matrix (https://github.com/NVIDIA/TransformerEngine/pull/2994): forward and backward under
CP (p2p, all_gather, a2a, a2a+p2p) on B200 / SM100 for these two recipes, cuDNN 9.23+; MXFP8BlockScaling "not
supported with THD"; other recipes not in the matrix (unverified)."""
FP8_THD_MIN_CAPABILITY = (10, 0)
"""PR #2994: on H100 / SM90 under CP, DelayedScaling is "forward only (not directly covered by PR tests)" and
Float8CurrentScaling "not supported": unverified, so refused below SM100."""
FP8_THD_MIN_CUDNN = (9, 23, 0)
"""PR #2994: "FP8 recipe (cuDNN 9.23+)" (TE reads it with ``transformer_engine.pytorch.utils.get_cudnn_version``,
main d0067d0 utils.py L679)."""
FA3_THD_PADDED_SINCE = (2, 17)
"""FlashAttention 3 with padding between thd sequences under p2p / a2a CP: commit 80ea3133e (#2596, 2026-05-22),
first in v2.17 (``utils.py`` "FA3 supports pad_between_seqs via seqused_q/seqused_k")."""
FA4_THD_CP_SINCE = (2, 21)
"""FlashAttention 4 under CP: disabled up to main d0067d0 (``utils.py`` L1174-1176: "Disabling FlashAttention 4
as it does not support context parallelism yet"). Release notes v2.21.0 (7457e47, 2026-11-10): "Added
FlashAttention 3 and FlashAttention 4 support for THD attention with pad_between_seqs=True, including P2P and
all-to-all context parallelism" (#3205). FA4 under CP for bshd/sbhd is in no release note reached: unverified."""
FLASH_DISTRIBUTIONS = {"FA2": "flash-attn", "FA3": "flash-attn-3", "FA4": "flash-attn-4"}
"""How TE finds each FlashAttention: the distribution's version (``backends.py``, main d0067d0, L100-175)."""


def _dotted(version) -> str:
    return ".".join(map(str, version))


def thd_comm_types(version: tuple[int, ...]) -> tuple[str, ...]:
    """The comm types that take thd in TE ``version``."""
    types = ("p2p", "a2a")
    if version >= THD_ALL_GATHER_SINCE:
        types += ("all_gather",)
    if version >= THD_A2A_P2P_SINCE:
        types += ("a2a+p2p",)
    return types


def fp8_thd_refusal(version, recipe: str, capability, cudnn) -> str | None:
    """Why TE ``version`` cannot run FP8 attention (``fp8_dpa``) on thd under CP here, or None."""
    head = f"transformer_engine {_dotted(version)}: FP8 attention (fp8_dpa) with qkv_format='thd' under context " \
           "parallelism"
    if version < THD_FP8_SINCE:
        return (f"{head} is not supported (TE disables FusedAttention for FP8 + thd under CP and FlashAttention for "
                "FP8 under CP before 2.19); turn fp8_dpa off, use bshd/sbhd, or TE >= 2.19")
    if recipe == "MXFP8BlockScaling":
        return f"{head} is not supported with recipe MXFP8BlockScaling (TE PR #2994: not supported with THD)"
    if recipe not in FP8_THD_RECIPES:
        return (f"{head}: recipe {recipe} is unverified (TE PR #2994 covers {', '.join(FP8_THD_RECIPES)} only); "
                "refused")
    if capability is not None and tuple(capability) < FP8_THD_MIN_CAPABILITY:
        return (f"{head} on compute capability {_dotted(capability)} is unverified (TE PR #2994: on SM90 forward "
                "only, not covered by its tests; backward needs SM100+); refused")
    if cudnn is not None and tuple(cudnn) < FP8_THD_MIN_CUDNN:
        return f"{head} needs cuDNN >= 9.23 (TE PR #2994), found {_dotted(cudnn)}"
    return None


def installed_flash() -> tuple[str, ...]:
    """The FlashAttention generations installed, found as TE finds them (by distribution)."""
    found = []
    for name, dist in FLASH_DISTRIBUTIONS.items():
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return tuple(found)


def flash_under_cp(version, comm_type: str, qkv_format: str, installed) -> tuple[str, ...]:
    """The installed FlashAttention generations TE ``version`` runs under ``comm_type`` (``a2a`` / ``a2a+p2p``) for
    ``qkv_format``. thd: the handler always passes ``cu_seqlens_padded``, which TE takes as padding between
    sequences (``dot_product_attention.py`` main d0067d0 L2008-2026), so FA2 never runs it (``utils.py`` "Filter:
    QKV layout"), and FA3 / FA4 only in the comm types their sources name (p2p, a2a: #2596, #3205); thd with
    ``a2a+p2p`` and FlashAttention is unverified."""
    thd = qkv_format == "thd"
    usable = []
    if "FA2" in installed and not thd:
        usable.append("FA2")
    if "FA3" in installed and (not thd or (comm_type == "a2a" and version >= FA3_THD_PADDED_SINCE)):
        usable.append("FA3")
    if "FA4" in installed and thd and comm_type == "a2a" and version >= FA4_THD_CP_SINCE:
        usable.append("FA4")
    return tuple(usable)
