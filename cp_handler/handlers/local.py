"""Pure-torch context-parallel handlers (CPU and CUDA): zigzag layout, attention algorithms in ops/."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops.kernels import AUTOMATIC, KERNELS, check_masked_override, kernel_override
from ..ops.patterns import PATTERNS
from ..ops.qkv_format import from_bhsd
from ..ops.spec import AttnSpec, KernelChoice
from .base import ContextParallelHandler
from .preflight import AttnCall


class LocalContextParallelHandler(ContextParallelHandler):
    """Pure-torch CP handler for every ``cp_comm_type`` of :data:`~cp_handler.ops.patterns.PATTERNS`
    (``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``, or a list of them, one per layer).

    ``core_attn`` takes q ``(B, S_local, H, D)`` (bshd), ``(S_local, B, H, D)`` (sbhd) or
    ``(T_local, H, D)`` (thd; ``(1, T_local, H, D)`` too) and k, v with ``Hkv`` heads
    (``H % Hkv == 0``), in any float dtype, and returns the attention output shaped like q.
    thd attention is document-causal (or full within each document for ``"no_mask"``), computed
    per document on real tokens; padding rows of the output are zero. At cp=1 (bshd/sbhd) it is
    ``F.scaled_dot_product_attention``. Algorithms: the pattern's entry in
    :data:`~cp_handler.ops.patterns.PATTERNS` (ring, KV all-gather, Ulysses all-to-all, a2a around a ring).

    Args:
        attn_kernel: force the block attention kernel by name (``"cpu_flash"``, ``"cudnn"``,
            ``"flash"``, ``"efficient"``; :mod:`cp_handler.ops.kernels`); default: the
            ``CP_HANDLER_ATTN_KERNEL`` environment variable (read here, once), else the fastest
            verified kernel for the inputs' device and dtype. A forced kernel is used at cp=1 too
            (instead of ``F.scaled_dot_product_attention``).
        hierarchical_cp_groups: ``[a2a_group, p2p_group]`` for this rank (inner, adjacent ranks,
            first), e.g. ``DataContextParallelGroups.hierarchical_cp_groups``; required by a
            hierarchical pattern (``"a2a+p2p"``) at cp > 1, with sizes whose product is the CP size.
        kv_cache: a :class:`~cp_handler.inference.KVCache` this prefill fills (thd only: each prompt
            one document): every ``core_attn`` also stores its layer's real local K/V rows.
        **kwargs: as :class:`~cp_handler.handlers.base.ContextParallelHandler`.

    Raises:
        ValueError: an unknown ``attn_kernel``; hierarchical groups missing, not two levels, sizes
            not multiplying to cp, or in the wrong order; a ``kv_cache`` with bshd/sbhd or of another group.
    """

    def __init__(self, *, attn_kernel: str | None = None, kv_cache=None, **kwargs):
        super().__init__(**kwargs)
        if kv_cache is not None:
            if self.qkv_format != "thd":
                raise ValueError(f"kv_cache: a prefill runs prompts as thd documents (padding handled per prompt), "
                                 f"not qkv_format={self.qkv_format!r}")
            kv_cache.check_group(self.cp_group, "prefill handler")
        self.kv_cache = kv_cache
        self.layer_in_compiled_calls |= kv_cache is not None  # a prefill stores per layer (handlers/opaque.py)
        attn_kernel, source = kernel_override(attn_kernel)  # the environment is read here, once
        if attn_kernel is not None and attn_kernel not in KERNELS:
            raise ValueError(f"{source}={attn_kernel!r} is not a known attention kernel; known: {list(KERNELS)}")
        self.attn_kernel = attn_kernel or AUTOMATIC
        # with the packed calls of this batch's plans; thd: a new block shape per document pair
        self.kernel_choice = KernelChoice(self.attn_kernel, varying_shapes=self.qkv_format == "thd")
        if self.cp_size > 1 and any(PATTERNS[t].hierarchical for t in self.comm_types):
            self._check_levels()
        self._patterns: dict[str, tuple] = {}
        """``(attention, spec groups)`` by comm type, resolved at a comm type's first call (:meth:`attend`)."""

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
        if members != [inner, outer]:
            raise ValueError(
                f"hierarchical_cp_groups: this rank (CP rank {self.cp_rank}) got levels with CP ranks {members}, "
                f"expected the a2a level on adjacent ranks {inner} first and the p2p level {outer} second (were the "
                "levels passed in the wrong order? build them with build_dp_cp_groups(..., "
                "hierarchical_context_parallel_sizes=[a2a, p2p]))"
            )

    def unsupported_variant(self, comm_type: str, mask, sinks) -> str | None:
        return None  # windows, chunks, soft-caps and sinks in every comm type (cp_handler.masks, ops.sinks)

    def check_call(self, call: AttnCall) -> None:
        """A prefill that fills a KV cache attends causally (an encoder-style layer cannot generate)."""
        if self.kv_cache is not None and not call.mask.causal:
            raise ValueError(f"kv_cache: layer {call.layer if call.layer is not None else '?'} attends bidirectionally "
                             "(attn_mask_type='no_mask'): a KV cache holds keys and values that later tokens do not "
                             "change, which holds only for causal attention; an encoder-style model cannot generate "
                             "with a cache")

    def attend(self, call: AttnCall) -> torch.Tensor:
        q, k, v, mask = call.q, call.k, call.v, call.mask
        if self.cp_size == 1 and self.qkv_format != "thd" and self.attn_kernel == AUTOMATIC and mask.plain \
                and call.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=call.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        else:  # cp=1 with packed documents, a variant or a forced kernel runs the ring alone: blockwise
            comm_type = call.comm_type if self.cp_size > 1 else "p2p"
            entry = self._patterns.get(comm_type)
            if entry is None:  # once per comm type: the groups are the handler's
                pattern = PATTERNS[comm_type]
                groups = pattern.spec_groups(self.cp_group, self.hierarchical_cp_groups) if self.cp_size > 1 else {}
                entry = self._patterns[comm_type] = (pattern.attention, groups)
            attention, groups = entry
            kernel = self.kernel_choice.select(q, v.shape[-1])
            if not mask.plain:  # a forced masked kernel that cannot run this mask: refused before communicating
                check_masked_override(mask, q, kernel, v.shape[-1])
            spec = AttnSpec(mask, call.scale, call.layout, kernel, self.kernel_choice.packed_calls, sinks=call.sinks,
                            **groups)
            out = attention(q, k, v, spec)[0]
        if self.kv_cache is not None:
            self.kv_cache.store_prefill(call.layer or 0, call.in_format(k), call.in_format(v), call.layout)
        if call.qkv_format == "bshd":  # call.restore(out) inline (the hot path): from_bhsd's bshd case
            return out.transpose(1, 2)
        return from_bhsd(out, call.qkv_format, call.given)


HierarchicalContextParallelHandler = LocalContextParallelHandler
"""The name the local handler had when ``"a2a+p2p"`` was a class of its own; the same class."""
