"""Transformer Engine handler: ``core_attn`` drives ``transformer_engine.pytorch.DotProductAttention``.

Token layout, roll and RoPE are the zigzag (DualChunkSwap) ones shared with the local backend, so a
batch dispatched by one can go through the other. Per attention module (``attn_mod``) one
``DotProductAttention`` is built on first use and kept (TE modules carry FP8 state); before each
call its CP group is re-bound with ``set_context_parallel_group`` when the handler's group or
comm type differs from the module's, which is what evaluation at another CP degree and dynamic CP
need. TE's documented restrictions (TE ``attn_forward_func_with_cp`` and the a2a communicate
helper) are checked first and raise ``ValueError`` instead of an assertion inside TE:

* sliding-window attention only with ``a2a`` and ``all_gather``;
* ``a2a`` / ``a2a+p2p``: query and KV heads divisible by the a2a size (TE does not replicate KV);
* thd only with ``p2p`` and ``a2a`` (TE refuses thd for ``all_gather`` and ``a2a+p2p``), with
  ``cu_seqlens_padded`` multiples of ``2 * cp``;
* a CP group (or hierarchical level) of ``None`` while cp > 1: TE would run without CP.

Requires ``transformer_engine`` (imported lazily) and CUDA.
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.distributed as dist

from ..config import CP_COMM_TYPES
from .base import ATTN_MASK_TYPES
from .requirements import import_backend, require_cuda
from .zigzag import ZigzagContextParallelHandler

TE_HINT = "install it on a CUDA machine: pip install transformer_engine[pytorch] (see docs/backends.md)"
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attn_mod -> DotProductAttention
_STREAM: list = []  # one CUDA stream per process for TE's ring overlap


def _te_mask_type(attn_mask_type: str, qkv_format: str) -> str:
    if qkv_format == "thd":
        return "padding_causal" if attn_mask_type == "causal" else "padding"
    return attn_mask_type


class TEContextParallelHandler(ZigzagContextParallelHandler):
    """Handler for backend ``"transformer_engine"`` (all four ``cp_comm_type`` values).

    ``core_attn`` takes q ``(B, S, H, D)`` (bshd), ``(S, B, H, D)`` (sbhd) or ``(T, H, D)`` /
    ``(1, T, H, D)`` (thd) and returns the output shaped like q. ``attn_mod`` supplies
    ``softmax_scale``, a 1-based ``layer_number`` and optionally ``window_size``.

    Raises:
        ImportError: transformer_engine is not installed. RuntimeError: no CUDA.
        ValueError: a TE restriction (see module doc), before any collective.
    """

    supported_comm_types = CP_COMM_TYPES

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.te = import_backend("transformer_engine.pytorch", "transformer_engine", TE_HINT)
        require_cuda("transformer_engine")
        if self.cp_size > 1:
            self._check_groups()

    @classmethod
    def check_available(cls) -> None:
        import_backend("transformer_engine.pytorch", "transformer_engine", TE_HINT)
        require_cuda("transformer_engine")

    def _check_groups(self) -> None:
        if "a2a+p2p" in self.comm_types:
            groups = self.hierarchical_cp_groups
            if len(groups) != 2 or any(g is None for g in groups):
                raise ValueError(
                    "cp_comm_type='a2a+p2p' with transformer_engine needs hierarchical_cp_groups=[a2a_group, "
                    f"p2p_group] (no None: TE would silently run without CP), got {groups}"
                )
        if self.qkv_format == "thd":
            bad = [t for t in self.comm_types if t not in ("p2p", "a2a")]
            if bad:
                raise ValueError(f"transformer_engine does not support qkv_format='thd' with cp_comm_type={bad}; "
                                 "use 'p2p' or 'a2a'")
            padded = self.cu_seqlens_padded
            if torch.any(padded % (2 * self.cp_size) != 0):
                raise ValueError(f"cu_seqlens_padded {padded.tolist()} must be multiples of "
                                 f"2 * cp = {2 * self.cp_size}")

    def te_group_args(self, comm_type: str) -> tuple:
        """``(cp_group, cp_global_ranks)`` as ``set_context_parallel_group`` takes them."""
        ranks = dist.get_process_group_ranks(self.cp_group)
        if comm_type == "a2a+p2p":
            return list(self.hierarchical_cp_groups), ranks
        return self.cp_group, ranks

    def _check_call(self, comm_type: str, attn_mod, heads: int, kv_heads: int) -> None:
        window = getattr(attn_mod, "window_size", None)
        if window not in (None, (-1, 0), (-1, -1)) and comm_type in ("p2p", "a2a+p2p"):
            raise ValueError(f"transformer_engine: sliding window attention (window_size={window}) is not supported "
                             f"with cp_comm_type={comm_type!r}; use 'a2a' or 'all_gather'")
        if comm_type in ("a2a", "a2a+p2p"):
            size = self.cp_size if comm_type == "a2a" else dist.get_world_size(self.hierarchical_cp_groups[0])
            if heads % size or kv_heads % size:
                raise ValueError(f"transformer_engine {comm_type}: query heads ({heads}) and KV heads ({kv_heads}) "
                                 f"must both be divisible by the a2a size ({size})")

    def te_module(self, attn_mod, heads: int, kv_heads: int, head_dim: int):
        """The ``DotProductAttention`` kept for ``attn_mod`` (built on first use)."""
        module = _MODULES.get(attn_mod)
        if module is None:
            module = self.te.DotProductAttention(
                num_attention_heads=heads, kv_channels=head_dim, num_gqa_groups=kv_heads,
                qkv_format=self.qkv_format, attn_mask_type=_te_mask_type("causal", self.qkv_format),
                softmax_scale=getattr(attn_mod, "softmax_scale", None),
                layer_number=getattr(attn_mod, "layer_number", None),
            )
            _MODULES[attn_mod] = module
        return module

    def bind(self, module, comm_type: str) -> None:
        """Point ``module`` at this handler's CP group(s) if it is not already (feature-detected
        ``load_balancing_strategy`` on newer TE)."""
        if self.cp_size == 1:
            group, ranks = None, None
        else:
            group, ranks = self.te_group_args(comm_type)
        if getattr(module, "cp_group", None) is group and getattr(module, "cp_comm_type", None) == comm_type:
            return
        if not _STREAM and torch.cuda.is_available():
            _STREAM.append(torch.cuda.Stream())
        kwargs = {"cp_comm_type": comm_type}
        if "load_balancing_strategy" in inspect.signature(module.set_context_parallel_group).parameters:
            strategy = getattr(import_backend("transformer_engine.pytorch.constants", "transformer_engine", TE_HINT),
                               "CPLoadBalancingStrategy", None)
            if strategy is not None:
                kwargs["load_balancing_strategy"] = strategy.DUAL_CHUNK_SWAP
        module.set_context_parallel_group(group, ranks, _STREAM[0] if _STREAM else None, **kwargs)
        if self.cp_size > 1 and getattr(module, "cp_group", None) is None:
            raise ValueError("transformer_engine DotProductAttention has cp_group=None after binding: it would run "
                             "without context parallelism")

    def core_attn(self, attn_mod, q, k, v, *, attn_mask_type: str = "causal") -> torch.Tensor:
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {ATTN_MASK_TYPES}")
        shape = q.shape
        if self.qkv_format == "thd" and q.dim() == 4:
            q, k, v = q.squeeze(0), k.squeeze(0), v.squeeze(0)
        heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
        comm_type = self.comm_type_for(attn_mod)
        if self.cp_size > 1:
            self._check_call(comm_type, attn_mod, heads, kv_heads)
        module = self.te_module(attn_mod, heads, kv_heads, head_dim)
        self.bind(module, comm_type)
        kwargs = {"qkv_format": self.qkv_format, "attn_mask_type": _te_mask_type(attn_mask_type, self.qkv_format)}
        if self.qkv_format == "thd":
            cu_seqlens = self.cu_seqlens.to(device=q.device, dtype=torch.int32)
            padded = self.cu_seqlens_padded.to(q.device)
            max_seqlen = max(self.thd_layout.padded_lengths)
            kwargs.update(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cu_seqlens_q_padded=padded,
                          cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return module(q, k, v, **kwargs).reshape(shape)
