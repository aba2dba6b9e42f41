"""The single-process reference of ``--check-parity``: it shares no code with the CP path under test.

A check whose reference runs the same handler at cp=1 cannot find a bug both share (a dropped
soft-cap passed the old check). Here the reference GPT runs with :class:`PlainAttention`, a handler
stand-in written with plain PyTorch (rotate-half RoPE inline, ``F.scaled_dot_product_attention`` with
an explicit document-causal mask for packed batches; no cp_handler layout, rope, kernel or attention
code), and a Hugging Face model runs as the unmodified model with its own attention implementation
(``sdpa``; a pack of documents one document at a time). The reference GPT's linear
layers run their definitions token by token (the gated delta rule's recurrence, ``F.conv1d``), document by
document. The loss is the plain
next-token cross-entropy within each sequence / document, token-weighted over the whole global batch,
computed from one forward of the whole batch (so MoE router statistics cover it, as in the CP step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_positions(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document id, position inside the document)`` of every token of a pack (int64 ``[T]``)."""
    lengths = torch.diff(cu_seqlens.long().cpu())
    docs = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long().cpu(), lengths)
    return docs, torch.arange(len(docs)) - starts


class PlainAttention:
    """What one process computes for the reference GPT (the four handler methods it calls): the whole
    batch ``(B, S)``, or one pack ``(1, T)`` of the documents of ``cu_seqlens`` (positions restart
    and attention stays inside each document)."""

    def __init__(self, cu_seqlens: torch.Tensor | None = None):
        self.docs = self.positions = None
        if cu_seqlens is not None:
            self.docs, self.positions = document_positions(cu_seqlens)

    def get_rotary_seq_len(self, local_seq_len: int) -> int:
        return local_seq_len

    def _documents(self, length: int) -> list[slice]:
        if self.docs is None:
            return [slice(0, length)]
        ends = torch.cumsum(torch.bincount(self.docs, minlength=int(self.docs.max()) + 1), 0).tolist()
        return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True) if b > a]

    def causal_conv1d(self, x, weight, bias=None, activation=None, *, conv_fn=None):
        """``x (B, C, S)``: each document convolved alone (``F.conv1d``, zero left padding), then SiLU."""
        taps = weight.shape[-1]
        out = torch.cat([F.conv1d(x[..., d], weight[:, None], bias, padding=taps - 1, groups=x.shape[1])
                         [..., :d.stop - d.start] for d in self._documents(x.shape[-1])], dim=-1)
        return F.silu(out) if activation else out

    def gated_delta_rule(self, query, key, value, g, beta, *, kernel=None, use_qk_l2norm_in_kernel=False):
        """The gated delta rule token by token, each document from a zero state (float32)."""
        rep = value.shape[2] // key.shape[2]
        q, k = (t.float().repeat_interleave(rep, dim=2) for t in (query, key))
        if use_qk_l2norm_in_kernel:
            q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        q, v = q * q.shape[-1] ** -0.5, value.float()
        outs = []
        for d in self._documents(q.shape[1]):
            state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])  # (B, Hv, Dk, Dv)
            for t in range(d.start, d.stop):
                kt, b = k[:, t, :, :, None], beta[:, t, :, None, None].float()
                state = g[:, t, :, None, None].float().exp() * state
                state = state + b * kt @ (v[:, t, :, None, :] - kt.transpose(-1, -2) @ state)
                outs.append((q[:, t, :, None, :] @ state)[:, :, 0])
        return torch.stack(outs, dim=1).to(value.dtype)

    def get_emb_on_this_cp_rank(self, emb: torch.Tensor) -> torch.Tensor:
        return emb if self.positions is None else emb[self.positions.to(emb.device)]

    def apply_rotary_pos_emb(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of ``t (B, S, H, D)`` by the angles ``freqs (S, D)``, in float32."""
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
        first, second = t.float().chunk(2, dim=-1)
        return (t.float() * cos + torch.cat([-second, first], dim=-1) * sin).to(t.dtype)

    def core_attn(self, attn_mod, q, k, v, *, attn_mask_type: str = "causal") -> torch.Tensor:
        causal = attn_mask_type == "causal"
        mask = None
        if self.docs is not None:
            docs = self.docs.to(q.device)
            mask = docs[:, None] == docs[None, :]
            if causal:
                mask = mask & torch.ones_like(mask).tril()
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             is_causal=causal and mask is None, scale=attn_mod.softmax_scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (float32) over the batch: each row of ``tokens (B, S)``, or each
    document of a pack ``(1, T)``, predicts its own next tokens (the last token of each predicts none)."""
    flat_logits, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
    if cu_seqlens is None:
        keep = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        keep[:, -1] = False
        keep = keep.reshape(-1)
    else:
        docs, _ = document_positions(cu_seqlens)
        keep = torch.cat([docs[1:] == docs[:-1], torch.tensor([False])]).to(tokens.device)
    index = torch.nonzero(keep).squeeze(1)
    return F.cross_entropy(flat_logits[index].float(), flat_tokens[index + 1])


def predicted_tokens(tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> int:
    """How many tokens :func:`next_token_loss` averages over: every token but each row's (each
    document's) last."""
    if cu_seqlens is None:
        return tokens.shape[0] * (tokens.shape[1] - 1)
    return tokens.numel() - (len(cu_seqlens) - 1)


def hf_logits(model, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The unmodified Hugging Face model's logits; a pack runs one document at a time (every token mixer of every
    architecture then starts afresh at each document: transformers' own Mamba would carry its state from one packed
    document into the next)."""
    if cu_seqlens is None:
        return model(input_ids=tokens, use_cache=False).logits
    ends = cu_seqlens.tolist()
    return torch.cat([model(input_ids=tokens[:, a:b], use_cache=False).logits for a, b in
                      zip(ends[:-1], ends[1:], strict=True)], dim=1)
