"""Token-layout half of the contract for every backend that uses the zigzag (DualChunkSwap) layout.

The local and Transformer Engine backends share this layout, so one batch can go through either;
they differ only in :meth:`core_attn`.
"""

from __future__ import annotations

import torch

from ..config import check_seq_len
from ..layout import zigzag_shard, zigzag_unshard
from ..ops.roll import zigzag_roll
from ..ops.seq_gather import all_gather_seq
from ..rope import apply_rotary
from .base import ContextParallelHandler


class ZigzagContextParallelHandler(ContextParallelHandler):
    """dispatch / combine / roll / RoPE for the zigzag layout (rank r holds chunks r and 2cp-1-r)."""

    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """``(..., S, ...)`` -> ``(..., S / cp, ...)``; no communication.

        Raises:
            ValueError: ``S`` not divisible by ``2 * cp``.
        """
        if self.cp_size == 1:
            return tensor
        check_seq_len(tensor.shape[seq_dim], self.cp_size, self.qkv_format)
        return zigzag_shard(tensor, seq_dim, self.cp_rank, self.cp_size)

    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """``(..., S / cp, ...)`` -> ``(..., S, ...)``: one all-gather over the CP group.

        Backward keeps this rank's slice of the gradient (the combined tensor is assumed to feed
        the same computation on every CP rank).
        """
        if self.cp_size == 1:
            return tensor
        return zigzag_unshard(all_gather_seq(tensor, seq_dim, self.cp_group), seq_dim, self.cp_size)

    def roll_tensor(self, tensor: torch.Tensor, shifts: int = -1, dims: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll along the sequence dim ``dims`` by ``shifts`` (``|shifts| <= S / (2 cp)``) in global order.

        Raises:
            TypeError: ``shifts`` or ``dims`` not a single int.
            ValueError: ``|shifts|`` larger than a zigzag chunk.
        """
        if not isinstance(shifts, int) or not isinstance(dims, int):
            raise TypeError(f"roll_tensor takes one int shift and one int dim, got shifts={shifts!r}, dims={dims!r}")
        rolled = zigzag_roll(tensor, shifts, dims % tensor.dim(), self.cp_group if self.cp_size > 1 else None)
        return rolled, rolled.sum()

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        """``local_seq_len * cp_size``: the global sequence length."""
        return local_seq_len * self.cp_size

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        """Rows ``emb[positions of local tokens]`` of a table ``(S_global, ...)``."""
        if self.cp_size == 1:
            return emb
        return zigzag_shard(emb, 0, self.cp_rank, self.cp_size)

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE on ``t`` in this handler's qkv_format; ``freqs (S_local, D)`` float32 angles."""
        return apply_rotary(t, freqs, self.qkv_format)
