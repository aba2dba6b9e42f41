"""The handler of one decode step: one new token per sequence, attended to the KV cache sharded over the group.

Every rank runs the whole (tiny) forward of the new tokens; only attention is split: each rank attends
the new queries to its own cache shard (and the new token's K/V, on the rank that will keep it), and
the partial results are merged by log-sum-exp after one all-gather of ``(out, lse)`` per layer
(``B x H x (D + 1)`` floats), so every rank gets the same exact output (Meta's pass-Q decode, arXiv
2411.01783, without the ring: the query is one token). The model calls the same seven methods as in
training: the new tokens are one thd batch of ``B`` one-token sequences at their global positions.

Attention variants (:mod:`cp_handler.masks`) are exact as in training: the cache keeps each row's
position, so a sliding window or chunks mask the rows by position (:meth:`AttentionMask.visible`), a
soft-cap caps the scaled scores before the softmax, and learnable sinks are folded in once, after the
merge (:func:`~cp_handler.ops.sinks.fold_sinks`), never per shard. After a window or chunked layer's
step, the rows no later query of their sequence may see are dropped from the cache.
"""

from __future__ import annotations

import torch

from ..handlers.base import ContextParallelHandler
from ..handlers.checks import check_qkv, softmax_scale
from ..masks import AttentionMask
from ..ops.collectives import all_gather_single
from ..ops.merge import acc_dtype
from ..ops.sinks import fold_sinks
from ..rope import apply_rotary
from .cache import KVCache


class DecodeHandler(ContextParallelHandler):
    """One decode step over ``cache`` (build it right before the step's forward: it assigns the new tokens'
    positions and owners).

    Shapes: the model's ``input_ids`` are ``(1, B)`` (one new token per sequence); ``core_attn`` takes q
    ``(1, B, H, D)`` or ``(B, H, D)`` and k, v with ``Hkv`` heads, and returns the output shaped like q.

    Raises:
        ValueError: decode before the prefill finished; a cache of another CP group; a tensor that is not
            this step's ``B`` tokens; an invalid attention variant attribute (:func:`~..handlers.checks.
            attention_variant`); a non-causal mask.
    """

    def __init__(self, cache: KVCache, *, cp_group=None, check_ranks: bool | None = None):
        cache.check_group(cp_group, "DecodeHandler")
        if not cache.prefilled:
            raise ValueError("DecodeHandler: decode before prefill: run the prompt through a prefill handler with this "
                             "cache (cp_handler.inference.prefill_handler) and call cache.finish_prefill() first")
        batch = len(cache.lengths)
        super().__init__(cp_group=cp_group, qkv_format="thd", check_ranks=check_ranks,
                         cu_seqlens=torch.arange(batch + 1, dtype=torch.int32))
        self.kv_cache = cache
        self.owners, self.positions = cache.next_token_owners()

    def _check_tokens(self, length: int, what: str) -> None:
        if length != len(self.positions):
            raise ValueError(f"{what}: a decode step takes one new token per sequence ({len(self.positions)}), got "
                             f"{length}")

    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Every rank computes the new tokens: the identity (checked: ``B`` tokens along ``seq_dim``)."""
        self._check_tokens(tensor.shape[seq_dim], "dispatch")
        return tensor

    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """The identity: every rank holds the same new tokens' results."""
        self._check_tokens(tensor.shape[seq_dim], "combine")
        return tensor

    def roll_tensor(self, tensor: torch.Tensor, shifts: int = -1, dims: int = -1):
        raise ValueError("roll_tensor: a decode step has no labels to shift (it is for training batches)")

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        """One past the largest new position."""
        self._check_tokens(local_seq_len, "get_rotary_seq_len")
        return max(self.positions) + 1

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        """Rows ``emb[position of each new token]``."""
        return emb.index_select(0, torch.tensor(self.positions, device=emb.device))

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            return apply_rotary(t.squeeze(0), freqs, "thd").unsqueeze(0)
        return apply_rotary(t, freqs, "thd")

    def core_attn(self, attn_mod, q, k, v, *, attn_mask_type: str = "causal") -> torch.Tensor:
        if attn_mask_type != "causal":
            raise ValueError(f"attn_mask_type={attn_mask_type!r}: a decode step attends causally to the cache")
        q3, k3, v3 = (t.squeeze(0) if t.dim() == 4 else t for t in (q, k, v))
        check_qkv(q3, k3, v3, seq_dim=0)
        self._check_tokens(q3.shape[0], "core_attn")
        mask, sinks = self.attention_variant(attn_mod, attn_mask_type, q3, q3.shape[1])
        shard = self.kv_cache.layer(getattr(attn_mod, "layer_number", 0))
        for i, owner in enumerate(self.owners):
            if owner == self.cp_rank:
                shard.append(k3[i], v3[i], i, self.positions[i])
        q_pos = torch.tensor(self.positions, device=q3.device)
        out, lse = _attend(q3, q_pos, *shard.rows(), softmax_scale(attn_mod, q3.shape[-1]), mask)
        if mask.restricted:  # rows the next query of their sequence cannot see, no later one can (monotone)
            seq, pos = shard.rows()[2:]
            shard.keep(mask.visible(q_pos[seq] + 1, pos))
        if self.cp_size > 1:
            out, lse = _merge_over_ranks(out, lse, self.cp_group)
        if sinks is not None:
            out = fold_sinks(out.unsqueeze(2), lse.unsqueeze(2), sinks)[0].squeeze(2)
        return out.to(q.dtype).reshape(q.shape)

    def unsupported_variant(self, comm_type: str, mask, sinks) -> str | None:
        """Every variant runs here (see the module doc)."""
        return None


def _attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor,
            pos: torch.Tensor, scale: float, mask: AttentionMask):
    """``q (B, H, D)`` of sequence ``i`` at position ``q_pos[i]`` against this rank's rows of sequence ``i``
    (at positions ``pos``) that ``mask`` lets it see: ``(out (B, H, D), lse (B, H))`` in the accumulation
    dtype; a sequence with no visible rows here gets ``out = 0`` and the lowest finite lse (it weighs
    nothing in the merge)."""
    dtype = acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]  # GQA: each KV head serves this many query heads
    keys, values = (t.repeat_interleave(groups, dim=1).transpose(0, 1).to(dtype) for t in (k, v))  # (H, N, D)
    scores = torch.einsum("bhd,hnd->bhn", q.to(dtype), keys) * scale
    if mask.softcap is not None:
        scores = torch.tanh(scores / mask.softcap) * mask.softcap
    mine = seq[None, None, :] == torch.arange(q.shape[0], device=q.device)[:, None, None]
    mine = mine & mask.visible(q_pos[:, None, None], pos[None, None, :])
    scores = scores.masked_fill(~mine, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = torch.einsum("bhn,hnd->bhd", probs, values)
    return out, lse.masked_fill(empty, torch.finfo(dtype).min)


def _merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of every rank's ``(out (B, H, D), lse (B, H))``: one all-gather; the same on every rank."""
    local = torch.cat([out, lse.unsqueeze(-1)], dim=-1).unsqueeze(0).contiguous()  # (1, B, H, D + 1)
    gathered = local.new_empty((torch.distributed.get_world_size(group), *local.shape[1:]))
    all_gather_single(gathered, local, group)
    outs, lses = gathered[..., :-1], gathered[..., -1]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).unsqueeze(-1)
    return (weights * outs).sum(0), total
