"""Transformer Engine handler: ``core_attn`` drives ``transformer_engine.pytorch.DotProductAttention``.

Token layout, roll and RoPE are the zigzag (DualChunkSwap) ones shared with the local backend, so a
batch dispatched by one can go through the other. Per attention module (``attn_mod``) one
``DotProductAttention`` is built on first use and registered as its child ``te_attention``, so it
is in the model's ``state_dict`` (TE keeps FP8 metadata as extra state), follows ``.to()`` and is
switched by ``.train()`` / ``.eval()`` (TE's CP forward reads ``self.training``). A checkpoint loaded
strictly into a fresh model needs the children first: one forward, or :meth:`te_module` per layer.
Before each call its CP group is re-bound with ``set_context_parallel_group`` when the handler's
group(s) or comm type differ from the module's, which evaluation at another CP degree and dynamic
CP need. The window of a sliding-window ``attn_mod`` (``window_size``) is passed to every forward.

TE's rules under CP, checked first and raised as ``ValueError`` (instead of an assertion or "no
dot product attention backend" inside TE); read against TE's sources (``attn_forward_func_with_cp``
in ``attention/dot_product_attention/context_parallel.py``, ``get_attention_backend`` in ``utils.py``,
tags v2.10-v2.18, release_v2.19 and main at 2.20.0.dev0; the per-release rules, with their sources and the
release notes of 2.19 and 2.21, are in :mod:`.te_releases`):

* dtype float16 or bfloat16: no fp32 backend supports CP (UnfusedDotProductAttention is disabled
  under CP, FlashAttention and FusedAttention take fp16/bf16);
* sliding-window attention only with ``a2a`` and ``all_gather``; chunked attention, soft-capping and
  learnable sinks refused by name (:meth:`TEContextParallelHandler.unsupported_variant`);
* ``a2a`` / ``a2a+p2p``: query and KV heads divisible by the a2a size (TE does not replicate KV); an
  odd head count also disables FusedAttention, so it needs a FlashAttention that TE runs there: FA2 or FA3
  (bshd/sbhd); thd with ``a2a``: FA3 from TE 2.17, FA4 from 2.21 (never FA2: padding between sequences);
* thd: ``p2p`` and ``a2a``; ``all_gather`` from TE 2.18; ``a2a+p2p`` from 2.19; FP8 attention from 2.19
  (DelayedScaling / Float8CurrentScaling on SM100+ with cuDNN 9.23+; others refused by name);
  ``cu_seqlens_padded`` multiples of ``2 * cp``;
* a CP group (or hierarchical level) of ``None`` while cp > 1: TE would run without CP;
* multi-head latent attention (value head dim != q/k head dim; ``kv_channels=(Dqk, Dv)``) in every comm type:
  FusedAttention runs it (separate q/k/v tensors), FlashAttention only with p2p (TE's own CP tests skip
  MLA otherwise), so ``a2a`` with odd head counts (no FusedAttention) is refused;
* two-sided windows (``no_mask``, ``window_size=(L, R)``) as sliding windows: ``a2a`` and ``all_gather``;
  zero-length documents in ``cu_seqlens`` passed as they are (TE takes them).

Requires ``transformer_engine`` (imported lazily) and CUDA.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from ..ops.patterns import PATTERNS
from .base import ContextParallelHandler
from .checks import softmax_scale, variant_names, window_size
from .preflight import AttnCall
from .requirements import import_backend, release, require_cuda
from .te_releases import flash_under_cp, fp8_thd_refusal, installed_flash, thd_comm_types

TE_HINT = "install it on a CUDA machine: pip install transformer_engine[pytorch] (see docs/backends.md)"
TE_MODULE_NAME = "te_attention"
"""Name of the ``DotProductAttention`` child registered on each attention module."""


def _same_groups(a, b) -> bool:
    """The same process group, or lists of the same groups (identity, element by element)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b


def _te_mask_type(attn_mask_type: str, qkv_format: str) -> str:
    if qkv_format == "thd":
        return "padding_causal" if attn_mask_type == "causal" else "padding"
    return attn_mask_type


class TEContextParallelHandler(ContextParallelHandler):
    """Handler for backend ``"transformer_engine"`` (all four ``cp_comm_type`` values).

    ``core_attn`` takes q ``(B, S, H, D)`` (bshd), ``(S, B, H, D)`` (sbhd) or ``(T, H, D)`` /
    ``(1, T, H, D)`` (thd) in float16/bfloat16 and returns the output shaped like q. ``attn_mod``
    supplies ``softmax_scale``, a 1-based ``layer_number`` and optionally ``window_size``
    (``(left, right)``, TE's convention; passed to TE).

    Raises:
        ImportError: transformer_engine is not installed. RuntimeError: no CUDA.
        ValueError: a TE restriction (see module doc), before any collective.
    """

    opaque_under_compile = False
    """Its attention registers a ``DotProductAttention`` child on ``attn_mod`` (:meth:`te_module`): under
    torch.compile it is traced as in eager mode, not one operator (:mod:`.opaque`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.te = import_backend("transformer_engine.pytorch", "transformer_engine", TE_HINT)
        self.te_version = release(getattr(import_backend("transformer_engine", "transformer_engine", TE_HINT),
                                          "__version__", "0"))
        require_cuda("transformer_engine")
        if self.cp_size > 1:
            self._check_groups()

    @classmethod
    def check_available(cls) -> None:
        import_backend("transformer_engine.pytorch", "transformer_engine", TE_HINT)
        require_cuda("transformer_engine")

    @classmethod
    def check_config(cls, config, attn_shape=None, dtype=None) -> None:
        """TE's rules that need no rank (see the module doc): fp16/bf16 under CP; query and KV heads
        both divisible by the a2a size (TE does not replicate KV heads)."""
        cp = config.context_parallel_size
        if cp == 1:
            return
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"transformer_engine attends in float16/bfloat16 only under context parallelism "
                             f"(cp={cp}), not {dtype}")
        for comm_type in config.comm_types:
            size = PATTERNS[comm_type].a2a_size(cp, config.hierarchical_context_parallel_sizes)
            if attn_shape is not None and size and (attn_shape.num_heads % size or attn_shape.num_kv_heads % size):
                raise ValueError(f"transformer_engine {comm_type}: query heads ({attn_shape.num_heads}) and KV heads "
                                 f"({attn_shape.num_kv_heads}) must both be divisible by the a2a size ({size})")

    def _thd_comm_types(self) -> tuple[str, ...]:
        return thd_comm_types(self.te_version)

    def _check_groups(self) -> None:
        if "a2a+p2p" in self.comm_types:
            groups = self.hierarchical_cp_groups
            if len(groups) != 2 or any(g is None for g in groups):
                raise ValueError(
                    "cp_comm_type='a2a+p2p' with transformer_engine needs hierarchical_cp_groups=[a2a_group, "
                    f"p2p_group] (no None: TE would silently run without CP), got {groups}"
                )
        if self.qkv_format == "thd":
            allowed = self._thd_comm_types()
            bad = [t for t in self.comm_types if t not in allowed]
            if bad:
                version = ".".join(map(str, self.te_version))
                raise ValueError(f"transformer_engine {version} does not support qkv_format='thd' with "
                                 f"cp_comm_type={bad}; use one of {list(allowed)} (thd: all_gather from TE 2.18, "
                                 "a2a+p2p from 2.19)")
            padded = self.token_layout.cu_seqlens_padded
            if torch.any(padded % (2 * self.cp_size) != 0):
                raise ValueError(f"cu_seqlens_padded {padded.tolist()} must be multiples of "
                                 f"2 * cp = {2 * self.cp_size}")

    def te_group_args(self, comm_type: str) -> tuple:
        """``(cp_group, cp_global_ranks)`` as ``set_context_parallel_group`` takes them."""
        ranks = dist.get_process_group_ranks(self.cp_group)
        if comm_type == "a2a+p2p":
            return list(self.hierarchical_cp_groups), ranks
        return self.cp_group, ranks

    def check_call(self, call: AttnCall) -> None:
        """TE's own rules under CP: fp16/bf16, a2a head counts, FP8 attention not with thd (inside the pre-flight:
        a failure fails every rank together)."""
        if self.cp_size == 1:
            return
        q, comm_type, heads, kv_heads = call.q, call.comm_type, call.q.shape[1], call.k.shape[1]
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"transformer_engine: q has dtype {q.dtype}, but TE has no {q.dtype} attention backend "
                             "under context parallelism (float16 or bfloat16 only); cast the model to bfloat16 or "
                             "use backend='local', which runs any float dtype")
        if comm_type in ("a2a", "a2a+p2p"):
            size = self.cp_size if comm_type == "a2a" else dist.get_world_size(self.hierarchical_cp_groups[0])
            if heads % size or kv_heads % size:
                raise ValueError(f"transformer_engine {comm_type}: query heads ({heads}) and KV heads ({kv_heads}) "
                                 f"must both be divisible by the a2a size ({size})")
            installed = installed_flash() if heads % 2 or kv_heads % 2 else None  # read only when needed
            if installed is not None and not flash_under_cp(self.te_version, comm_type, self.qkv_format, installed):
                version = ".".join(map(str, self.te_version))
                raise ValueError(f"transformer_engine {comm_type}: odd head counts ({heads}, {kv_heads}) disable "
                                 f"FusedAttention, and no FlashAttention that TE {version} runs under CP with "
                                 f"qkv_format={self.qkv_format!r} is installed (installed: {list(installed)}; FA2/FA3 "
                                 "for bshd/sbhd, thd with a2a: FA3 from TE 2.17, FA4 from 2.21): TE would have no "
                                 "backend")
        if call.v.shape[-1] != q.shape[-1] and comm_type == "a2a" and (heads % 2 or kv_heads % 2):
            raise ValueError(f"transformer_engine a2a: a value head dim {call.v.shape[-1]} != q/k head dim "
                             f"{q.shape[-1]} (MLA) needs FusedAttention (FlashAttention runs MLA under CP with p2p "
                             f"only), and odd head counts ({heads}, {kv_heads}) disable it")
        recipe = self._fp8_attention()
        if self.qkv_format == "thd" and recipe is not None:
            utils = importlib.import_module("transformer_engine.pytorch.utils")
            refusal = fp8_thd_refusal(self.te_version, type(recipe).__name__, utils.get_device_compute_capability(),
                                      utils.get_cudnn_version())
            if refusal:
                raise ValueError(refusal)

    def _fp8_attention(self):
        """The FP8 recipe when FP8 attention is on (TE's ``FP8GlobalStateManager`` with an ``fp8_dpa`` recipe),
        else None."""
        manager = getattr(getattr(self.te, "fp8", None), "FP8GlobalStateManager", None)
        if manager is None or not manager.is_fp8_enabled():
            return None
        recipe = manager.get_fp8_recipe()
        return recipe if getattr(recipe, "fp8_dpa", False) else None

    def unsupported_variant(self, comm_type: str, mask, sinks) -> str | None:
        """What TE's context parallelism runs (checked in its ``attn_forward_func_with_cp``, TE 2.8 - 2.20):
        sliding windows with ``a2a`` / ``all_gather`` only (the local backend's ring has them); no
        chunked attention or soft-capping; learnable sinks (``softmax_type="learnable"``) only with
        ``a2a`` and FusedAttention, which this handler does not map ``attn_mod.sinks`` onto."""
        windowed = mask.window is not None or mask.window_right is not None
        if self.cp_size > 1 and windowed and comm_type in ("p2p", "a2a+p2p"):
            window = next(name for name in variant_names(mask, None) if "window_size" in name)
            return (f"{window} is not supported by Transformer Engine with cp_comm_type={comm_type!r}; use 'a2a' or "
                    "'all_gather', or backend='local' (ring with halo exchange)")
        unsupported = [name for name in variant_names(mask, sinks) if "window_size" not in name]
        if unsupported:
            return (f"{', '.join(unsupported)} not run by this handler on Transformer Engine (TE has no chunked "
                    "attention or soft-capping under CP, and sinks only as its own softmax_offset with a2a); "
                    "backend='local' runs them in every comm type")
        return None

    def te_module(self, attn_mod, heads: int, kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                  attn_mask_type: str = "causal"):
        """The ``DotProductAttention`` child ``te_attention`` of ``attn_mod`` (built and registered on
        first use, with the module's ``window_size`` when it has one, checked by TE against ``attn_mask_type``;
        ``kv_channels=(head_dim, v_head_dim)`` when the value head dim differs, MLA)."""
        module = getattr(attn_mod, TE_MODULE_NAME, None)
        if module is None:
            kwargs = {}
            if window_size(attn_mod) is not None:
                kwargs["window_size"] = window_size(attn_mod)
            module = self.te.DotProductAttention(
                num_attention_heads=heads, num_gqa_groups=kv_heads,
                kv_channels=head_dim if v_head_dim in (None, head_dim) else (head_dim, v_head_dim),
                qkv_format=self.qkv_format, attn_mask_type=_te_mask_type(attn_mask_type, self.qkv_format),
                softmax_scale=softmax_scale(attn_mod, head_dim),
                layer_number=getattr(attn_mod, "layer_number", None), **kwargs,
            )
            attn_mod.add_module(TE_MODULE_NAME, module)
        return module

    def bind(self, module, comm_type: str) -> None:
        """Point ``module`` at this handler's CP group(s) unless it already is (same group objects
        and comm type)."""
        if self.cp_size == 1:
            group, ranks = None, None
        else:
            group, ranks = self.te_group_args(comm_type)
        bound = _same_groups(getattr(module, "cp_group", None), group)
        if bound and getattr(module, "cp_comm_type", None) == comm_type:
            return
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # owned by the module it is given to
        module.set_context_parallel_group(group, ranks, stream, cp_comm_type=comm_type)
        if self.cp_size > 1 and getattr(module, "cp_group", None) is None:
            raise ValueError("transformer_engine DotProductAttention has cp_group=None after binding: it would run "
                             "without context parallelism")

    def attend(self, call: AttnCall) -> torch.Tensor:
        q, k, v = (call.in_format(t) for t in (call.q, call.k, call.v))
        heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
        mask_type = "causal" if call.mask.causal else "no_mask"
        module = self.te_module(call.attn_mod, heads, kv_heads, head_dim, v.shape[-1], mask_type)
        self.bind(module, call.comm_type)
        kwargs = {"qkv_format": self.qkv_format, "attn_mask_type": _te_mask_type(mask_type, self.qkv_format)}
        if window_size(call.attn_mod) is not None:
            kwargs["window_size"] = window_size(call.attn_mod)
        if self.qkv_format == "thd":
            cu_seqlens = self.cu_seqlens.to(device=q.device, dtype=torch.int32)
            padded = self.token_layout.cu_seqlens_padded.to(q.device)
            max_seqlen = max(self.token_layout.thd_layout.padded_lengths)
            kwargs.update(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cu_seqlens_q_padded=padded,
                          cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return module(q, k, v, **kwargs).reshape(call.out_shape)
