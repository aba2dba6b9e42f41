"""Ring attention over a CP group (``cp_comm_type="p2p"``), zigzag load-balanced.

Algorithm: ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers") with the
zigzag / DualChunkSwap layout of Megatron-LM and Transformer Engine: every rank holds chunks
``r`` and ``2cp-1-r`` of the sequence, so each causal ring step costs every rank the same work.
K and V travel around the ring; each step's transfer is posted before that step's block is
computed (overlap). Partial results are merged with the log-sum-exp rule (:mod:`.merge`).
Backward runs the same ring: dQ stays home, dK/dV accumulators travel with their K/V and arrive
back at their owner after the last step. GQA: K/V keep their own (fewer) heads on the wire.

Causal blocks at ring step ``i`` on rank ``r`` (K/V from rank ``src = (r - i) mod cp``):
  * ``i == 0``:   all local queries vs all local keys, causal (local order is global order);
  * ``src < r``:  all local queries vs the first K/V chunk (chunk ``src``), no mask;
  * ``src > r``:  the second query chunk (``2cp-1-r``) vs both K/V chunks, no mask;
the other (query chunk, key chunk) pairs lie entirely above the diagonal and are skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import ALL, Block, blocks_backward_, blocks_forward_, new_accumulators
from .merge import acc_dtype
from .p2p import RingComm


def zigzag_causal_blocks(step: int, rank: int, size: int, seq_len: int) -> list[Block]:
    """The block of ring step ``step`` on ``rank`` (zigzag layout; ``seq_len`` = two local chunks)."""
    half = seq_len // 2
    if step == 0:
        return [(ALL, ALL, True)]
    src = (rank - step) % size
    if src < rank:
        return [(ALL, slice(0, half), False)]
    return [(slice(half, seq_len), ALL, False)]


def _blocks(step: int, comm: RingComm, seq_len: int, causal: bool) -> list[Block]:
    return zigzag_causal_blocks(step, comm.rank, comm.size, seq_len) if causal else [(ALL, ALL, False)]


def ring_attn_forward(q, k, v, group, causal: bool, scale: float):
    """Forward ring: ``q (B,H,S,D)``, ``k, v (B,Hkv,S,D)`` local -> ``out (B,H,S,D)`` in q's dtype, ``lse (B,H,S)``."""
    comm = RingComm(group)
    kv = torch.stack([k, v])
    out, lse = new_accumulators(q)
    for step in range(comm.size):
        pending = comm.send_recv(kv) if step + 1 < comm.size else None
        blocks_forward_(out, lse, q, kv[0], kv[1], _blocks(step, comm, q.shape[2], causal), scale)
        if pending is not None:
            kv = pending.wait()[0]
    return out.to(q.dtype), lse


def ring_attn_backward(dout, q, k, v, out, lse, group, causal: bool, scale: float):
    """Backward ring: returns ``dq, dk, dv`` for the local q, k, v (dK/dV gathered from every rank)."""
    comm = RingComm(group)
    kv = torch.stack([k, v])
    dq = torch.zeros_like(q, dtype=acc_dtype(q.dtype))
    dkv_pending = None
    for step in range(comm.size):
        kv_pending = comm.send_recv(kv, tag=0) if step + 1 < comm.size else None
        dkv = dkv_pending.wait()[0] if dkv_pending is not None else torch.zeros_like(kv, dtype=dq.dtype)
        blocks_backward_(dq, dkv[0], dkv[1], dout, q, kv[0], kv[1], out, lse,
                         _blocks(step, comm, q.shape[2], causal), scale)
        if kv_pending is not None:
            kv = kv_pending.wait()[0]
        dkv_pending = comm.send_recv(dkv, tag=1) if comm.size > 1 else None
    dkv = dkv_pending.wait()[0] if dkv_pending is not None else dkv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
class _RingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        out, lse = ring_attn_forward(q, k, v, group, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attn_backward(dout, q, k, v, out, lse, ctx.group, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ring attention over ``group``.

    Args:
        q: ``(B, H, S_local, D)`` local queries (zigzag layout when ``causal``).
        k, v: ``(B, Hkv, S_local, D)``, ``H % Hkv == 0``.
        group: the CP process group; ``None`` runs on this rank alone (plain blockwise attention).
        causal: causal mask over the global (zigzag-dispatched) sequence.
        scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        ``out (B, H, S_local, D)`` in q's dtype and ``lse (B, H, S_local)`` float32 (float64 for
        float64 inputs); ``lse`` is not differentiable.
    """
    return _RingAttn.apply(q, k, v, group, causal, scale)
