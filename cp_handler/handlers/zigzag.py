"""The zigzag (DualChunkSwap) token layout: the default :class:`~.token_layout.TokenLayout` of a handler.

The local and Transformer Engine backends share this layout, so one batch can go through either;
they differ only in their attention step. bshd/sbhd: every sequence is split into ``2 * cp`` chunks.
thd (packed documents, ``cu_seqlens``): every document is padded to a multiple of ``2 * cp``
(``cu_seqlens_padded``) and split on its own, as Transformer Engine's
``thd_get_partitioned_indices``; dispatch inserts the padding, combine removes it.
Tensors of a thd handler are ``(T, ...)`` along ``seq_dim``; a leading batch dim of 1 is fine.
"""

from __future__ import annotations

import torch

from ..core.layout import ZigzagDocs
from ..ops.roll import zigzag_roll
from ..ops.seq_gather import all_gather_seq
from ..runtime.config import check_seq_len
from ..runtime.rope import apply_rotary
from .checks import check_dim, check_shift
from .mixers import ZigzagMixers
from .token_layout import TokenLayout


class ZigzagLayout(TokenLayout):
    """dispatch / combine / roll / RoPE for the zigzag layout (rank r holds chunks r and 2cp-1-r); the mixer
    methods run on it (:class:`~.mixers.ZigzagMixers`)."""

    mixers_cls = ZigzagMixers

    def __init__(self, handler):
        super().__init__(handler)
        self.cp_size, self.cp_rank, self.cp_group = handler.cp_size, handler.cp_rank, handler.cp_group
        self.qkv_format, self.checked = handler.qkv_format, handler.agreement.checked
        self.thd_layout = None
        self._call_layouts: dict[tuple[int, int | None], ZigzagDocs] = {}
        self.global_seq_len: int | None = None
        """bshd/sbhd: the sequence length this handler dispatched (a handler is per batch); thd: from cu_seqlens."""
        if self.qkv_format == "thd":
            self.thd_layout = ZigzagDocs.from_cu_seqlens(handler.cu_seqlens, self.cp_size, handler.deterministic)
            self.global_seq_len = sum(self.thd_layout.lengths)

    @property
    def pads_alone(self) -> bool:
        """Whether thd documents are padded at cp = 1 too (the deterministic mode): dispatch and combine are then no
        identity at cp = 1 (they insert and drop the padding)."""
        return self.thd_layout is not None and self.thd_layout.padded_lengths != self.thd_layout.lengths

    @property
    def cu_seqlens_padded(self) -> torch.Tensor | None:
        """thd: int32 ``[num_docs + 1]`` offsets of the documents padded to multiples of ``2 * cp``."""
        return None if self.thd_layout is None else self.thd_layout.cu_seqlens_padded

    @property
    def max_seqlen(self) -> int | None:
        """thd: length of the longest real document (:attr:`TokenLayout.max_seqlen`)."""
        return None if self.thd_layout is None else max(self.thd_layout.lengths)

    @property
    def document_lengths(self) -> tuple[int, ...] | None:
        """thd: every document's length (:attr:`TokenLayout.document_lengths`)."""
        return None if self.thd_layout is None else tuple(self.thd_layout.lengths)

    @property
    def padded_document_lengths(self) -> tuple[int, ...] | None:
        """thd: every document padded to a multiple of ``2 * cp`` at cp > 1 (at cp 1 unpadded, but in the
        deterministic mode: :func:`~cp_handler.core.layout.padded_length`); the base's
        :attr:`~.token_layout.TokenLayout.padded_document_lengths`."""
        return None if self.thd_layout is None else tuple(self.thd_layout.padded_lengths)

    def token_index(self, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The zigzag slots' tokens among the batch's real tokens (:meth:`TokenLayout.token_index`; ValueError: a
        local length this batch does not have)."""
        return self.layout(local_len).dispatch_index(self.cp_rank).to(device)

    def real_token_mask(self) -> torch.Tensor | None:
        """thd: this rank's slots that hold tokens of the documents (not their padding to ``2 * cp``); bshd/sbhd:
        ``None``, every slot (:meth:`TokenLayout.real_token_mask`)."""
        return None if self.thd_layout is None else self.thd_layout.real_mask(self.cp_rank)

    @property
    def layout_description(self) -> str:
        """This batch's layout in words (thd: its documents' lengths, from cu_seqlens), compared across ranks."""
        if self.thd_layout is None:
            return "no documents (bshd/sbhd)"
        return f"document lengths {list(self.thd_layout.lengths)}"

    def layout(self, local_len: int) -> ZigzagDocs:
        """The layout of a local tensor with ``local_len`` tokens along its sequence dim.

        Raises:
            ValueError: bshd/sbhd: an odd local length at cp > 1 (every rank holds two equal zigzag
                chunks); thd: a length that is not the padded local length of this batch (at cp=1:
                ``cu_seqlens[-1]``).
        """
        if local_len < 1:
            raise ValueError(f"a local sequence of {local_len} tokens: every rank holds at least one token (the global "
                             f"sequence must have at least 2 * cp = {2 * self.cp_size} tokens)")
        if self.thd_layout is None:
            if self.cp_size > 1 and self.global_seq_len is not None and local_len * self.cp_size != self.global_seq_len:
                per_rank = self.global_seq_len // self.cp_size
                raise ValueError(f"a local tensor of {local_len} tokens along its sequence dim, but this handler "
                                 f"dispatched sequences of {self.global_seq_len} tokens ({per_rank} per rank): a "
                                 "handler is built per batch, with one sequence length")
            if self.cp_size > 1 and local_len % 2:
                raise ValueError(f"local sequence length {local_len} is odd: under the zigzag layout every rank holds "
                                 f"two equal chunks (global length {local_len} * cp must divide by 2 * cp = "
                                 f"{2 * self.cp_size})")
            return ZigzagDocs.uniform(local_len * self.cp_size, self.cp_size)
        if local_len != self.thd_layout.local_len:
            raise ValueError(
                f"thd tensor has {local_len} local tokens, but this batch's cu_seqlens give "
                f"{self.thd_layout.local_len} per rank (documents padded to multiples of 2*cp, divided by cp)"
            )
        return self.thd_layout

    def call_layout(self, local_len: int) -> ZigzagDocs:
        """The pre-flight's layout of a ``core_attn`` call (:meth:`layout`: the local length checked; memoised per
        local length and dispatched length: every layer of a batch asks the same)."""
        key = (local_len, self.global_seq_len)
        layout = self._call_layouts.get(key)
        if layout is None:
            layout = self._call_layouts[key] = self.layout(local_len)
        return layout

    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Global tensor -> this rank's shard (thd: padding inserted as zeros). Every dispatch checks that every rank
        of the CP group passed its checks with the same length (one all-gather of a few int64 per call: a rank
        refused alone, e.g. a handler reused for a batch whose length differs by rank, would leave the others in
        their next collective); the shard itself communicates nothing.

        Raises:
            ValueError: bshd/sbhd ``S`` not divisible by ``2 * cp``; thd length not ``cu_seqlens[-1]``; a length
                other than this handler's first dispatch's; ranks of the CP group with different lengths (every
                rank raises, naming each rank's).
        """
        def local_checks():
            dim = check_dim("seq_dim", seq_dim, tensor.dim())
            length = tensor.shape[dim]
            if self.thd_layout is not None and length != self.global_seq_len:
                raise ValueError(f"thd tensor has {length} tokens along dim {dim}, cu_seqlens[-1] = "
                                 f"{self.global_seq_len}")
            if length < 1:
                raise ValueError(f"dispatch: a sequence of {length} tokens along dim {dim}: nothing to shard")
            if self.cp_size > 1 and self.global_seq_len is not None and length != self.global_seq_len:
                raise ValueError(f"dispatch: a tensor of {length} tokens along dim {dim}, but this handler "
                                 f"dispatched sequences of {self.global_seq_len} tokens: it is a shard already, or "
                                 "from another batch (a handler is built per batch)")
            if self.cp_size > 1 and self.thd_layout is None:
                check_seq_len(length, self.cp_size, self.qkv_format)
            return {"global_len": length}

        self.checked("dispatch", tensor.device, ("global_len",), local_checks, every_call=True)
        seq_dim = seq_dim % tensor.dim()
        if self.cp_size == 1 and not self.pads_alone:  # the identity: a handler alone may take any length
            return tensor
        if self.thd_layout is None:
            length = tensor.shape[seq_dim]
            self.global_seq_len = length
            layout = self.layout(length // self.cp_size)
        else:
            layout = self.thd_layout
            pad = tensor.new_zeros((*tensor.shape[:seq_dim], 1, *tensor.shape[seq_dim + 1:]))
            tensor = torch.cat([tensor, pad], dim=seq_dim)
        return tensor.index_select(seq_dim, layout.dispatch_index(self.cp_rank).to(tensor.device))

    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Local shard -> global tensor (thd: real tokens only): one all-gather over the CP group.

        Backward keeps this rank's slice of the gradient (the combined tensor is assumed to feed
        the same computation on every CP rank).
        """
        if self.cp_size == 1:
            dim = check_dim("seq_dim", seq_dim, tensor.dim())
            if not self.pads_alone:
                return tensor
            return tensor.index_select(dim, self.layout(tensor.shape[dim]).gathered_index(real_only=True).to(
                tensor.device))

        def local_checks():
            if self.global_seq_len is None:
                raise ValueError(f"combine: this handler dispatched nothing, so a tensor {tuple(tensor.shape)} cannot "
                                 "be known to be a shard; dispatch the batch with this handler first (one handler "
                                 "per batch)")
            self.layout(tensor.shape[check_dim("seq_dim", seq_dim, tensor.dim())])
            return {"local_len": tensor.shape[seq_dim], "layout": self.layout_description}

        self.checked("combine", tensor.device, ("local_len", "layout"), local_checks, every_call=True)
        seq_dim = seq_dim % tensor.dim()
        layout = self.layout(tensor.shape[seq_dim])
        index = layout.gathered_index(real_only=True).to(tensor.device)
        return all_gather_seq(tensor, seq_dim, self.cp_group).index_select(seq_dim, index)

    def roll_tensor(self, tensor: torch.Tensor, shifts: int = -1, dims: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll along the sequence dim ``dims`` by ``shifts`` in global order, within each document
        (thd); positions whose source lies outside the document, and padding, are zero.

        Raises:
            TypeError: ``shifts`` or ``dims`` not a single int (bools refused).
            ValueError: ``dims`` out of range; ``|shifts|`` larger than a zigzag chunk; ranks of the
                CP group with different lengths, layouts or shifts.
        """
        def local_checks():
            self.layout(tensor.shape[check_dim("roll_tensor dims", dims, tensor.dim())])
            return {"local_len": tensor.shape[dims], "layout": self.layout_description, "shifts": check_shift(shifts)}

        self.checked("roll_tensor", tensor.device, ("local_len", "layout", "shifts"), local_checks, every_call=True)
        dims = dims % tensor.dim()
        rolled = zigzag_roll(tensor, shifts, dims, self.cp_group, self.layout(tensor.shape[dims]))
        return rolled, rolled.sum()

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        """bshd/sbhd: ``local_seq_len * cp_size``; thd: the longest padded document."""
        if self.thd_layout is not None:
            return max(self.thd_layout.padded_lengths)
        return local_seq_len * self.cp_size

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        """Rows ``emb[position of each local token]``; thd positions restart at every document."""
        if self.thd_layout is None:
            if self.cp_size == 1:
                return emb
            layout = self.layout(emb.shape[0] // self.cp_size)
        else:
            layout = self.thd_layout
        return emb.index_select(0, layout.positions(self.cp_rank).to(emb.device))

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE on ``t`` in this handler's qkv_format; ``freqs (S_local, D)`` float32 angles
        (thd: ``t`` is ``(T, H, D)`` or ``(1, T, H, D)``)."""
        return apply_rotary(t, freqs, self.qkv_format)
