"""Pure-torch context-parallel handlers (CPU and CUDA): zigzag layout, attention algorithms in ops/."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import CP_COMM_TYPES
from ..ops.all_gather import all_gather_attn
from ..ops.kernels import KERNELS, kernel_override
from ..ops.ring import ring_attn
from ..ops.ulysses import a2a_attn
from .base import ATTN_MASK_TYPES
from .checks import softmax_scale, window_size
from .zigzag import ZigzagContextParallelHandler


def to_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View ``t`` as ``(B, H, S, D)``: bshd, sbhd, or thd ``(T, H, D)`` / ``(1, T, H, D)`` as B=1."""
    if qkv_format == "bshd" or (qkv_format == "thd" and t.dim() == 4):
        return t.transpose(1, 2)
    if qkv_format == "sbhd":
        return t.permute(1, 2, 0, 3)
    return t.transpose(0, 1).unsqueeze(0)


def from_bhsd(t: torch.Tensor, qkv_format: str, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_bhsd` (``like``: the tensor given to it)."""
    if qkv_format == "bshd" or (qkv_format == "thd" and like.dim() == 4):
        return t.transpose(1, 2)
    if qkv_format == "sbhd":
        return t.permute(2, 0, 1, 3)
    return t.squeeze(0).transpose(0, 1)


class LocalContextParallelHandler(ZigzagContextParallelHandler):
    """Pure-torch CP handler for ``cp_comm_type`` ``"p2p"``, ``"all_gather"`` and ``"a2a"``.

    ``core_attn`` takes q ``(B, S_local, H, D)`` (bshd), ``(S_local, B, H, D)`` (sbhd) or
    ``(T_local, H, D)`` (thd; ``(1, T_local, H, D)`` too) and k, v with ``Hkv`` heads
    (``H % Hkv == 0``), in any float dtype, and returns the attention output shaped like q.
    thd attention is document-causal (or full within each document for ``"no_mask"``), computed
    per document on real tokens; padding rows of the output are zero. At cp=1 (bshd/sbhd) it is
    ``F.scaled_dot_product_attention``. Algorithms: ring
    (:mod:`~cp_handler.ops.ring`), KV all-gather (:mod:`~cp_handler.ops.all_gather`), Ulysses
    all-to-all (:mod:`~cp_handler.ops.ulysses`).

    Args:
        attn_kernel: force the block attention kernel by name (``"cpu_flash"``, ``"cudnn"``,
            ``"flash"``, ``"efficient"``; :mod:`cp_handler.ops.kernels`); default: the
            ``CP_HANDLER_ATTN_KERNEL`` environment variable, else the fastest verified kernel.
            A forced kernel is used at cp=1 too (instead of ``F.scaled_dot_product_attention``).
        **kwargs: as :class:`~cp_handler.handlers.base.ContextParallelHandler`.

    Raises:
        ValueError: a comm type this class does not implement; an unknown ``attn_kernel``.
    """

    supported_comm_types: tuple[str, ...] = ("p2p", "all_gather", "a2a")

    def __init__(self, *, attn_kernel: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if attn_kernel is not None and attn_kernel not in KERNELS:
            raise ValueError(f"attn_kernel={attn_kernel!r} is not a known attention kernel; known: {list(KERNELS)}")
        self.attn_kernel = attn_kernel
        for comm_type in self.comm_types:
            if comm_type not in self.supported_comm_types:
                raise ValueError(
                    f"{type(self).__name__} does not implement cp_comm_type={comm_type!r}; "
                    f"it supports {self.supported_comm_types}"
                )

    def attention(self, comm_type: str, q, k, v, *, causal: bool, scale: float):
        """Run the ``comm_type`` algorithm on ``(B, H, S_local, D)`` tensors; returns the output."""
        group, layout, kernel = self.cp_group, self.layout(q.shape[2]), self.attn_kernel
        if comm_type == "p2p":
            return ring_attn(q, k, v, group=group, causal=causal, scale=scale, layout=layout, attn_kernel=kernel)[0]
        if comm_type == "all_gather":
            return all_gather_attn(q, k, v, group=group, causal=causal, scale=scale, layout=layout,
                                   attn_kernel=kernel)[0]
        if comm_type == "a2a":
            return a2a_attn(q, k, v, group=group, causal=causal, scale=scale, layout=layout, attn_kernel=kernel)[0]
        raise ValueError(f"{type(self).__name__} does not implement cp_comm_type={comm_type!r}")

    def core_attn(self, attn_mod, q, k, v, *, attn_mask_type: str = "causal") -> torch.Tensor:
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {ATTN_MASK_TYPES}")
        window = window_size(attn_mod)
        if window is not None and window not in ((-1, 0), (-1, -1)):
            raise ValueError(f"attn_mod.window_size={window}: the local backend has no sliding-window "
                             "attention; use backend='transformer_engine' with cp_comm_type 'a2a' or 'all_gather'")
        scale = softmax_scale(attn_mod, q.shape[-1])
        causal = attn_mask_type == "causal"
        self.check_attention_inputs(q, k, v)
        q_, k_, v_ = (to_bhsd(t, self.qkv_format) for t in (q, k, v))
        if self.cp_size == 1 and self.thd_layout is None and kernel_override(self.attn_kernel)[0] is None:
            out = F.scaled_dot_product_attention(
                q_, k_, v_, is_causal=causal, scale=scale, enable_gqa=q_.shape[1] != k_.shape[1]
            )
        elif self.cp_size == 1:  # packed documents alone, or a forced kernel: blockwise attention
            out = ring_attn(q_, k_, v_, group=None, causal=causal, scale=scale, layout=self.layout(q_.shape[2]),
                            attn_kernel=self.attn_kernel)[0]
        else:
            out = self.attention(self.comm_type_for(attn_mod), q_, k_, v_, causal=causal, scale=scale)
        return from_bhsd(out, self.qkv_format, q)


class HierarchicalContextParallelHandler(LocalContextParallelHandler):
    """Local handler that also runs ``"a2a+p2p"``: a2a inside the inner group, ring across.

    Args:
        hierarchical_cp_groups: ``[a2a_group, p2p_group]`` for this rank (inner, adjacent ranks,
            first), e.g. ``DataContextParallelGroups.hierarchical_cp_groups``; required when
            cp > 1, with sizes whose product is the CP group size.
        **kwargs: as :class:`LocalContextParallelHandler`.

    Raises:
        ValueError: missing groups, not exactly two levels, or sizes not multiplying to cp.
    """

    supported_comm_types = CP_COMM_TYPES

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.cp_size > 1 and "a2a+p2p" in self.comm_types:
            self._check_levels()

    def _check_levels(self) -> None:
        groups = self.hierarchical_cp_groups
        if len(groups) != 2:
            raise ValueError(
                f"a2a+p2p needs hierarchical_cp_groups=[a2a_group, p2p_group], got {len(groups)} level(s); "
                "build them with build_dp_cp_groups(..., hierarchical_context_parallel_sizes=[a2a, p2p])"
            )
        sizes = [dist.get_world_size(g) for g in groups]
        if math.prod(sizes) != self.cp_size:
            raise ValueError(
                f"hierarchical_cp_groups have sizes {sizes} multiplying to {math.prod(sizes)}, "
                f"but the CP group has {self.cp_size} ranks"
            )
        a2a = sizes[0]
        cp_ranks = {r: i for i, r in enumerate(dist.get_process_group_ranks(self.cp_group))}
        members = [sorted(cp_ranks.get(r, -1) for r in dist.get_process_group_ranks(g)) for g in groups]
        inner = list(range(self.cp_rank - self.cp_rank % a2a, self.cp_rank - self.cp_rank % a2a + a2a))
        outer = list(range(self.cp_rank % a2a, self.cp_size, a2a))
        if -1 in members[0] + members[1] or members != [inner, outer]:
            raise ValueError(
                f"hierarchical_cp_groups: this rank (CP rank {self.cp_rank}) got levels with CP ranks {members}, "
                f"expected the a2a level on adjacent ranks {inner} first and the p2p level {outer} second (were the "
                "levels passed in the wrong order? build them with build_dp_cp_groups(..., "
                "hierarchical_context_parallel_sizes=[a2a, p2p]))"
            )

    def attention(self, comm_type: str, q, k, v, *, causal: bool, scale: float):
        if comm_type != "a2a+p2p":
            return super().attention(comm_type, q, k, v, causal=causal, scale=scale)
        a2a_group, p2p_group = self.hierarchical_cp_groups
        return a2a_attn(q, k, v, group=a2a_group, inner_group=p2p_group, causal=causal, scale=scale,
                        layout=self.layout(q.shape[2]), attn_kernel=self.attn_kernel)[0]
