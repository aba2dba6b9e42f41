"""The token-layout component of a handler: where each token of the global sequence sits on the ranks of the CP
group, and the six layout methods of the contract that follow from it.

A handler holds one (``handler.token_layout``, built from its class's ``token_layout_cls``); its public methods
``dispatch``, ``combine``, ``roll_tensor``, ``get_rotary_seq_len``, ``get_emb_on_this_cp_rank`` and
``apply_rotary_pos_emb`` run the component's (the first three under the handler's call guard). The zigzag layout
(:class:`~.zigzag.ZigzagLayout`) is the default; a backend with its own placement of tokens (MagiAttention's
dispatcher, a decode step) brings its own subclass of :class:`TokenLayout`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .mixers import Mixers


class TokenLayout(ABC):
    """A handler's token layout (module doc). Subclasses implement the six methods below; the handler
    (``self.handler``) gives the group, rank, size, ``qkv_format``, ``cu_seqlens`` and the rank agreement.

    Args:
        handler: the :class:`~.base.ContextParallelHandler` it belongs to (built in its ``__init__``, after the
            handler's own fields).
    """

    mixers_cls: type[Mixers] = Mixers
    """The mixer component that runs on this layout (default: every mixer method refused by name)."""

    def __init__(self, handler):
        self.handler = handler

    def call_layout(self, local_len: int):
        """The batch's documents for a ``core_attn`` call of ``local_len`` local tokens (checked: ValueError), or
        ``None`` (a layout the pre-flight does not describe: the backend plans its own)."""
        return None

    @abstractmethod
    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Global tensor -> this rank's shard along ``seq_dim``; backward: the gradient in the global layout."""

    @abstractmethod
    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Local shard -> global tensor in the original token order (inverse of :meth:`dispatch`)."""

    @abstractmethod
    def roll_tensor(self, tensor: torch.Tensor, shifts: int, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.roll`` in global token order (within documents); wrapped positions zero; ``(rolled, sum)``."""

    @abstractmethod
    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        """Rows of the rotary table this batch needs."""

    @abstractmethod
    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        """Rows of a per-position table ``emb (S_global, ...)`` for this rank's local tokens."""

    @abstractmethod
    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE at the global positions of the local tokens (``freqs`` from :meth:`get_emb_on_this_cp_rank`)."""

    def real_token_mask(self) -> torch.Tensor | None:
        """bool ``(S_local,)``: which of this rank's local slots hold tokens of the batch (``False``: padding the
        layout adds, e.g. thd documents padded to multiples of ``2 * cp``); ``None``: every slot does (the layout
        adds none). A loss that counts tokens (a MoE model's load-balancing loss, a token count) takes its real
        tokens from here, never from a tensor's shape.

        Raises:
            NotImplementedError: a layout that does not say (the base class): a loss counting its padding would be
                silently wrong, so it is refused instead.
        """
        raise NotImplementedError(f"{type(self).__name__} does not say which of its local slots hold real tokens "
                                  "(TokenLayout.real_token_mask): a loss that counts tokens cannot run on it")
