"""Pure-torch context-parallel handlers (CPU and CUDA): zigzag layout, attention algorithms in ops/."""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..auto import AttnCase, AutoChoice, PatternHold, choose_comm_type, load_profile
from ..auto.catalog import default_profile
from ..core.comm_types import CANONICAL_COMM_TYPES
from ..core.masks import AttentionMask
from ..ops.canonical import canonical_attention
from ..ops.kernels import AUTOMATIC, KERNELS, check_masked_override, kernel_override
from ..ops.patterns import PATTERNS
from ..ops.qkv_format import from_bhsd
from ..ops.spec import AttnSpec, KernelChoice
from ..ops.tiling import canonical_applies, tiles_refusal
from ..runtime.config import AUTO, CP_COMM_TYPES
from .base import ContextParallelHandler
from .preflight import AttnCall

LOG = logging.getLogger("cp_handler.auto")
DETERMINISTIC_KERNELS = {"cpu": "cpu_flash", "cuda": "flash"}
"""The block kernel the deterministic mode pins, by device type: the CPU's flash kernel (tested), and on CUDA torch's
FlashAttention-2 (``flash``), whose backward runs its deterministic algorithm under
``torch.use_deterministic_algorithms(True)`` (opt-in: :data:`DETERMINISTIC_CUDA_ENV`)."""
DETERMINISTIC_CUDA_ENV = "CP_HANDLER_DETERMINISTIC_CUDA"
"""Set to ``1`` to run the deterministic mode on CUDA: its GPU path has not run on a GPU yet (docs/deterministic.md,
"On a GPU"), so it is refused without it."""
_LOGGED: set[tuple[str, int, str]] = set()
"""``"auto"``'s picks logged in this process: ``(comm type, cp, profile name)``."""
_WARNED_DEVICES: set[str] = set()
"""Device types the deterministic mode's untested path has warned about in this process."""


class LocalContextParallelHandler(ContextParallelHandler):
    """Pure-torch CP handler for every ``cp_comm_type`` of :data:`~cp_handler.ops.patterns.PATTERNS`
    (``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``), ``"auto"``, or a list of them, one per layer.

    ``"auto"``: a layer's first call of each shape picks the pattern with the lowest predicted time
    (:func:`cp_handler.auto.choose_comm_type`: its plans and transfers priced by ``cp_comm_profile``), among
    p2p, all_gather, a2a, and a2a+p2p when ``hierarchical_cp_groups`` are given, unless the layer holds another
    pattern predicted within 5% of it (``cp_comm_hold``); the pick depends only on what
    every rank of the group shares (shapes, documents, group sizes, the profile), is compared across the ranks with
    the call's other properties, kept in :attr:`auto_choices` and logged once per process and distinct pick
    (logger ``cp_handler.auto``, CP rank 0).

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
        cp_comm_profile: ``"auto"``'s cost profile: a name, a JSON file or a
            :class:`~cp_handler.auto.CostProfile`; ``None``: the device's default
            (:func:`~cp_handler.auto.catalog.default_profile`). Refused without ``"auto"``.
        cp_comm_hold: ``"auto"``'s :class:`~cp_handler.auto.PatternHold` (each layer's pattern held until another
            is predicted faster by its margin, 5%): one per run, shared by its handlers (``cp-train`` does so);
            ``None``: this handler's own. Refused without ``"auto"``.
        deterministic: attention bitwise identical at every CP degree (the output, and the gradients of q, k and v,
            ``torch.equal`` to cp = 1 on the same global inputs; docs/deterministic.md): every pattern on canonical
            tiles (:mod:`~cp_handler.ops.canonical`: any mask on bshd / sbhd, causal masks on thd packs, sinks,
            zigzag chunks of whole tiles), the same bits in every pattern; ``a2a`` runs packed documents and sinks
            with one process's blockwise computation instead (each rank computes whole heads over the whole
            sequence); ``"auto"`` picks among the patterns that run a call.
            The block kernel is pinned (:data:`DETERMINISTIC_KERNELS`: ``cpu_flash``; cp = 1 runs it too instead of
            ``F.scaled_dot_product_attention``); thd documents padded to a multiple of 48 too (one padded length at
            cp 1, 2, 3, 4, 6 and 8: :data:`~cp_handler.core.layout.DETERMINISTIC_MULTIPLE`). Refused by name:
            ``p2p``, ``all_gather`` and ``a2a+p2p`` with a full mask on padded documents or chunks that
            are not whole tiles; ``a2a`` (and a2a+p2p's all-to-all) over ranks that do not divide the key-value
            heads when they are fewer than the query heads (a key-value head's gradient would be summed over ranks
            in the group's order); CUDA unless :data:`DETERMINISTIC_CUDA_ENV` is ``1`` and
            ``torch.use_deterministic_algorithms(True)`` is on (:func:`deterministic_device_refusal`; not yet run on
            a GPU); other devices.
        **kwargs: as :class:`~cp_handler.handlers.base.ContextParallelHandler`.

    Raises:
        ValueError: an unknown ``attn_kernel``; hierarchical groups missing, not two levels, sizes
            not multiplying to cp, or in the wrong order; a ``kv_cache`` with bshd/sbhd or of another group;
            ``deterministic`` with another kernel than the pinned ones;
            ``cp_comm_profile`` without ``"auto"``, unknown, or not covering the group (at the first call: its
            device or dtype).
    """

    cp_comm_types = (*CP_COMM_TYPES, AUTO)

    def __init__(self, *, attn_kernel: str | None = None, kv_cache=None, cp_comm_profile=None,
                 cp_comm_hold: PatternHold | None = None, deterministic: bool = False, **kwargs):
        self.deterministic = bool(deterministic)  # before the base builds the token layout (thd padding)
        super().__init__(**kwargs)
        if self.deterministic:
            if attn_kernel not in (None, *DETERMINISTIC_KERNELS.values()):
                raise ValueError(f"deterministic=True with attn_kernel={attn_kernel!r}: the mode pins the block "
                                 f"kernel by device ({DETERMINISTIC_KERNELS}; 'cpu_flash' is the one it is tested "
                                 "with)")
            attn_kernel = DETERMINISTIC_KERNELS["cpu"]
        if cp_comm_profile is not None and AUTO not in self.comm_types:
            raise ValueError(f"cp_comm_profile={cp_comm_profile!r} prices the patterns of cp_comm_type='auto'; "
                             f"cp_comm_type={self.cp_comm_type!r} has no 'auto' entry")
        self.cp_comm_profile = None if cp_comm_profile is None else load_profile(cp_comm_profile)
        if self.cp_comm_profile is not None:
            self.cp_comm_profile.group(self.cp_size)  # refused by name before any call
        if cp_comm_hold is not None and AUTO not in self.comm_types:
            raise ValueError(f"cp_comm_hold holds the patterns of cp_comm_type='auto'; cp_comm_type="
                             f"{self.cp_comm_type!r} has no 'auto' entry")
        if cp_comm_hold is not None and not isinstance(cp_comm_hold, PatternHold):
            raise TypeError(f"cp_comm_hold={cp_comm_hold!r} is not a cp_handler.auto.PatternHold")
        self.cp_comm_hold = cp_comm_hold if cp_comm_hold is not None else PatternHold()
        """``"auto"``'s pattern per layer, held across calls (:class:`~cp_handler.auto.PatternHold`: given, shared by
        a run's handlers, or this handler's own)."""
        self.auto_choices: dict[AttnCase, object] = {}
        """``"auto"``'s picks by call (:class:`~cp_handler.auto.AttnCase` -> :class:`~cp_handler.auto.AutoChoice`)."""
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
        self._device_choices: dict[str, KernelChoice] = {}
        """The deterministic mode's kernel choice per device type off the CPU (:data:`DETERMINISTIC_KERNELS`; built on
        first use, sharing the packed-call cache)."""
        if self.cp_size > 1 and any(PATTERNS[t].hierarchical if t in PATTERNS else self.hierarchical_cp_groups
                                    for t in self.comm_types):
            self._check_levels()  # "auto" with levels given: checked like a2a+p2p's (it may pick it)
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

    @classmethod
    def from_config(cls, config, cp_group=None, hierarchical_cp_groups=None, attn_shape=None, **batch):
        if getattr(config, "cp_comm_profile", None) is not None:
            batch.setdefault("cp_comm_profile", config.cp_comm_profile)
        return super().from_config(config, cp_group, hierarchical_cp_groups, attn_shape, **batch)

    def resolve_auto(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_dim: int, mask: AttentionMask,
                     layout, layer: int | None = None, sinks: torch.Tensor | None = None) -> str:
        """The pattern ``"auto"`` runs this call of ``layer`` on (class doc): the fastest predicted, unless the layer
        holds another within the hold's margin (:attr:`cp_comm_hold`); at cp=1 ``"p2p"`` (nothing is
        communicated). In the deterministic mode, among the patterns the mode runs this call on (every one gives the
        same bits, so the pick may differ between degrees and batches).

        Raises:
            ValueError: the profile does not describe the inputs' device or dtype (named); in the deterministic mode,
                no pattern runs the call (each one's reason).
        """
        if self.cp_size == 1:
            return "p2p"
        batch = q.shape[1 - seq_dim] if q.dim() == 4 and self.qkv_format != "thd" else 1
        levels = tuple(dist.get_world_size(g) for g in self.hierarchical_cp_groups) or None
        case = AttnCase(tuple(layout.lengths), batch, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1],
                        q.element_size(), mask, self.cp_size, levels)
        choice = self.auto_choices.get(case)
        if choice is None:
            profile = self.cp_comm_profile or default_profile(q.device.type)
            dtype = str(q.dtype).removeprefix("torch.")
            profile.check(self.cp_size, q.device.type, dtype)
            choice = self.auto_choices[case] = choose_comm_type(case, profile, dtype)
            logged = (choice.comm_type, self.cp_size, profile.name)
            if self.cp_rank == 0 and logged not in _LOGGED:  # once per process and distinct pick, not per batch
                _LOGGED.add(logged)
                LOG.info("%s; profile %r", choice.describe(), profile.name)
        if self.deterministic:
            choice = self._deterministic_choice(choice, q.shape[-2], k.shape[-2], layout, mask, sinks)
        return self.cp_comm_hold.pick(layer, self.cp_size, choice)

    def _deterministic_choice(self, choice, heads: int, kv_heads: int, layout, mask, sinks):
        """``choice`` among the patterns the deterministic mode runs the call on (the fastest of those predicted)."""
        refusals = {p.comm_type: self._deterministic_refusal(p.comm_type, heads, kv_heads, layout, mask, sinks)
                    for p in choice.predictions}
        allowed = tuple(p for p in choice.predictions if refusals[p.comm_type] is None)
        if not allowed:
            raise ValueError("cp_comm_type='auto' with deterministic=True: no pattern runs this call in the mode: "
                             + "; ".join(f"{name}: {why}" for name, why in refusals.items()))
        return AutoChoice(min(allowed, key=lambda p: p.total_ms).comm_type, allowed)

    @classmethod
    def check_config(cls, config, attn_shape=None, dtype=None) -> None:
        """The deterministic mode's head rules (:func:`deterministic_heads_refusal`), before any rank starts, when
        the model's ``attn_shape`` is known (else at the first call).

        Raises:
            ValueError: naming the head counts and the CP size.
        """
        if not config.deterministic or attn_shape is None:
            return
        sizes = config.hierarchical_context_parallel_sizes
        for comm_type, size in (("a2a", config.context_parallel_size), ("a2a+p2p", sizes[0] if sizes else None)):
            if comm_type in config.comm_types and size is not None:  # the heads split over the all-to-all
                refusal = deterministic_heads_refusal(attn_shape.num_heads, attn_shape.num_kv_heads, size)
                if refusal:
                    raise ValueError(refusal)

    def unsupported_variant(self, comm_type: str, mask, sinks) -> str | None:
        return None  # windows, chunks, soft-caps and sinks in every comm type (cp_handler.core.masks, ops.sinks)

    def _ring_size(self, comm_type: str) -> int:
        """Ranks of a pattern's ring (whose zigzag chunks its canonical tiles must divide): ``a2a+p2p``'s ring level;
        ``a2a``, none (1); the others, the group."""
        if comm_type == "a2a+p2p" and self.cp_size > 1:
            return dist.get_world_size(self.hierarchical_cp_groups[1])
        return 1 if comm_type == "a2a" else self.cp_size

    def _deterministic_refusal(self, comm_type: str, heads: int, kv_heads: int, layout, mask, sinks) -> str | None:
        """Why the deterministic mode cannot run a call of ``heads`` query and ``kv_heads`` key-value heads over
        ``layout`` under ``mask`` (with ``sinks`` or ``None``) on ``comm_type`` (``None``: it can; the class doc's
        rules)."""
        refusal, ring = None, self._ring_size(comm_type)
        if self.cp_size > 1 and comm_type in CANONICAL_COMM_TYPES:
            refusal = tiles_refusal(layout, mask, ring, comm_type)
        if comm_type in ("a2a", "a2a+p2p"):  # heads split over the all-to-all (p2p, all_gather: whole)
            refusal = refusal or deterministic_heads_refusal(heads, kv_heads, self.cp_size // ring)
        return refusal

    def _device_kernels(self, q: torch.Tensor) -> KernelChoice:
        """The deterministic mode's kernel choice for ``q``'s device type off the CPU: the kernel it pins there
        (:data:`DETERMINISTIC_KERNELS`; on CUDA opt-in, warned once per process)."""
        choice = self._device_choices.get(q.device.type)
        if choice is None:
            if q.device.type not in _WARNED_DEVICES:
                _WARNED_DEVICES.add(q.device.type)
                LOG.warning("deterministic=True on %s (%s=1): a path no GPU has run yet; check its bits against cp 1 "
                            "(docs/deterministic.md, 'On a GPU')", q.device.type, DETERMINISTIC_CUDA_ENV)
            base = self.kernel_choice
            choice = self._device_choices[q.device.type] = KernelChoice(
                DETERMINISTIC_KERNELS[q.device.type], base.varying_shapes, base.packed_calls)
        return choice

    def check_call(self, call: AttnCall) -> None:
        """A prefill that fills a KV cache attends causally (an encoder-style layer cannot generate); the deterministic
        mode's rules (the class doc's ``deterministic``)."""
        if self.deterministic:
            heads, kv_heads = call.q.shape[1], call.k.shape[1]
            refusal = deterministic_device_refusal(call.q.device.type, call.comm_type if self.cp_size > 1 else None)
            if refusal:
                raise ValueError(refusal)
            refusal = self._deterministic_refusal(call.comm_type, heads, kv_heads, call.layout, call.mask, call.sinks)
            if refusal:
                raise ValueError(refusal)
        if self.kv_cache is not None and not call.mask.causal:
            raise ValueError(f"kv_cache: layer {call.layer if call.layer is not None else '?'} attends bidirectionally "
                             "(attn_mask_type='no_mask'): a KV cache holds keys and values that later tokens do not "
                             "change, which holds only for causal attention; an encoder-style model cannot generate "
                             "with a cache")

    def attend(self, call: AttnCall) -> torch.Tensor:
        q, k, v, mask = call.q, call.k, call.v, call.mask
        kernels = self.kernel_choice if not self.deterministic or q.device.type == "cpu" else self._device_kernels(q)
        if self.cp_size == 1 and self.qkv_format != "thd" and self.attn_kernel == AUTOMATIC and mask.plain \
                and call.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=call.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        elif self.deterministic and (call.comm_type in ("all_gather", "p2p") if self.cp_size > 1 else
                                     canonical_applies(call.layout, mask, call.sinks,
                                                       tiled=call.comm_type in CANONICAL_COMM_TYPES)):
            spec = AttnSpec(mask, call.scale, call.layout, kernels.select(q, v.shape[-1]),
                            group=self.cp_group if self.cp_size > 1 else None, sinks=call.sinks)
            out = canonical_attention(q, k, v, spec, ring=call.comm_type == "p2p")[0]
        else:  # cp=1 with packed documents, a variant or a forced kernel runs the ring alone: blockwise
            comm_type = call.comm_type if self.cp_size > 1 else "p2p"
            entry = self._patterns.get(comm_type)
            if entry is None:  # once per comm type: the groups are the handler's
                pattern = PATTERNS[comm_type]
                groups = pattern.spec_groups(self.cp_group, self.hierarchical_cp_groups) if self.cp_size > 1 else {}
                entry = self._patterns[comm_type] = (pattern.attention, groups)
            attention, groups = entry
            kernel = kernels.select(q, v.shape[-1])
            if not mask.plain:  # a forced masked kernel that cannot run this mask: refused before communicating
                check_masked_override(mask, q, kernel, v.shape[-1])
            spec = AttnSpec(mask, call.scale, call.layout, kernel, self.kernel_choice.packed_calls, sinks=call.sinks,
                            canonical=self.deterministic, **groups)
            out = attention(q, k, v, spec)[0]
        if self.kv_cache is not None:
            self.kv_cache.store_prefill(call.layer or 0, call.in_format(k), call.in_format(v), call.layout)
        if call.qkv_format == "bshd":  # call.restore(out) inline (the hot path): from_bhsd's bshd case
            return out.transpose(1, 2)
        return from_bhsd(out, call.qkv_format, call.given)


HierarchicalContextParallelHandler = LocalContextParallelHandler
"""The name the local handler had when ``"a2a+p2p"`` was a class of its own; the same class."""


def deterministic_device_refusal(device_type: str, comm_type: str | None = None) -> str | None:
    """Why the deterministic mode refuses a call of ``comm_type`` on ``device_type`` (``None``: it runs it). The CPU
    runs it (tested); CUDA only opted in (:data:`DETERMINISTIC_CUDA_ENV` ``=1``: no GPU has run the path yet), with
    ``torch.use_deterministic_algorithms(True)`` on, not ``warn_only`` (torch's FlashAttention-2 backward adds dq in
    an order of its blocks' scheduling otherwise: ``_flash_attention_backward`` passes the flag to ``mha_bwd``), and
    not ``a2a`` / ``a2a+p2p`` (its forward splits the keys by an occupancy heuristic over batch x heads x query
    blocks, ``set_params_splitkv``: the heads a rank computes change with cp under an all-to-all); any other
    device."""
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return f"deterministic=True on {device_type}: the mode runs on the CPU (and, opted in, on CUDA)"
    if os.environ.get(DETERMINISTIC_CUDA_ENV) != "1":
        return (f"deterministic=True on cuda: the mode's GPU path has not run on a GPU yet (docs/deterministic.md, "
                f"'On a GPU'); set {DETERMINISTIC_CUDA_ENV}=1 to run it (torch's FlashAttention-2 kernel with its "
                "deterministic backward) and compare its bits with cp 1 yourself")
    if not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
        return (f"deterministic=True on cuda ({DETERMINISTIC_CUDA_ENV}=1) needs torch.use_deterministic_algorithms("
                "True) (not warn_only): FlashAttention-2's backward adds dq in a nondeterministic order otherwise")
    if comm_type in ("a2a", "a2a+p2p"):
        return (f"deterministic=True on cuda with cp_comm_type={comm_type!r}: FlashAttention-2's forward splits the "
                "keys by the heads a call computes, which the all-to-all changes with the CP size; use 'p2p' or "
                "'all_gather'")
    return None


def deterministic_heads_refusal(heads: int, kv_heads: int, cp_size: int) -> str | None:
    """Why the deterministic mode refuses ``heads`` query and ``kv_heads`` key-value heads over a CP group of
    ``cp_size`` (``None``: it runs them bitwise; the rules were measured, docs/deterministic.md)."""
    if heads != kv_heads and kv_heads % cp_size:
        return (f"deterministic=True with {kv_heads} key-value heads over a CP group of {cp_size}: a key-value head's "
                "query heads would sit on several ranks and its gradient be summed over them in the group's order; "
                "use a CP size that divides the key-value heads")
    return None
