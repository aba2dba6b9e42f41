"""Next-token training on a CP group: labels by a cross-rank roll (the handler's), a token-weighted loss.

The loss of a global batch is ``sum(token losses) / number of loss tokens``; each rank computes
the sum over its own tokens, and the count is reduced over every rank that holds part of the
batch (dp x cp: :func:`cp_handler.runtime.reductions.global_token_count`), so every token weighs the same however
the batch is split. Nothing here communicates except through the handler's methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..handlers.base import ContextParallelHandler
from .tiling import checkpointed_chunks


def next_token_batch(
    handler: ContextParallelHandler, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shard global ``tokens (B, S)`` int64 and build next-token targets.

    Returns:
        ``input_ids (B, S_local)``, ``labels (B, S_local)`` (the global roll by -1) and
        ``loss_mask (B, S_local)`` float32, zero where the label wrapped around (last position).
    """
    input_ids = handler.dispatch(tokens, seq_dim=1)
    labels, _ = handler.roll_tensor(input_ids, shifts=-1, dims=1)
    loss_mask, _ = handler.roll_tensor(torch.ones_like(input_ids, dtype=torch.float32), shifts=-1, dims=1)
    return input_ids, labels, loss_mask


def masked_token_losses(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (float32) of every token, zero where ``loss_mask`` is 0: flat, ``(tokens,)``."""
    losses = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    return losses * loss_mask.flatten()


def masked_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy (float32) over the tokens where ``loss_mask`` is 1."""
    return masked_token_losses(logits, labels, loss_mask).sum()


AUTO_CHUNK_TOKENS = 4096
"""Tokens per chunk of the automatic chunked loss (:func:`loss_chunk_tokens`)."""
AUTO_CHUNK_BYTES = 2**28
"""The automatic chunked loss engages when a rank's float32 logits would exceed this (256 MiB)."""


def loss_chunk_tokens(requested: int | None, rows: int, vocab_size: int) -> int | None:
    """Tokens per chunk of the loss for ``rows`` local tokens (``None``: the whole loss at once). ``requested``:
    ``None`` = automatic (chunks of :data:`AUTO_CHUNK_TOKENS` when there is more than one chunk and ``rows x
    vocab_size`` float32 logits exceed :data:`AUTO_CHUNK_BYTES`: there the logits dominate a rank's memory;
    below, the recomputed head costs time and saves little), ``0`` = whole, ``N > 0`` = chunks of ``N`` tokens."""
    if requested is None:
        return AUTO_CHUNK_TOKENS if rows * vocab_size * 4 > AUTO_CHUNK_BYTES and rows > AUTO_CHUNK_TOKENS else None
    return requested if 0 < requested < rows else None


def token_losses(hidden: torch.Tensor, head, labels: torch.Tensor, loss_mask: torch.Tensor,
                 chunk_tokens: int | None = None) -> torch.Tensor:
    """:func:`masked_token_losses` of ``head(hidden)`` without holding the rank's whole logits.

    Args:
        hidden: ``(B, S_local, H)`` the model's last hidden states; head: ``hidden -> logits (..., V)`` (the
            output norm and projection, and any transform of the logits), applied per token.
        labels / loss_mask: ``(B, S_local)``.
        chunk_tokens: ``None``: the whole loss at once; else the tokens are cut into chunks of this many, each
            chunk's logits and cross-entropy computed and dropped, then recomputed in the backward
            (non-reentrant ``torch.utils.checkpoint``): at most ``chunk_tokens x V`` logits exist at a time, for
            one extra forward of the head (Liger's and TRL's chunked losses do the same with fused kernels).

    Returns:
        float32 ``(B * S_local,)``: each token's loss, zero where ``loss_mask`` is 0.
    """
    if chunk_tokens is None:
        return masked_token_losses(head(hidden), labels, loss_mask)
    return torch.cat(checkpointed_chunks(lambda h, lab, mask: masked_token_losses(head(h), lab, mask), chunk_tokens,
                                         hidden.flatten(0, -2), labels.flatten(), loss_mask.flatten()))


def token_loss_sum(hidden: torch.Tensor, head, labels: torch.Tensor, loss_mask: torch.Tensor,
                   chunk_tokens: int | None = None) -> torch.Tensor:
    """The float32 sum of :func:`token_losses` (arguments as there): this rank's masked tokens' loss (equal to the
    whole loss up to float32 reordering)."""
    return token_losses(hidden, head, labels, loss_mask, chunk_tokens).sum()


def canonical_loss_sum(hidden: torch.Tensor, head, labels: torch.Tensor, loss_mask: torch.Tensor, handler,
                       chunk_tokens: int | None = None) -> torch.Tensor:
    """The float32 sum of the masked token losses of the whole sequence, bitwise the same on every rank of the CP
    group and at every CP degree when the per-token losses are (the deterministic mode, docs/deterministic.md):
    each rank's ``(B, S_local)`` losses (:func:`token_losses`) are put in global order over the group
    (``handler.combine``, whose backward keeps this rank's tokens) and summed one token after another in that order
    (a cumulative sum: an order that depends on neither the group nor the thread count). One all-gather of ``B x S``
    floats per call.

    Args:
        hidden / head / labels / loss_mask / chunk_tokens: as :func:`token_losses`.
        handler: the forward's CP handler (``combine`` over its group; the identity at cp = 1).

    Returns:
        float32 scalar: the whole sequence's sum (the group's, not this rank's share).
    """
    losses = token_losses(hidden, head, labels, loss_mask, chunk_tokens).view(labels.shape)
    return handler.combine(losses, 1).flatten().cumsum(0)[-1]


@dataclass(frozen=True)
class TokenLoss:
    """A model's ``output`` (the model protocol: ``model(input_ids, cp_handler=..., output=TokenLoss(...))``): the
    float32 sum of the masked token losses, :func:`token_loss_sum` of the model's ``head`` and last hidden states,
    the whole logits never held when ``chunk_tokens`` is set. ``labels`` / ``loss_mask``: ``(B, S_local)``.
    ``canonical``: the forward's handler in the deterministic mode: the whole sequence's sum on every rank of the
    group, in one order at every CP degree (:func:`canonical_loss_sum`); ``None``: this rank's tokens' sum."""

    labels: torch.Tensor
    loss_mask: torch.Tensor
    chunk_tokens: int | None = None
    canonical: object = None

    def __call__(self, head, hidden: torch.Tensor) -> torch.Tensor:
        if self.canonical is not None:
            return canonical_loss_sum(hidden, head, self.labels, self.loss_mask, self.canonical, self.chunk_tokens)
        return token_loss_sum(hidden, head, self.labels, self.loss_mask, self.chunk_tokens)


@dataclass(frozen=True)
class LogitsAt:
    """A model's ``output``: the logits of the local rows ``rows`` (1-D int64) only, ``(B, len(rows), V)``
    (generation's last tokens)."""

    rows: torch.Tensor

    def __call__(self, head, hidden: torch.Tensor) -> torch.Tensor:
        return head(hidden[:, self.rows])
