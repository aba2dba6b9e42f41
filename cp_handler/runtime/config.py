"""ContextParallelConfig: the CP settings of a run, with Megatron-LM's field names.

Every rule is checked in ``__post_init__`` (or in :func:`check_seq_len`, which the data path
calls), so a bad configuration raises before any process group or collective exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..auto.catalog import load_profile
from ..core.comm_types import (
    AUTO,
    COMM_TYPE_CHOICES,
    CP_COMM_TYPES,
    HIERARCHICAL_COMM_TYPES,
)

__all__ = ["AUTO", "COMM_TYPE_CHOICES", "CP_COMM_TYPES", "QKV_FORMATS", "AttentionShape", "ContextParallelConfig",
           "as_comm_type_list", "check_comm_types", "check_hierarchical_sizes", "check_per_layer_comm_types",
           "check_seq_len"]

QKV_FORMATS = ("sbhd", "bshd", "thd")
"""Tensor layouts: s = sequence, b = batch, h = heads, d = head dim, t = packed tokens."""


def as_comm_type_list(cp_comm_type: str | list[str]) -> list[str]:
    """``cp_comm_type`` as a list: one value, or the per-layer entries."""
    return [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)


def check_comm_types(cp_comm_type) -> list[str]:
    """``cp_comm_type`` as a list: one known type, or a non-empty list/tuple of them.

    Raises:
        TypeError: neither a str nor a list/tuple of str. ValueError: empty, or an unknown type.
    """
    if isinstance(cp_comm_type, str):
        types = [cp_comm_type]
    elif isinstance(cp_comm_type, (list, tuple)) and all(isinstance(t, str) for t in cp_comm_type):
        types = list(cp_comm_type)
    else:
        raise TypeError(f"cp_comm_type={cp_comm_type!r} must be one of {COMM_TYPE_CHOICES} or a list of them (one "
                        "per layer)")
    if not types:
        raise ValueError("cp_comm_type=[] must name at least one communication type")
    for comm_type in types:
        if comm_type not in COMM_TYPE_CHOICES:
            raise ValueError(f"cp_comm_type={comm_type!r} is not a valid communication type; valid: "
                             f"{COMM_TYPE_CHOICES}")
    return types


def check_hierarchical_sizes(sizes, context_parallel_size: int) -> None:
    """The one rule of hierarchical CP sizes: integers >= 1 (inner level first) whose product is the
    CP size.

    Raises:
        ValueError: naming the sizes, their product and the CP size.
    """
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"hierarchical_context_parallel_sizes={list(sizes) if sizes else sizes!r} must be a "
                         "non-empty list of integers >= 1")
    if math.prod(sizes) != context_parallel_size:
        raise ValueError(f"hierarchical_context_parallel_sizes={list(sizes)} multiply to {math.prod(sizes)}, but "
                         f"context_parallel_size={context_parallel_size}; their product must be equal")


def check_per_layer_comm_types(cp_comm_type: str | list[str], num_layers: int | None) -> None:
    """Raises ValueError for a per-layer list whose length is not ``num_layers`` (when known)."""
    if not isinstance(cp_comm_type, str) and num_layers is not None and len(cp_comm_type) != num_layers:
        raise ValueError(
            f"cp_comm_type has {len(cp_comm_type)} entries but the model has num_layers={num_layers}; "
            "a per-layer cp_comm_type list needs exactly one entry per layer"
        )


@dataclass(frozen=True)
class AttentionShape:
    """The attention shape a backend's rules and plans may need (head counts under an all-to-all,
    MagiAttention's key)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    """The values' head dim when it differs (multi-head latent attention); ``None``: ``head_dim``."""


@dataclass
class ContextParallelConfig:
    """Context-parallel settings (field names as in Megatron-LM's ``TransformerConfig``)."""

    context_parallel_size: int = 1
    """Number of ranks one sequence is split over (the CP group size)."""

    cp_comm_type: str | list[str] = "p2p"
    """Communication pattern of attention: one of ``CP_COMM_TYPES``, ``"auto"`` (chosen per call from a cost
    profile), or a list with one entry per layer."""

    hierarchical_context_parallel_sizes: list[int] | None = None
    """Sizes of the CP levels, inner (adjacent ranks, a2a) first; required by ``"a2a+p2p"``."""

    backend: str = "local"
    """Handler backend name, as registered with ``register_cp_handler``."""

    qkv_format: str = "bshd"
    """Layout of q, k, v given to attention: ``"sbhd"``, ``"bshd"`` or ``"thd"``."""

    num_layers: int | None = field(default=None)
    """Number of transformer layers, when known: checks the length of a per-layer ``cp_comm_type``."""

    cp_comm_profile: str | None = None
    """The cost profile ``"auto"`` prices patterns with: a name (:data:`cp_handler.auto.NAMED_PROFILES`) or a JSON file
    of ``cp-bench --calibrate``; ``None``: the device's default (:func:`cp_handler.auto.catalog.default_profile`).
    Only with ``"auto"``; refused when it does not cover ``context_parallel_size``."""

    deterministic: bool = False
    """Attention, the logits and the loss bitwise identical at every CP degree (docs/deterministic.md): every comm
    type (``"a2a"`` with bshd / sbhd or thd, thd documents padded to a multiple of 48 at every degree; ``"p2p"``,
    ``"all_gather"`` and ``"a2a+p2p"`` on canonical tiles, thd with causal masks; ``"auto"`` among those that run each
    call),
    on a backend that implements the mode (``"local"``); the loss summed in one order over the whole sequence.
    Parameter gradients: summed exactly where the caller does so (cp-train, the Hugging Face trainers)."""

    def __post_init__(self) -> None:
        self._check_size()
        self._check_comm_types()
        self._check_hierarchy()
        self._check_deterministic()
        if self.qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format={self.qkv_format!r} is not one of {QKV_FORMATS}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend={self.backend!r} must be a non-empty backend name")

    def _check_size(self) -> None:
        size = self.context_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"context_parallel_size={size!r} must be an integer >= 1")

    def _check_comm_types(self) -> None:
        check_comm_types(self.cp_comm_type)
        check_per_layer_comm_types(self.cp_comm_type, self.num_layers)
        if self.cp_comm_profile is None:
            return
        if AUTO not in self.comm_types:
            raise ValueError(f"cp_comm_profile={self.cp_comm_profile!r} prices the patterns of cp_comm_type='auto'; "
                             f"cp_comm_type={self.cp_comm_type!r} has no 'auto' entry: drop it")
        load_profile(self.cp_comm_profile).group(self.context_parallel_size)  # raises, naming the profile

    def _check_hierarchy(self) -> None:
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is None:
            needing = [t for t in self.comm_types if t in HIERARCHICAL_COMM_TYPES]
            if needing:
                raise ValueError(
                    f"cp_comm_type={needing[0]!r} needs hierarchical_context_parallel_sizes=[a2a_size, p2p_size] "
                    f"whose product is context_parallel_size={self.context_parallel_size}"
                )
            return
        check_hierarchical_sizes(sizes, self.context_parallel_size)
        if not any(t == AUTO or t in HIERARCHICAL_COMM_TYPES for t in self.comm_types):
            raise ValueError(f"hierarchical_context_parallel_sizes={list(sizes)} is used only by a hierarchical "
                             f"cp_comm_type ({', '.join(HIERARCHICAL_COMM_TYPES)}) or by "
                             f"'auto' (which may pick one); "
                             f"cp_comm_type={self.cp_comm_type!r} has none: drop it")

    def _check_deterministic(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic={self.deterministic!r} must be True or False")
        if not self.deterministic:
            return

    @property
    def comm_types(self) -> list[str]:
        """The distinct communication types this config uses."""
        return sorted(set(as_comm_type_list(self.cp_comm_type)))


def check_seq_len(seq_len: int, context_parallel_size: int, qkv_format: str = "bshd") -> None:
    """Check the zigzag (DualChunkSwap) rule: bshd/sbhd sequences split into ``2 * cp`` equal chunks.

    For ``thd`` the handler pads each document itself, so only ``seq_len >= 1`` is required.

    Raises:
        ValueError: ``seq_len`` < 1, or (bshd/sbhd) not divisible by ``2 * context_parallel_size``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if qkv_format == "thd" or context_parallel_size == 1:
        return
    chunks = 2 * context_parallel_size
    if seq_len % chunks:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2 * context_parallel_size = {chunks}: the zigzag "
            f"layout splits every sequence into 2*cp equal chunks (qkv_format={qkv_format!r}); "
            f"use e.g. seq_len={(seq_len // chunks + 1) * chunks}"
        )
