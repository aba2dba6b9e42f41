"""The handler of one decode step: one new token per sequence, attended to the KV cache sharded over the group.

Every rank runs the whole (tiny) forward of the new tokens; only attention is split: each rank attends
the new queries to its own cache shard (and the new token's K/V, on the rank that will keep it), and
the partial results are merged by log-sum-exp after one all-gather of ``(out, lse)`` per layer
(``B x H x (Dv + 1)`` floats, ``Dv`` the value head dim), so every rank gets the same exact output (Meta's
pass-Q decode, arXiv 2411.01783, without the ring: the query is one token). The model calls the same seven methods as in
training: the new tokens are one thd batch of ``B`` one-token sequences at their global positions.

Attention variants (:mod:`cp_handler.core.masks`) are exact as in training: the cache keeps each row's
position, so a sliding window or chunks mask the rows by position (:meth:`AttentionMask.visible`), a
soft-cap caps the scaled scores before the softmax, and learnable sinks are folded in once, after the
merge (:func:`~cp_handler.ops.sinks.fold_sinks`), never per shard. After a window or chunked layer's
step, the rows no later query of their sequence may see are dropped from the cache.
"""

from __future__ import annotations

import torch

from ..core.masks import AttentionMask
from ..handlers.base import ContextParallelHandler
from ..handlers.preflight import AttnCall
from ..handlers.token_layout import TokenLayout
from ..ops.collectives import all_gather_single
from ..ops.kernels.masked import softmax_out, visible_scores
from ..ops.merge import merge_attn_out_
from ..ops.sinks import fold_sinks
from ..runtime.rope import apply_rotary
from .cache import KVCache


class DecodeLayout(TokenLayout):
    """The token layout of a decode step: every rank holds the step's ``B`` new tokens (one per sequence) at their
    global positions; no mixer method runs (generation of models with such mixers is not implemented)."""

    def check_tokens(self, length: int, what: str) -> None:
        if length != len(self.handler.positions):
            raise ValueError(f"{what}: a decode step takes one new token per sequence "
                             f"({len(self.handler.positions)}), got {length}")

    def dispatch(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Every rank computes the new tokens: the identity (checked: ``B`` tokens along ``seq_dim``)."""
        self.check_tokens(tensor.shape[seq_dim], "dispatch")
        return tensor

    def combine(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """The identity: every rank holds the same new tokens' results."""
        self.check_tokens(tensor.shape[seq_dim], "combine")
        return tensor

    def roll_tensor(self, tensor: torch.Tensor, shifts: int = -1, dims: int = -1):
        raise ValueError("roll_tensor: a decode step has no labels to shift (it is for training batches)")

    def real_token_mask(self) -> None:
        """Every slot holds a new token (:meth:`TokenLayout.real_token_mask`)."""
        return None

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        """One past the largest new position."""
        self.check_tokens(local_seq_len, "get_rotary_seq_len")
        return max(self.handler.positions) + 1

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        """Rows ``emb[position of each new token]``."""
        return emb.index_select(0, torch.tensor(self.handler.positions, device=emb.device))

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return apply_rotary(t, freqs, "thd")  # (B, H, D) or (1, B, H, D)


class DecodeHandler(ContextParallelHandler):
    """One decode step over ``cache`` (build it right before the step's forward: it assigns the new tokens'
    positions and owners).

    Shapes: the model's ``input_ids`` are ``(1, B)`` (one new token per sequence); ``core_attn`` takes q
    ``(1, B, H, D)`` or ``(B, H, D)`` and k, v with ``Hkv`` heads (v of its own head dim ``Dv``: MLA), and returns
    the output shaped like q with ``Dv``.

    Raises:
        ValueError: decode before the prefill finished; a cache of another CP group; a tensor that is not
            this step's ``B`` tokens; an invalid attention variant attribute (:func:`~..handlers.checks.
            attention_variant`); a non-causal mask.
    """

    token_layout_cls = DecodeLayout
    cp_comm_types = ("all_gather",)  # the merge of the ranks' partial outputs

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

    def agreement_key(self, attn_mod) -> None:
        """No agreement per layer: the prefill agreed every layer's variant, and a decode step's only
        collective per layer is the merge."""
        return None

    def check_call(self, call: AttnCall) -> None:
        if not call.mask.causal:
            raise ValueError("attn_mask_type='no_mask': a decode step attends causally to the cache")
        self.token_layout.check_tokens(call.q.shape[2], "core_attn")

    def attend(self, call: AttnCall) -> torch.Tensor:
        q, k, v = (call.in_format(t) for t in (call.q, call.k, call.v))  # (B, H, D): one new token per sequence
        shard = self.kv_cache.layer(call.layer or 0)
        for i, owner in enumerate(self.owners):
            if owner == self.cp_rank:
                shard.append(k[i], v[i], i, self.positions[i])
        q_pos = torch.tensor(self.positions, device=q.device)
        out, lse = _attend(q, q_pos, *shard.rows(), call.scale, call.mask)
        if call.mask.restricted:  # rows the next query of their sequence cannot see, no later one can (monotone)
            seq, pos = shard.rows()[2:]
            shard.keep(call.mask.visible(q_pos[seq] + 1, pos))
        if self.cp_size > 1:
            out, lse = _merge_over_ranks(out, lse, self.cp_group)
        if call.sinks is not None:
            out = fold_sinks(out, lse, call.sinks)[0]
        return call.restore(out.to(q.dtype))

    def unsupported_variant(self, comm_type: str, mask, sinks) -> str | None:
        """Every variant runs here (see the module doc)."""
        return None


def _attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor,
            pos: torch.Tensor, scale: float, mask: AttentionMask):
    """``q (B, H, D)`` of sequence ``i`` at position ``q_pos[i]`` against this rank's rows ``k (N, Hkv, D)``,
    ``v (N, Hkv, Dv)`` of sequence ``i`` (at positions ``pos``) that ``mask`` lets it see: ``(out (1, H, B, Dv),
    lse (1, H, B))`` in the accumulation dtype, as one block of ``B`` queries (the masked kernel's scoring and softmax,
    :func:`~cp_handler.ops.kernels.masked.visible_scores`); a sequence with no visible rows here gets ``out = 0``
    and the lowest finite lse (it weighs nothing in the merge)."""
    visible = (seq[None, :] == torch.arange(q.shape[0], device=q.device)[:, None]) & \
        mask.visible(q_pos[:, None], pos[None, :])  # (B, N)
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    scores, _ = visible_scores(q4, k4, scale, mask.softcap, visible)
    return softmax_out(scores, q4, v4)


def _merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``(out (1, H, B, Dv), lse (1, H, B))`` merged by log-sum-exp (:func:`~cp_handler.ops.merge.
    merge_attn_out_`, rank by rank in rank order): one all-gather; the same result on every rank."""
    local = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # (1, H, B, Dv + 1)
    gathered = local.new_empty((torch.distributed.get_world_size(group), *local.shape[1:]))
    all_gather_single(gathered, local, group)
    out, lse = gathered[:1, ..., :-1].clone(), gathered[:1, ..., -1].clone()
    for rank in range(1, gathered.shape[0]):
        merge_attn_out_(out, lse, gathered[rank:rank + 1, ..., :-1], gathered[rank:rank + 1, ..., -1])
    return out, lse
