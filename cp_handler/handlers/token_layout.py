"""The token-layout component of a handler: where each token of the global sequence sits on the ranks of the CP
group, and the six layout methods of the contract that follow from it.

A handler holds one (``handler.token_layout``, built from its class's ``token_layout_cls``); its public methods
``dispatch``, ``combine``, ``roll_tensor``, ``get_rotary_seq_len``, ``get_emb_on_this_cp_rank`` and
``apply_rotary_pos_emb`` run the component's (the first three under the handler's call guard). The zigzag layout
(:class:`~.zigzag.ZigzagLayout`) is the default; a backend with its own placement of tokens (MagiAttention's
dispatcher, a decode step) brings its own subclass of :class:`TokenLayout`.

Beside the contract's six methods, the layout answers what code outside the handler needs to know about the batch
(the public API, docs/api.md "The token layout"; code outside ``cp_handler/handlers/`` reads a layout through it
alone, which tests/test_channels.py holds):

* :meth:`positions` -- the global position of every local slot;
* :meth:`real_token_mask` -- which local slots hold tokens of the batch (not padding the layout adds);
* :attr:`max_seqlen`, :attr:`document_lengths` and :attr:`padded_document_lengths` -- the longest document, every
  document's length, and as the layout holds it with its padding (thd);
* :meth:`token_index` -- the index of every local slot's token among the batch's real tokens;
* :meth:`max_position` -- the largest position of a real token in the whole batch, the same on every rank (what
  RoPE that reads the sequence length needs), with :meth:`set_max_position` for a model that computes its own
  positions (a vision-language model's mRoPE).
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
        self._model_max_position: int | torch.Tensor | None = None

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

    @property
    def max_seqlen(self) -> int | None:
        """The length of the longest real document (thd); ``None``: the layout does not hold documents (bshd/sbhd,
        where :meth:`get_rotary_seq_len` gives the sequence length)."""
        return None

    @property
    def document_lengths(self) -> tuple[int, ...] | None:
        """thd: every document's length in tokens, in the batch's order (not padded); ``None`` otherwise."""
        return None

    @property
    def padded_document_lengths(self) -> tuple[int, ...] | None:
        """thd: every document's length as the layout holds it over the group (its real tokens plus the padding the
        layout adds, e.g. up to a multiple of ``2 * cp``), in the batch's order; ``None`` otherwise."""
        return None

    def token_index(self, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 ``(S_local,)``: for each of the ``local_len`` local slots, the index of its token in the batch's
        real tokens in order (thd: the documents packed without their padding; bshd/sbhd: its position in the
        row), and the number of real tokens at the padding slots the layout adds.

        Raises:
            NotImplementedError: a layout holding documents that does not say (the base class).
        """
        if self.document_lengths is not None:
            raise NotImplementedError(f"{type(self).__name__} does not say where its documents' tokens sit "
                                      "(TokenLayout.token_index)")
        return self.positions(local_len, device)

    def positions(self, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 ``(S_local,)``: the global position of each of the ``local_len`` local slots (thd: restarting per
        document; ``0`` at the padding slots the layout adds), as a model's rotary embedding takes them."""
        table = self.get_emb_on_this_cp_rank(torch.arange(self.get_rotary_seq_len(local_len), device=device))
        real = self.real_token_mask()
        return table if real is None else torch.where(real.to(table.device), table, 0)

    def max_position(self, local_len: int) -> int | torch.Tensor:
        """The largest position of a real token in the whole batch, the same on every rank: the one
        :meth:`set_max_position` gave, else ``max_seqlen - 1``, else ``get_rotary_seq_len(local_len) - 1``."""
        if self._model_max_position is not None:
            return self._model_max_position
        longest = self.max_seqlen
        return (longest if longest is not None else self.get_rotary_seq_len(local_len)) - 1

    def set_max_position(self, position: int | torch.Tensor) -> None:
        """The batch's largest position where the model computed positions itself (a vision-language model's mRoPE
        positions: an int or a 0-d tensor, no device sync); :meth:`max_position` returns it from now on (a handler
        is per batch)."""
        self._model_max_position = position
