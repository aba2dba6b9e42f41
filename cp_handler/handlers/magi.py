"""MagiAttention handler: MagiAttention decides the token layout and the communication.

Follows ``magi_attention.api``: a runtime key built from the batch (``magi_attn_varlen_key``),
``dispatch`` / ``undispatch`` for the token layout, ``calc_attn`` for attention,
``get_position_ids`` for RoPE and ``roll`` for labels where the installed version has it
(else undispatch -> torch.roll -> dispatch). MagiAttention works on packed tokens
``(T, H, D)``: a bshd batch ``(B, S)`` is squashed into ``B`` documents of ``S`` tokens, and local
tensors come back as ``(1, T_local, ...)``. ``cp_comm_type`` is not used (MagiAttention plans its
own communication).

Supported releases: 1.0.4 to 1.1.1 (and main at 2c641357, which has 1.1.1's API), read against
``magi_attention/api/magi_attn_interface.py`` of each tag (:mod:`.magi_releases`). Older releases are refused:
before 1.0.4 ``calc_attn`` takes no ``softmax_scale`` and 1.0.0-1.0.2's ``dispatch`` does not pad; newer ones
(1.1.2 to 1.1.8) are refused as unverified, named in the error (their API was not reached in source). The key's
arguments differ by release and are called as that release defines them:

* 1.0.4-1.0.5: ``(cu_seqlens_q, cu_seqlens_k, pad_size, chunk_size, cp_group_or_mesh, causal)``;
* 1.1.0: adds ``num_heads_q, num_heads_kv, head_dim``; ``pad_size`` and ``chunk_size`` required;
* 1.1.1: ``chunk_size`` optional and ``pad_size`` computed inside (0 passed); ``roll`` exists.

``pad_size`` is ``compute_pad_size(total, cp, chunk_size)`` where the caller supplies it.
MagiAttention's ``dispatch`` backward all-gathers (every rank gets the whole gradient); the handler
wraps it so that its backward follows the contract: this rank's tokens' gradient, zero elsewhere.
Rules checked first (``ValueError``): q/k/v in float16 or bfloat16 and head_dim <= 128 (FFA's
kernels), the head shape given at construction.

Requires ``magi_attention`` (imported lazily), CUDA and an NCCL CP group.
"""

from __future__ import annotations

import torch

from ..runtime.rope import apply_rotary
from .base import ContextParallelHandler
from .checks import check_dim, check_shift
from .magi_alone import alone_attn, alone_positions, alone_roll
from .magi_releases import check_release
from .preflight import AttnCall
from .requirements import import_backend, require_cuda, require_nccl
from .token_layout import TokenLayout

MAGI_HINT = "install MagiAttention (magi_attention) on a supported NVIDIA GPU machine, see docs/backends.md"
DEFAULT_CHUNK_SIZE = 512
"""``chunk_size`` passed to the releases whose key needs one (MagiAttention's examples use 512)."""
MAX_HEAD_DIM = 128


class _Dispatch(torch.autograd.Function):
    """MagiAttention's dispatch with the contract's backward: the local gradient scattered into
    zeros of the global shape at this rank's tokens (padding dropped)."""

    @staticmethod
    def forward(ctx, tokens, api, key, positions):
        ctx.total, ctx.positions, ctx.shape = tokens.shape[0], positions, tokens.shape
        with torch.no_grad():
            return api.dispatch(tokens, key)

    @staticmethod
    def backward(ctx, grad):
        real = ctx.positions < ctx.total
        full = grad.new_zeros(ctx.shape)
        full.index_copy_(0, ctx.positions[real].to(grad.device), grad[real.to(grad.device)])
        return full, None, None, None


class MagiLayout(TokenLayout):
    """MagiAttention's token layout (module doc): the runtime key built at the first dispatch, tokens placed by
    ``magi_attention.api.dispatch`` (its padding told apart by :meth:`real_token_mask`); every mixer method refused
    by name."""

    def __init__(self, handler):
        super().__init__(handler)
        self.key = None
        self.positions: torch.Tensor | None = None
        self.batch_shape: tuple[int, int] | None = None

    # -- the runtime key -------------------------------------------------------------------
    def _thd_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens`` without its zero-length documents: MagiAttention requires strictly increasing
        ``cu_seqlens`` (``AttnRanges.from_cu_seqlens``), and an empty document has no token to place."""
        return torch.unique_consecutive(self.handler.cu_seqlens).to(torch.int32)

    def _cu_seqlens(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        if self.handler.qkv_format == "thd":
            return self._thd_cu_seqlens()
        self.batch_shape = self._batch_shape_of(tensor, seq_dim)
        batch, seq = tensor.shape[1 - seq_dim], tensor.shape[seq_dim]
        return torch.arange(0, batch * seq + 1, seq, dtype=torch.int32)

    @staticmethod
    def _batch_shape_of(tensor: torch.Tensor, seq_dim: int) -> tuple[int, int]:
        batch, seq = tensor.shape[1 - seq_dim], tensor.shape[seq_dim]
        return (batch, seq) if seq_dim == 1 else (seq, batch)

    def _build_key(self, cu_seqlens: torch.Tensor, device) -> None:
        """The key, called with the arguments of the installed release (module doc)."""
        cu = cu_seqlens.to(device)
        total = int(cu_seqlens[-1])
        h, api = self.handler, self.handler.api
        common = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "cp_group_or_mesh": h.cp_group, "causal": h.causal}
        heads = dict(zip(("num_heads_q", "num_heads_kv", "head_dim"), h.heads, strict=True))
        explicit_pad = {"pad_size": api.compute_pad_size(total, h.cp_size, DEFAULT_CHUNK_SIZE),
                        "chunk_size": DEFAULT_CHUNK_SIZE}
        if self.handler.release[:3] < (1, 1, 0):
            self.key = api.magi_attn_varlen_key(**common, **explicit_pad)
        elif self.handler.release[:3] < (1, 1, 1):
            self.key = api.magi_attn_varlen_key(**common, **heads, **explicit_pad)
        else:
            self.key = api.magi_attn_varlen_key(**common, **heads, pad_size=0)
        self.positions = api.get_position_ids(self.key).long()

    def require_key(self) -> None:
        if self.key is None:
            raise RuntimeError("backend='magi': call dispatch() on the batch before any other handler method")

    # -- layout ------------------------------------------------------------------------------
    def _to_tokens(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        if self.handler.qkv_format == "thd":
            return tensor.movedim(seq_dim, 0)
        return tensor.movedim(seq_dim, 1).flatten(0, 1)  # (B*S, ...), batch-major

    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Global tensor -> ``(1, T_local, ...)`` (seq at ``seq_dim``), MagiAttention's layout (padded).
        Backward: this rank's tokens' gradient in the global layout, zero elsewhere.

        Every call agrees over the CP group (the key's batch at the first, the tensor's shape against it after): a
        tensor of another batch on some rank (a handler reused) raises the same ``RanksRefused`` on every rank."""
        seq_dim = check_dim("seq_dim", seq_dim, tensor.dim())
        if self.handler.cp_size == 1:
            return tensor
        first, built = self.key is None, {}

        def local_checks():
            if first:
                cu_seqlens = built["cu_seqlens"] = self._cu_seqlens(tensor, seq_dim)
                return {"tokens": int(cu_seqlens[-1]), "layout": f"cu_seqlens {cu_seqlens.tolist()}"}
            if self.handler.qkv_format == "thd":
                got, want = tensor.shape[seq_dim], int(self._thd_cu_seqlens()[-1])
            else:
                got, want = self._batch_shape_of(tensor, seq_dim), self.batch_shape
            if got != want:
                raise ValueError(f"dispatch: a tensor of {got} tokens (dim {seq_dim}), but this handler dispatched "
                                 f"{want}: from another batch (a handler is built per batch)")
            return {"tokens": 0, "layout": f"the key's {want}"}

        self.handler.agreement.checked("dispatch", tensor.device, ("tokens", "layout"), local_checks, every_call=True)
        if first:
            self._build_key(built["cu_seqlens"], tensor.device)
        local = _Dispatch.apply(self._to_tokens(tensor, seq_dim), self.handler.api, self.key, self.positions)
        return local.movedim(0, seq_dim) if self.handler.qkv_format == "thd" else local.unsqueeze(0).movedim(1, seq_dim)

    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Local shard -> global tensor in the original layout (``undispatch``)."""
        if self.handler.cp_size == 1:
            return tensor
        self.require_key()
        if self.handler.qkv_format == "thd":
            return self.handler.api.undispatch(tensor.movedim(seq_dim, 0), self.key).movedim(0, seq_dim)
        tokens = self.handler.api.undispatch(tensor.movedim(seq_dim, 1)[0], self.key)
        return tokens.unflatten(0, self.batch_shape).movedim(1, seq_dim)

    def _documents(self) -> torch.Tensor:
        """``cu_seqlens`` of the documents the key placed (thd: the batch's, non-empty; bshd: one per sequence)."""
        if self.handler.qkv_format == "thd":
            return self._thd_cu_seqlens()
        return torch.arange(0, self.batch_shape[0] * self.batch_shape[1] + 1, self.batch_shape[1])

    def real_token_mask(self) -> torch.Tensor | None:
        """bool ``(T_local,)``: this rank's slots that hold tokens of the batch. MagiAttention pads the global
        tokens at their end (the key's ``pad_size``) before it places them, so a slot is real when its global
        position (``get_position_ids``) is below the batch's token count; cp 1: ``None`` (``dispatch`` returns the
        batch as it is). Raises RuntimeError before the first ``dispatch`` (no key yet)."""
        if self.handler.cp_size == 1:
            return None
        self.require_key()
        return self.positions < int(self._documents()[-1])

    def _doc_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each local token: position inside its document and the document's length (0 for padding)."""
        position = self.positions
        cu = self._documents().to(position.device)
        doc = (torch.searchsorted(cu, position, right=True) - 1).clamp(max=cu.numel() - 2)
        inside = position < cu[-1]
        return torch.where(inside, position - cu[doc], 0), torch.where(inside, cu[doc + 1] - cu[doc], 0)

    def roll_tensor(self, tensor, shifts=-1, dims=-1):
        """Roll in global order within each document; zero where the source leaves the document."""
        shifts, dims = check_shift(shifts), check_dim("roll_tensor dims", dims, tensor.dim())
        if self.handler.cp_size == 1:
            return alone_roll(self.handler, tensor, shifts, dims)
        self.require_key()
        tokens = tensor.movedim(dims, 0) if self.handler.qkv_format == "thd" else tensor.movedim(dims, 1)[0]
        if hasattr(self.handler.api, "roll"):
            rolled = self.handler.api.roll(tokens, shifts, 0, self.key)
        else:
            api = self.handler.api
            rolled = api.dispatch(torch.roll(api.undispatch(tokens, self.key), shifts, 0), self.key)
        position, length = self._doc_positions()
        valid = (position - shifts >= 0) & (position - shifts < length)
        rolled = rolled * valid.view(-1, *[1] * (rolled.dim() - 1)).to(rolled.dtype)
        rolled = rolled.movedim(0, dims) if self.handler.qkv_format == "thd" else rolled.unsqueeze(0).movedim(1, dims)
        return rolled, rolled.sum()

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        if self.handler.qkv_format == "thd":
            return int(torch.diff(self.handler.cu_seqlens).max())
        return self.batch_shape[1] if self.batch_shape else local_seq_len * self.handler.cp_size

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        if self.handler.cp_size == 1:
            if self.handler.qkv_format != "thd":
                return emb
            return emb.index_select(0, alone_positions(self.handler).to(emb.device))
        self.require_key()
        return emb.index_select(0, self._doc_positions()[0].to(emb.device))

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return apply_rotary(t, freqs, "thd")  # (T, H, D) or (1, T, H, D)


class MagiAttnContextParallelHandler(ContextParallelHandler):
    """Handler for backend ``"magi"``.

    Args:
        num_heads_q, num_heads_kv, head_dim: attention shape (the key of 1.1.x plans with them);
            ``head_dim <= 128``.
        causal: mask of the key (``core_attn`` must be called with the same mask type).
        **kwargs: as :class:`ContextParallelHandler` (``cp_group``, ``qkv_format``, ``cu_seqlens``).

    Raises:
        ImportError: magi_attention missing. RuntimeError: a release outside 1.0.4-1.1.1, no CUDA, or
        a non-NCCL group. ValueError: missing head shape, head_dim > 128.
    """

    token_layout_cls = MagiLayout
    cp_comm_types = ("p2p",)  # one nominal entry: MagiAttention plans its own communication

    def __init__(self, *, num_heads_q: int | None = None, num_heads_kv: int | None = None,
                 head_dim: int | None = None, causal: bool = True, **kwargs):
        super().__init__(**kwargs)
        if self.qkv_format == "sbhd":
            raise ValueError("backend='magi' takes qkv_format 'bshd' (squashed to packed tokens) or 'thd', not 'sbhd'")
        self.heads = (num_heads_q, num_heads_kv, head_dim)
        self.causal = causal
        self.api = import_backend("magi_attention.api", "magi_attention", MAGI_HINT)
        self.release = check_release(import_backend("magi_attention", "magi_attention", MAGI_HINT), self.api)
        require_cuda("magi")
        if self.cp_size > 1:
            require_nccl("magi", self.cp_group)
            if None in self.heads:
                raise ValueError("backend='magi' needs num_heads_q, num_heads_kv and head_dim when the handler is "
                                 f"built (its runtime key plans with them), got {self.heads}")
            if self.heads[2] > MAX_HEAD_DIM:
                raise ValueError(f"backend='magi': head_dim={self.heads[2]} must be <= {MAX_HEAD_DIM} "
                                 "(MagiAttention's FFA kernels)")

    @classmethod
    def check_config(cls, config, attn_shape=None, dtype=None) -> None:
        """MagiAttention's rules that need no rank: one head dim for q, k and v (at every cp); fp16/bf16 under CP;
        head_dim <= 128 (FFA)."""
        if attn_shape is not None and attn_shape.v_head_dim not in (None, attn_shape.head_dim):
            raise ValueError(f"backend='magi': v_head_dim={attn_shape.v_head_dim} differs from head_dim="
                             f"{attn_shape.head_dim} (multi-head latent attention); MagiAttention's kernel takes one "
                             "head_size for q, k and v: use backend='local' or 'transformer_engine'")
        if config.context_parallel_size == 1:
            return
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"backend='magi' attends in float16/bfloat16 only under context parallelism "
                             f"(cp={config.context_parallel_size}), not {dtype}")
        if attn_shape is not None and attn_shape.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"backend='magi': head_dim={attn_shape.head_dim} must be <= {MAX_HEAD_DIM} "
                             "(MagiAttention's FFA kernels)")

    @classmethod
    def from_config(cls, config, cp_group=None, hierarchical_cp_groups=None, attn_shape=None, **batch):
        """As the base class, with the attention shape MagiAttention's key plans with."""
        if attn_shape is not None:
            batch = {"num_heads_q": attn_shape.num_heads, "num_heads_kv": attn_shape.num_kv_heads,
                     "head_dim": attn_shape.head_dim, **batch}
        return super().from_config(config, cp_group, hierarchical_cp_groups, **batch)

    @classmethod
    def check_available(cls) -> None:
        api = import_backend("magi_attention.api", "magi_attention", MAGI_HINT)
        check_release(import_backend("magi_attention", "magi_attention", MAGI_HINT), api)
        require_cuda("magi")

    def check_call(self, call: AttnCall) -> None:
        """The mask of the handler's key; at cp > 1 a key (dispatch first), fp16/bf16, the key's heads."""
        if call.mask.causal != self.causal:
            raise ValueError(f"attn_mask_type={'causal' if call.mask.causal else 'no_mask'!r} must match the handler's "
                             f"key (causal={self.causal})")
        if call.v.shape[-1] != call.q.shape[-1]:  # at every cp: a model that runs at cp 1 runs at cp 2
            raise ValueError(f"backend='magi': v head dim {call.v.shape[-1]} differs from the q/k head dim "
                             f"{call.q.shape[-1]} (multi-head latent attention); MagiAttention's kernel takes one "
                             "head_size for q, k and v (flex_flash_fwd.hpp CHECK_SHAPE(v, ..., head_size)): use "
                             "backend='local' or 'transformer_engine'")
        if self.cp_size == 1:
            return
        self.token_layout.require_key()
        if call.q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"backend='magi': q has dtype {call.q.dtype}; MagiAttention computes in float16 or "
                             "bfloat16 only (cast the model, or use backend='local' for float32)")
        heads = (call.q.shape[1], call.k.shape[1], call.q.shape[3])
        if heads != self.heads:
            raise ValueError(f"backend='magi': q/k heads and head_dim {heads} differ from the handler's (num_heads_q, "
                             f"num_heads_kv, head_dim) = {self.heads}")

    def attend(self, call: AttnCall) -> torch.Tensor:
        q, k, v = (call.in_format(t).reshape(-1, *t.shape[1:2], t.shape[-1]) for t in (call.q, call.k, call.v))
        if self.cp_size == 1:  # (T_local, H, D)
            return alone_attn(self, q, k, v, call.scale, call.given.shape).reshape(call.out_shape)
        out = self.api.calc_attn(q, k, v, self.token_layout.key, softmax_scale=call.scale)[0]  # (out, lse or meta)
        return out.reshape(call.out_shape)
