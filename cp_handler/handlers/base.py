"""ContextParallelHandler: the contract between a model and a context-parallel strategy.

A handler is built per batch (as Megatron-LM builds ``PackedSeqParams``) with keyword arguments,
holds the CP process group(s) and the batch's sequence metadata, and is the only way a model
touches context parallelism. ``cp_group=None`` (or a group of size 1) means cp=1: every method is
the identity or plain attention, so one model file runs alone and context-parallel.
"""

from __future__ import annotations

import inspect
from abc import ABCMeta, abstractmethod

import torch
import torch.distributed as dist

from ..runtime.config import CP_COMM_TYPES, QKV_FORMATS, as_comm_type_list, check_comm_types
from .agreement import RankAgreement, ranks_check_enabled
from .checks import attention_variant, check_cu_seqlens, check_member, variant_names
from .guard import Guard, failed, next_serial, refuse
from .opaque import compile_handle, is_literal, opaque_call, opaque_core_attn, variant_args
from .preflight import AttnCall, preflight
from .token_layout import TokenLayout
from .zigzag import ZigzagLayout


class ContextParallelHandler(metaclass=ABCMeta):
    """A CP strategy: the contract's seven methods (and the mixer methods) over composed parts.

    A backend subclasses this class and implements :meth:`attend`, the attention step of a checked call
    (:class:`~.preflight.AttnCall`); optionally its own token layout (``token_layout_cls``, a
    :class:`~.token_layout.TokenLayout`; default the zigzag layout) and its rules (:meth:`check_call`,
    :meth:`unsupported_variant`, :meth:`check_config`, :meth:`check_available`, :meth:`from_config`). What every
    backend shares is composed in, not inherited: the call guard (:class:`~.guard.Guard`, around ``dispatch``,
    ``combine``, ``roll_tensor``, ``core_attn`` and the mixer methods), the rank agreement (``self.agreement``,
    :class:`~.agreement.RankAgreement`), the token layout (``self.token_layout``), the mixers (``self.mixers``) and
    the pre-flight of ``core_attn`` (:func:`~.preflight.preflight`). The comm type is data on the instance.

    Args:
        cp_group: the CP process group; ``None`` means cp=1.
        qkv_format: layout of q, k, v given to :meth:`core_attn` (``"bshd"``, ``"sbhd"``, ``"thd"``).
        cp_comm_type: one of ``CP_COMM_TYPES``, or a list with one entry per layer (indexed by the
            attention module's 1-based ``layer_number``, as in Megatron-LM), of the class's ``cp_comm_types``.
            Required at cp > 1 unless the class runs only one: ``get_cp_handler_cls(backend, cp_comm_type)`` picks
            the class, the handler is told the comm type it runs; at cp = 1 nothing is communicated (default: the
            class's first).
        hierarchical_cp_groups: this rank's group at each hierarchical CP level, inner first
            (``[a2a_group, p2p_group]`` for ``"a2a+p2p"``); see ``build_dp_cp_groups``.
        cu_seqlens: for ``qkv_format="thd"``: int32 ``[num_docs + 1]`` offsets of the real
            (unpadded) documents packed in the global sequence; required for thd, refused otherwise.
        check_ranks: check once per handler and kind of call that the ranks of the CP group agree
            on the batch layout (one all-gather of a few int64; :mod:`.agreement`); default: on, unless
            the environment variable ``CP_HANDLER_CHECK_RANKS=0``.

    Raises:
        ValueError: unknown ``qkv_format`` or ``cp_comm_type``, an empty ``cp_comm_type`` list, a comm type the
            class does not run, no ``cp_comm_type`` at cp > 1 for a class that runs several; ``cu_seqlens``
            missing for thd, given for bshd/sbhd, or malformed; this process not a rank of ``cp_group``.
        TypeError: ``cp_comm_type`` not a str or list of str; ``cu_seqlens`` not an int32/int64 tensor.
    """

    token_layout_cls: type[TokenLayout] = ZigzagLayout
    """Where the tokens sit on the ranks (:mod:`.token_layout`); the mixers follow from it."""
    deterministic: bool = False
    """The deterministic mode (docs/deterministic.md): set by a backend that implements it (``"local"``), before this
    class's ``__init__`` builds the token layout (thd documents are then padded to one length at every CP degree)."""
    cp_comm_types: tuple[str, ...] = CP_COMM_TYPES
    """The comm types this class runs (a handler built with another is refused by name; ``register_cp_handler``
    registers the class for these by default). A backend that plans its own communication declares one."""
    opaque_under_compile: bool = True
    """Under torch.compile ``core_attn`` is one operator (:mod:`.opaque`): true when :meth:`attend` reads of
    ``call.attn_mod`` only its variant attributes; false: it is traced as in eager mode."""

    def __init__(
        self,
        *,
        cp_group: dist.ProcessGroup | None = None,
        qkv_format: str = "bshd",
        cp_comm_type: str | list[str] | None = None,
        hierarchical_cp_groups: list[dist.ProcessGroup] | None = None,
        cu_seqlens: torch.Tensor | None = None,
        check_ranks: bool | None = None,
    ):
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format={qkv_format!r} is not one of {QKV_FORMATS}")
        if (qkv_format == "thd") != (cu_seqlens is not None):
            raise ValueError(
                f"qkv_format={qkv_format!r} with cu_seqlens={'given' if cu_seqlens is not None else None}: "
                "packed sequences (thd) need cu_seqlens, and only thd takes it"
            )
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens)
        check_member(cp_group)
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.cp_comm_type = self._comm_type(cp_comm_type)
        self.cu_seqlens = cu_seqlens
        self.qkv_format = qkv_format
        self.hierarchical_cp_groups = list(hierarchical_cp_groups or [])
        self.failure: str | None = None
        """The first failure of a guarded call on this rank (the handler then refuses every call: :mod:`.guard`)."""
        self.agreement = RankAgreement(cp_group, next_serial(cp_group), ranks_check_enabled(check_ranks))
        self.token_layout = self.token_layout_cls(self)
        self.mixers = self.token_layout.mixers_cls(self)
        self.compile_handle = compile_handle(self)
        """What names this handler to the compiled attention operator (:mod:`.opaque`)."""
        self.attention_calls = 0
        """How many ``core_attn`` calls ran on this handler (a compiled call counts when it runs)."""
        self.resolved_calls: dict = {}
        """The pre-flight's resolved calls by :func:`~.preflight.call_key` (a layer's later calls skip the checks)."""
        self.layer_in_compiled_calls = not isinstance(self.cp_comm_type, str)
        """Whether the compiled attention operator carries the layer's ``layer_number`` (:mod:`.opaque`): when a
        per-layer ``cp_comm_type`` needs it. Reading it costs a recompile per code object under per-block compile
        (Dynamo guards the attribute, then makes it dynamic); without it the ranks agree per call, not per layer."""

    def _comm_type(self, cp_comm_type):
        runs = self.cp_comm_types
        if cp_comm_type is None:
            if self.cp_size > 1 and len(runs) > 1:
                raise ValueError(f"{type(self).__name__}: cp_comm_type=None at cp={self.cp_size}: name the comm type "
                                 f"the handler runs, one of {runs} or a list with one per layer "
                                 "(get_cp_handler_cls(backend, cp_comm_type) picks the class; the handler takes the "
                                 "same cp_comm_type, or build it with build_cp_handler(config, ...))")
            return runs[0]  # cp = 1: nothing is communicated; or the one comm type the class runs
        check_comm_types(cp_comm_type)
        other = sorted(set(as_comm_type_list(cp_comm_type)) - set(runs))
        if other:
            raise ValueError(f"{type(self).__name__}: cp_comm_type={cp_comm_type!r}: it runs {list(runs)} only, not "
                             f"{other}")
        return cp_comm_type

    def agreement_key(self, attn_mod) -> str | None:
        """The agreement key of a ``core_attn`` call: one per layer (``attn_mod.layer_number``, else the call's
        index in this handler), so the ranks compare every layer's variant once per handler; ``None``: no
        agreement (a backend whose calls were agreed elsewhere)."""
        layer = getattr(attn_mod, "layer_number", None)
        self._attn_calls = getattr(self, "_attn_calls", 0) + 1
        return f"core_attn (layer_number {layer})" if layer is not None else f"core_attn (call {self._attn_calls})"

    def check_call(self, call: AttnCall) -> None:
        """This backend's rules for one call, run inside the pre-flight (raise ValueError / TypeError)."""
        return None  # noqa: B027 - optional hook, not abstract

    @classmethod
    def check_config(cls, config, attn_shape=None, dtype: torch.dtype | None = None) -> None:
        """This backend's rules for a run, checked before any rank starts (``cp-train`` calls it for the
        training and the evaluation configs). The base class has none: every pattern runs every head count
        (an all-to-all whose size does not split the heads pads them, :func:`~cp_handler.ops.ulysses.a2a_head_plan`);
        a backend adds its own (Transformer Engine: heads divisible by the a2a size).

        Args:
            config: a :class:`~cp_handler.runtime.config.ContextParallelConfig`.
            attn_shape: the model's :class:`~cp_handler.runtime.config.AttentionShape`, when known.
            dtype: the dtype attention will run in, when known.

        Raises:
            ValueError: naming the rule.
        """
        return None  # noqa: B027 - optional hook, not abstract

    @classmethod
    def from_config(cls, config, cp_group=None, hierarchical_cp_groups=None, attn_shape=None, **batch):
        """A handler of this class for one batch of a run described by ``config`` (see
        :func:`~cp_handler.handlers.registry.build_cp_handler`); ``batch``: ``cu_seqlens`` (and
        ``qkv_format``, default the config's), and any argument this class takes."""
        batch.setdefault("qkv_format", config.qkv_format)
        if config.deterministic:
            if "deterministic" not in inspect.signature(cls.__init__).parameters:
                raise ValueError(f"deterministic=True: backend {config.backend!r} ({cls.__name__}) does not implement "
                                 "the deterministic mode (the 'local' backend does)")
            batch["deterministic"] = True
        return cls(cp_group=cp_group, cp_comm_type=config.cp_comm_type, hierarchical_cp_groups=hierarchical_cp_groups,
                   **batch)

    @classmethod
    def check_available(cls) -> None:
        """Raise ImportError / RuntimeError if this backend cannot run on this machine (default: it can).
        Called by ``cp-train`` before any rank starts."""
        return None  # noqa: B027 - optional hook, not abstract

    @property
    def comm_types(self) -> list[str]:
        """``cp_comm_type`` as a list (one entry, or one per layer)."""
        return as_comm_type_list(self.cp_comm_type)

    def comm_type_for(self, attn_mod: torch.nn.Module | None) -> str:
        """The ``cp_comm_type`` of the layer that ``attn_mod`` belongs to."""
        if isinstance(self.cp_comm_type, str):
            return self.cp_comm_type
        layer_number = getattr(attn_mod, "layer_number", None)
        if layer_number is None or not 1 <= layer_number <= len(self.cp_comm_type):
            raise ValueError(
                f"per-layer cp_comm_type has {len(self.cp_comm_type)} entries; the attention module "
                f"must carry a 1-based layer_number in that range, got {layer_number!r}"
            )
        return self.cp_comm_type[layer_number - 1]

    def attention_variant(self, attn_mod, attn_mask_type: str, q: torch.Tensor, heads: int):
        """``(AttentionMask, sinks or None)`` of ``attn_mod`` (:func:`~.checks.attention_variant`), refused
        by name when this backend does not run it for the layer's comm type (:meth:`unsupported_variant`).

        Raises:
            TypeError / ValueError: an invalid attribute, or a variant this backend does not run.
        """
        mask, sinks = attention_variant(attn_mod, attn_mask_type, q, heads)
        comm_type = self.comm_type_for(attn_mod)
        reason = self.unsupported_variant(comm_type, mask, sinks)
        if reason is not None:
            raise ValueError(f"{type(self).__name__} (cp_comm_type={comm_type!r}): {reason}")
        return mask, sinks

    def unsupported_variant(self, comm_type: str, mask, sinks) -> str | None:
        """Why this backend cannot run ``mask`` / ``sinks`` with ``comm_type`` (``None``: it can). Default:
        the plain causal / full mask only; backends override with what they run."""
        used = variant_names(mask, sinks)
        if not used:
            return None
        return f"{', '.join(used)} not supported by this backend; backend='local' runs them in every comm type"

    # -- the contract: the token layout's methods, under the call guard where they communicate -------------------
    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Global tensor -> this rank's shard along ``seq_dim``. Backward returns the gradient in
        the global layout (zero outside this rank's tokens; sum over the group for the total)."""
        with Guard(self, "dispatch"):
            return self.token_layout.dispatch(tensor, seq_dim)

    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Local shard -> global tensor in original token order (inverse of :meth:`dispatch`)."""
        with Guard(self, "combine"):
            return self.token_layout.combine(tensor, seq_dim)

    def roll_tensor(self, tensor: torch.Tensor, shifts: int = -1, dims: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.roll`` in global token order across ranks; wrapped-around positions are zero.
        Returns ``(rolled, rolled.sum())`` (local sum) as Megatron-LM's ``roll_tensor`` does."""
        with Guard(self, "roll_tensor"):
            return self.token_layout.roll_tensor(tensor, shifts, dims)

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        """Number of rows the rotary table needs for this batch (from the live group)."""
        return self.token_layout.get_rotary_seq_len(local_seq_len)

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        """Rows of a per-position table ``emb (S_global, ...)`` for this rank's local tokens."""
        return self.token_layout.get_emb_on_this_cp_rank(emb)

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE at the global positions of the local tokens; ``freqs`` from :meth:`get_emb_on_this_cp_rank`."""
        return self.token_layout.apply_rotary_pos_emb(t, freqs)

    def core_attn(
        self,
        attn_mod: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask_type: str = "causal",
    ) -> torch.Tensor:
        """Attention of the local queries over the whole sequence; output shaped like ``q``: one pre-flight
        (:func:`~.preflight.preflight`: every check, once) and the backend's :meth:`attend`.

        Attention variants are attributes of ``attn_mod`` (:func:`~.checks.attention_variant`):
        ``window_size`` (a causal left window ``(W - 1, 0)``), ``attention_chunk_size``, ``softcap`` and
        ``sinks``; a backend that does not run one raises ``ValueError`` naming it
        (:meth:`unsupported_variant`), never ignores it."""
        if torch.compiler.is_compiling() and self.opaque_under_compile:
            variant = variant_args(self, attn_mod)
            if variant is not None:
                return opaque_core_attn(self, attn_mod, q, k, v, attn_mask_type, variant)
        self.attention_calls += 1
        if self.failure is not None:  # the call guard inline (the hot path): Guard's rules, no calls on success
            refuse(self, "core_attn")
        try:
            return self.attend(preflight(self, attn_mod, q, k, v, attn_mask_type))
        except BaseException as err:
            failed(self, "core_attn", err)
            raise

    @abstractmethod
    def attend(self, call: AttnCall) -> torch.Tensor:
        """The attention of a checked call (:class:`~.preflight.AttnCall`), shaped like the q passed
        (``call.restore``): the backend's algorithm, which checks nothing again."""

    # -- the mixer methods: the mixer component of the token layout, under the call guard ----------------------
    def causal_conv1d(self, x, weight, bias=None, activation=None, *, conv_fn=None, **conv_kwargs):
        """A causal depthwise convolution of the whole sequence (:meth:`.mixers.ZigzagMixers.causal_conv1d`); under
        torch.compile one operator when the kernel is the default and the other arguments literals (:mod:`.opaque`)."""
        if torch.compiler.is_compiling() and self.opaque_under_compile and conv_fn is None and \
                is_literal(activation) and is_literal(list(conv_kwargs.values())):
            return opaque_call(self, "causal_conv1d", [x, weight, bias], {"activation": activation,
                                                                          "kwargs": conv_kwargs})
        with Guard(self, "causal_conv1d"):
            return self.mixers.causal_conv1d(x, weight, bias, activation, conv_fn=conv_fn, **conv_kwargs)

    def gated_delta_rule(self, query, key, value, g, beta, *, kernel=None, **kernel_kwargs):
        """The gated delta rule over the whole sequence (:meth:`.mixers.ZigzagMixers.gated_delta_rule`); under
        torch.compile one operator as :meth:`causal_conv1d`."""
        if torch.compiler.is_compiling() and self.opaque_under_compile and kernel is None and \
                is_literal(list(kernel_kwargs.values())):
            return opaque_call(self, "gated_delta_rule", [query, key, value, g, beta], {"kwargs": kernel_kwargs})
        with Guard(self, "gated_delta_rule"):
            return self.mixers.gated_delta_rule(query, key, value, g, beta, kernel=kernel, **kernel_kwargs)

    def ssd_scan(self, x, dt, A, B, C, chunk_size, *, kernel, **kernel_kwargs):
        """Mamba2's scan over the whole sequence (:meth:`.mixers.ZigzagMixers.ssd_scan`)."""
        with Guard(self, "ssd_scan"):
            return self.mixers.ssd_scan(x, dt, A, B, C, chunk_size, kernel=kernel, **kernel_kwargs)

    def selective_scan(self, u, delta, A, B, C, *, kernel, **kernel_kwargs):
        """Mamba's selective scan over the whole sequence (:meth:`.mixers.ZigzagMixers.selective_scan`)."""
        with Guard(self, "selective_scan"):
            return self.mixers.selective_scan(u, delta, A, B, C, kernel=kernel, **kernel_kwargs)
