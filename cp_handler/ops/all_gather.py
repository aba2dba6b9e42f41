"""KV all-gather attention (``cp_comm_type="all_gather"``), zigzag layout.

As Transformer Engine's ``AttnFuncWithCPAndKVAllGather``: every rank gathers the whole K and V
over the CP group and attends its local queries to them; backward gathers K/V again and
reduce-scatters dK/dV (float32) back to their owners. To keep memory bounded, K/V are gathered
in chunks of KV heads (with their query heads); the next chunk's gather is posted before the
current chunk is computed, and each chunk's dK/dV reduce-scatter runs while the next computes.
Below :data:`PIPELINE_MIN_BYTES` of gathered K/V the heads go in one gather (:func:`kv_head_chunks`).

Causal plan for local query chunk ``j`` (global chunk index, length ``c``): keys ``[0, j*c)``
unmasked plus the diagonal block ``[j*c, (j+1)*c)`` causal. Both query chunks of a zigzag rank
sum to the same work on every rank. Packed documents (thd): the same per document, on real
tokens only, against the document's keys in the gathered global (padded) order. Other masks
(window, chunks, soft-cap): each query chunk against the document's keys through
:func:`~cp_handler.core.masks.mask_blocks` (keys outside the window or chunk are gathered but never
computed on); learnable sinks are folded in after the merge (:mod:`.sinks`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs, zigzag_chunk_ids
from ..core.masks import AttentionMask, mask_blocks
from .blocks import Block, blocks_backward_, blocks_forward_, new_accumulators
from .collectives import all_gather_single, reduce_scatter_single
from .kernels import check_plan
from .kernels.base import seq_major
from .kv import kv_heads, kv_seq_dim, pack_kv, unpack_kv
from .merge import acc_dtype
from .ring import default_layout
from .sinks import fold_sinks
from .spec import AttentionFunction, AttnSpec, attn_spec


@functools.lru_cache(maxsize=64)
def all_gather_blocks(layout: ZigzagDocs, rank: int, mask: AttentionMask) -> list[Block]:
    """Blocks of ``rank``'s local queries against K/V gathered in global (padded) order."""
    causal = mask.causal
    blocks = []
    for i in range(layout.num_docs):
        start = int(layout.cu_seqlens_padded[i])
        if not mask.plain:
            for q_id, q_row, q_real in layout.rank_chunks(i, rank):
                keys = min(layout.lengths[i], (q_id + 1) * layout.chunk(i)) if causal else layout.lengths[i]
                blocks += mask_blocks(slice(q_row, q_row + q_real), q_id * layout.chunk(i), slice(start, start + keys),
                                      0, mask)
            continue
        start, off, chunk = int(layout.cu_seqlens_padded[i]), layout.local_offsets[i], layout.chunk(i)
        if not causal:
            rows = sum(layout.rank_real(i, rank))
            if rows:
                blocks.append((slice(off, off + rows), slice(start, start + layout.lengths[i]), False))
            continue
        for half, chunk_id in enumerate(zigzag_chunk_ids(rank, layout.size)):
            q0, rows = off + half * chunk, layout.real_in_chunk(i, chunk_id)
            if not rows:
                continue
            if chunk_id > 0:
                blocks.append((slice(q0, q0 + rows), slice(start, start + chunk_id * chunk), False))
            diagonal = start + chunk_id * chunk
            blocks.append((slice(q0, q0 + rows), slice(diagonal, diagonal + rows), True))
    return check_plan(blocks)


PIPELINE_MIN_BYTES = 4 << 20
"""Gathered K/V (every rank's, all KV heads, bytes) from which the default splits the gather in two pipelined
chunks. Below it one gather: the chunks' overlap saves at most half a transfer of under 2 MiB (~5 us on NVLink 4,
~2 ms on this CPU's gloo), less than a second collective's latency and the ~12 Python calls a chunk costs; the
memory bound is no concern at that size (a Llama-3-8B layer, 8 KV heads of 128 in bf16: 1,024 tokens)."""


@functools.lru_cache(maxsize=256)
def kv_head_chunks(kv_heads: int, kv_heads_per_chunk: int | None, gathered_bytes: int) -> tuple[slice, ...]:
    """Slices of KV heads gathered together: ``kv_heads_per_chunk`` each, else (``None``) two chunks (one per head
    if fewer) when the whole gathered K/V hold ``gathered_bytes >=`` :data:`PIPELINE_MIN_BYTES`, one otherwise
    (memoised)."""
    if kv_heads_per_chunk is None and gathered_bytes < PIPELINE_MIN_BYTES:
        return (slice(0, kv_heads),)
    per_chunk = kv_heads_per_chunk or math.ceil(kv_heads / 2)
    return tuple(slice(h, min(h + per_chunk, kv_heads)) for h in range(0, kv_heads, per_chunk))


def gathered_kv_bytes(k: torch.Tensor, v: torch.Tensor, size: int) -> int:
    """Bytes of the whole gathered K and V: ``size`` ranks' local ``k`` and ``v``."""
    return size * (k.numel() * k.element_size() + v.numel() * v.element_size())


class _KVGather:
    """Posts the all-gather of one KV-head chunk; ``wait()`` returns the packed K/V (:mod:`.kv`) of those heads
    in global (padded) order."""

    def __init__(self, k, v, heads: slice, group, global_index: torch.Tensor):
        self.size, self.global_index = dist.get_world_size(group), global_index
        packed = pack_kv(k[:, heads], v[:, heads])
        self.seq_dim = kv_seq_dim(packed)
        local = packed.movedim(self.seq_dim, 0).contiguous()  # (S_l, ...): rank-major rows after the gather
        self.buffer = local.new_empty((self.size * local.shape[0], *local.shape[1:]))
        self.work = all_gather_single(self.buffer, local, group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer.index_select(0, self.global_index).movedim(0, self.seq_dim)


def all_gather_attn_forward(q, k, v, spec: AttnSpec, sinks=None):
    group, layout = spec.group, spec.layout
    blocks = all_gather_blocks(layout, dist.get_rank(group), spec.mask)
    global_index = layout.gathered_index(real_only=False).to(q.device)
    out, lse = new_accumulators(q, v.shape[-1])
    groups = q.shape[1] // k.shape[1]
    chunks = kv_head_chunks(k.shape[1], spec.kv_heads_per_chunk, gathered_kv_bytes(k, v, layout.size))
    pending = _KVGather(k, v, chunks[0], group, global_index)
    for i, heads in enumerate(chunks):
        kv = pending.wait()
        if i + 1 < len(chunks):
            pending = _KVGather(k, v, chunks[i + 1], group, global_index)
        qh = slice(heads.start * groups, heads.stop * groups)  # their query heads
        blocks_forward_(out[:, qh], lse[:, qh], q[:, qh], *unpack_kv(kv, k.shape[-1]), blocks, spec, fresh=True)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def all_gather_attn_backward(dout, q, k, v, out, lse, spec: AttnSpec):
    group, layout = spec.group, spec.layout
    blocks = all_gather_blocks(layout, dist.get_rank(group), spec.mask)
    global_index = layout.gathered_index(real_only=False).to(q.device)
    dtype = acc_dtype(q.dtype)
    dout = seq_major(dout)  # as out: the kernels take its rows without copies
    dq = torch.zeros_like(q, dtype=dtype)
    dkv = torch.zeros_like(pack_kv(k, v), dtype=dtype)
    groups = q.shape[1] // k.shape[1]
    chunks = kv_head_chunks(k.shape[1], spec.kv_heads_per_chunk, gathered_kv_bytes(k, v, layout.size))
    pending, scatters = _KVGather(k, v, chunks[0], group, global_index), []
    for i, heads in enumerate(chunks):
        kv = pending.wait()
        if i + 1 < len(chunks):
            pending = _KVGather(k, v, chunks[i + 1], group, global_index)
        qh = slice(heads.start * groups, heads.stop * groups)  # their query heads
        dkv_global = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        blocks_backward_(dq[:, qh], *unpack_kv(dkv_global, k.shape[-1]), dout[:, qh], q[:, qh],
                         *unpack_kv(kv, k.shape[-1]), out[:, qh], lse[:, qh], blocks, spec)
        by_position = dkv_global.movedim(kv_seq_dim(dkv), 0)  # (S, ...) global order -> rank-major rows:
        send = torch.empty_like(by_position, memory_format=torch.contiguous_format).index_copy_(
            0, global_index, by_position)
        recv = send.new_empty((send.shape[0] // pending.size, *send.shape[1:]))
        scatters.append((heads, recv, reduce_scatter_single(recv, send, group, async_op=True)))
    for heads, recv, work in scatters:
        work.wait()
        kv_heads(dkv, heads).copy_(recv.movedim(0, kv_seq_dim(dkv)))
    dk, dv = unpack_kv(dkv, k.shape[-1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def all_gather_attn(q, k, v, *, group: dist.ProcessGroup, causal: bool, scale: float,
                    layout: ZigzagDocs | None = None,
                    kv_heads_per_chunk: int | None = None,
                    attn_kernel: str | None = None,
                    mask: AttentionMask | None = None,
                    sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable KV all-gather attention over ``group``, its arguments checked (:func:`~.spec.attn_spec`).

    Args:
        q: ``(B, H, S_local, D)`` local queries (zigzag layout when ``causal``).
        k, v: ``(B, Hkv, S_local, D)``, ``H % Hkv == 0``.
        layout: documents of the local sequence (thd); default one document (bshd).
        kv_heads_per_chunk: KV heads gathered at once (default: :func:`kv_head_chunks`).
        attn_kernel: force a block kernel by name (:func:`~.kernels.select_kernel`); default automatic.
        mask: window / chunks / soft-cap (:class:`~cp_handler.core.masks.AttentionMask`, agreeing with
            ``causal``); default the plain mask.
        sinks: ``(H,)`` learnable sink logits (:mod:`.sinks`), or ``None``.

    Returns:
        ``out (B, H, S_local, D)`` in q's dtype, ``lse (B, H, S_local)`` float32 (not differentiable).

    Raises:
        TypeError / ValueError: a mask that disagrees with ``causal``; sinks of the wrong type or shape.
    """
    spec = attn_spec(q, causal=causal, scale=scale, layout=layout or default_layout(q, group), attn_kernel=attn_kernel,
                     mask=mask, sinks=sinks, group=group, kv_heads_per_chunk=kv_heads_per_chunk, v_head_dim=v.shape[-1])
    return all_gather_attention(q, k, v, spec)


def all_gather_attention(q, k, v, spec: AttnSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable KV all-gather attention of a checked call (:class:`~.spec.AttnSpec`; :func:`all_gather_attn`
    checks a direct one)."""
    return AttentionFunction.apply(q, k, v, spec.sinks, all_gather_attn_forward, all_gather_attn_backward, spec)
