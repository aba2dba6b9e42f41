"""Ring attention over a CP group (``cp_comm_type="p2p"``), zigzag load-balanced.

Algorithm: ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers") with the
zigzag / DualChunkSwap layout of Megatron-LM and Transformer Engine: every rank holds chunks
``r`` and ``2cp-1-r`` of the sequence, so each causal ring step costs every rank the same work.
K and V travel around the ring; each step's transfer is posted before that step's block is
computed (overlap). Partial results are merged with the log-sum-exp rule (:mod:`.merge`).
Backward runs the same ring of K/V: dQ stays home, and the partial dK/dV of each remote block is
sent straight to the rank that owns that K/V (:func:`ring_attn_backward`). GQA: K/V keep their own
(fewer) heads on the wire.

Causal blocks at ring step ``i`` on rank ``r`` (K/V from rank ``src = (r - i) mod cp``):
  * ``i == 0``:   all local queries vs all local keys, causal (local order is global order);
  * ``src < r``:  all local queries vs the first K/V chunk (chunk ``src``), no mask;
  * ``src > r``:  the second query chunk (``2cp-1-r``) vs both K/V chunks, no mask;
the other (query chunk, key chunk) pairs lie entirely above the diagonal and are skipped.
Packed documents (thd): the same rule per document, each zigzag-split on its own (:class:`ZigzagDocs`);
only real tokens enter the blocks, so work follows the documents' lengths and no mask is built.

Other masks (:class:`~cp_handler.core.masks.AttentionMask`: sliding window, chunks, soft-cap): every (query
chunk, key chunk) pair of a step is planned by :func:`~cp_handler.core.masks.mask_blocks` (empty pairs
skipped, edges to the masked kernel). A window or chunk does not shorten the ring: under zigzag the
chunk just before rank ``r``'s second chunk is on rank ``r + 1``, which the ring reaches at its last
step. What saves the bytes is the halo exchange (:mod:`.halo`: each rank receives only the K/V rows
its queries see), used instead of the ring whenever it moves at most half as much. Learnable sinks are
folded in after the merge (:mod:`.sinks`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask, mask_blocks
from .blocks import Block, LseRows, blocks_backward_, blocks_forward_, new_accumulators
from .halo import halo_applies, halo_attention
from .halves import docs_rows, halves_local_split, halves_order, halves_step_plans, uses_halves
from .kernels import check_plan
from .kernels.base import seq_major
from .kv import kv_seq_dim, pack_kv, unpack_kv
from .merge import acc_dtype
from .p2p import PendingRecv, RingComm, exchange
from .sinks import fold_sinks
from .spec import AttentionFunction, AttnSpec, attn_spec


@functools.lru_cache(maxsize=512)
def ring_blocks(layout: ZigzagDocs, step: int, rank: int, mask: AttentionMask) -> list[Block]:
    """Blocks of ring step ``step`` on ``rank``: per document, the zigzag rule of the module doc
    (any other mask: :func:`~cp_handler.core.masks.mask_blocks` per pair of chunks), restricted to real
    tokens (padding is neither attended to nor computed)."""
    src = (rank - step) % layout.size
    if not mask.plain:
        return check_plan([block for i in range(layout.num_docs) for q_id, q_row, q_real in layout.rank_chunks(i, rank)
                for k_id, k_row, k_real in layout.rank_chunks(i, src)
                for block in mask_blocks(slice(q_row, q_row + q_real), q_id * layout.chunk(i),
                                         slice(k_row, k_row + k_real), k_id * layout.chunk(i), mask)])
    causal = mask.causal
    blocks = []
    for i in range(layout.num_docs):
        off, chunk = layout.local_offsets[i], layout.chunk(i)
        (mine_a, mine_b), (src_a, src_b) = layout.rank_real(i, rank), layout.rank_real(i, src)
        if not causal:
            q, kv, flag = (off, mine_a + mine_b), (off, src_a + src_b), False
        elif step == 0:
            q, kv, flag = (off, mine_a + mine_b), (off, mine_a + mine_b), True
        elif src < rank:
            q, kv, flag = (off, mine_a + mine_b), (off, src_a), False
        else:
            q, kv, flag = (off + chunk, mine_b), (off, src_a + src_b), False
        if q[1] and kv[1]:
            blocks.append((slice(q[0], q[0] + q[1]), slice(kv[0], kv[0] + kv[1]), flag))
    return check_plan(blocks)


def default_layout(q: torch.Tensor, group) -> ZigzagDocs:
    """The bshd layout of local ``q (B, H, S_local, D)``: one document of ``S_local * size`` tokens."""
    size = 1 if group is None else dist.get_world_size(group)
    return ZigzagDocs.uniform(q.shape[2] * size, size)


def _in_docs_order(kv: torch.Tensor, spec: AttnSpec, comm: RingComm, step: int) -> torch.Tensor:
    """The reordered K/V block this rank holds at ``step`` in docs order (:func:`~.halves.docs_rows`): how the last
    rank sends a block over the ring's wrap to rank 0 when the rows are reordered (:mod:`.halves`)."""
    return kv.index_select(kv_seq_dim(kv), docs_rows(spec.layout, (comm.rank - step) % comm.size, kv.device))


def ring_attn_forward(q, k, v, spec: AttnSpec, sinks: torch.Tensor | None = None):
    """Forward ring over ``spec.group``: ``q (B,H,S,D)``, ``k, v (B,Hkv,S,D)`` local -> ``out (B,H,S,D)`` in q's
    dtype, ``lse (B,H,S)`` (with ``sinks``: folded in, :mod:`.sinks`)."""
    comm = RingComm(spec.group)
    steps = comm.size
    kv = pack_kv(k, v)  # one message per step; K and V with their own widths (MLA)
    out, lse = new_accumulators(q, v.shape[-1])
    wraps = spec.halves and comm.rank == steps - 1  # sends over the ring's wrap in docs order (:mod:`.halves`)
    for step in range(steps):
        pending = None
        if step + 1 < steps:
            pending = comm.send_recv(_in_docs_order(kv, spec, comm, step) if wraps else kv)
        for i, plan in enumerate(step_plans(spec.layout, spec.mask, spec.halves, step, comm.rank)):
            blocks_forward_(out, lse, q, *unpack_kv(kv, k.shape[-1]), plan, spec, fresh=step == 0 and i == 0)
        if pending is not None:
            kv = pending.wait()[0]
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


@functools.lru_cache(maxsize=1024)
def step_plans(layout: ZigzagDocs, mask: AttentionMask, halves: bool, step: int, rank: int) -> tuple[list[Block], ...]:
    """The plans of ring step ``step`` on ``rank`` (one, or over reordered rows several: :mod:`.halves`); cached,
    so the hot loop calls no Python for them."""
    if halves:
        return halves_step_plans(layout, step, rank)
    return (ring_blocks(layout, step, rank, mask),)


@functools.lru_cache(maxsize=256)
def local_blocks_split(layout: ZigzagDocs, rank: int, mask: AttentionMask) -> tuple[list[Block], list[Block]]:
    """Step 0's blocks split into ``(head, tail)``: per document, the second zigzag chunk's causal
    diagonal is the tail (run last in backward, while partial dK/dV travel home); the first chunk's
    diagonal and the second chunk against the first are the head. A document's real local tokens
    are contiguous (padding only ends a document), so the second chunk starts after a full first.
    Other masks: all of step 0 is the head."""
    if not mask.plain:
        return ring_blocks(layout, 0, rank, mask), []
    causal = mask.causal
    head, tail = [], []
    for i in range(layout.num_docs):
        off, (a, b) = layout.local_offsets[i], layout.rank_real(i, rank)
        if not causal or not b:
            if a + b:
                head.append((slice(off, off + a + b), slice(off, off + a + b), causal))
            continue
        first, second = slice(off, off + a), slice(off + a, off + a + b)
        head += [(first, first, True), (second, first, False)]
        tail.append((second, second, True))
    return check_plan(head), check_plan(tail)


def ring_attn_backward(dout, q, k, v, out, lse, spec: AttnSpec):
    """Backward ring: returns ``dq, dk, dv`` for the local q, k, v (``out``/``lse``: the forward's,
    sinks folded in).

    K/V travel the ring as in forward. The gradient of a remote K/V block is sent straight to its
    owner as soon as it is computed (``cp - 1`` sends of one dK/dV shard per rank, none of them
    accumulated on the way); the local block is split (:func:`local_blocks_split`) so that its
    tail runs after the last remote step and hides the last partial's trip home.
    """
    group, layout, mask = spec.group, spec.layout, spec.mask
    comm = RingComm(group)
    steps = comm.size
    dtype = acc_dtype(q.dtype)
    dout = seq_major(dout)  # once per call: the kernels then take every block's rows without copies
    dq = torch.zeros_like(q, dtype=dtype)
    dkv = torch.zeros_like(pack_kv(k, v), dtype=dtype)
    dk, dv = unpack_kv(dkv, k.shape[-1])
    head, tail = (halves_local_split(layout, comm.rank) if spec.halves else
                  local_blocks_split(layout, comm.rank, mask))
    lse_rows = LseRows(lse)  # every step's blocks share the row copies of lse
    wraps = spec.halves and comm.rank == steps - 1  # as in the forward
    kv_pending = None
    if steps > 1:
        kv_pending = comm.send_recv(_in_docs_order(pack_kv(k, v), spec, comm, 0) if wraps else pack_kv(k, v))
    blocks_backward_(dq, dk, dv, dout, q, k, v, out, lse_rows, head, spec)
    partial = None
    for step in range(1, steps):
        kv_remote = kv_pending.wait()[0]
        if step + 1 < steps:
            kv_pending = comm.send_recv(_in_docs_order(kv_remote, spec, comm, step) if wraps else kv_remote)
        dkv_remote = torch.zeros_like(dkv)
        for plan in step_plans(spec.layout, spec.mask, spec.halves, step, comm.rank):
            blocks_backward_(dq, *unpack_kv(dkv_remote, k.shape[-1]), dout, q, *unpack_kv(kv_remote, k.shape[-1]),
                             out, lse_rows, plan, spec)
        if partial is not None:
            _add_partial(dkv, partial, spec, comm, step - 1)
        owner, holder = (comm.rank - step) % comm.size, (comm.rank + step) % comm.size
        tag = step  # K/V use tag 0: a partial and a K/V message between the same two ranks stay apart
        partial = exchange(group, [(dkv_remote, owner, tag)], [(torch.empty_like(dkv_remote), holder, tag)])
    blocks_backward_(dq, dk, dv, dout, q, k, v, out, lse_rows, tail, spec)
    if partial is not None:
        _add_partial(dkv, partial, spec, comm, steps - 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_partial(dkv: torch.Tensor, partial: PendingRecv, spec: AttnSpec, comm: RingComm, step: int) -> None:
    """Adds the dK/dV partial of this rank's K/V that the rank ``step`` ahead computed: over reordered rows
    (:mod:`.halves`) in docs order when that rank held the block after the ring's wrap, added by index."""
    received = partial.wait()[0]
    if spec.halves and comm.rank + step >= comm.size:
        dkv.index_add_(kv_seq_dim(dkv), docs_rows(spec.layout, comm.rank, dkv.device), received)
    else:
        dkv += received


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ring attention of a checked call (:class:`~.spec.AttnSpec`; :func:`ring_attn` checks a
    direct one): the halo exchange when it applies to the spec's window or chunks, else the ring."""
    if spec.group is not None and halo_applies(spec.layout, spec.mask):
        return halo_attention(q, k, v, spec)
    if uses_halves(spec.layout, spec.kernel.packed, spec.mask):
        order, inverse = halves_order(spec.layout, ring_rank(spec.group), q.device)
        q, k, v = (t.index_select(2, order) for t in (q, k, v))
        out, lse = halves_ring_attention(q, k, v, spec)
        return out.index_select(2, inverse), lse.index_select(2, inverse)
    return AttentionFunction.apply(q, k, v, spec.sinks, ring_attn_forward, ring_attn_backward, spec)


def ring_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's place in the ring over ``group`` (0 alone)."""
    return 0 if group is None else dist.get_rank(group)


def halves_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_attention` of ``q, k, v`` already in :func:`~.halves.halves_order` of ``spec.layout`` (when
    :func:`~.halves.uses_halves`), with ``out`` and ``lse`` in that order: for a caller that gathers its rows anyway
    (the all-to-all) and folds the reorder into its own gather."""
    return AttentionFunction.apply(q, k, v, spec.sinks, ring_attn_forward, ring_attn_backward,
                                   replace(spec, halves=True))


def ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    causal: bool,
    scale: float,
    layout: ZigzagDocs | None = None,
    attn_kernel: str | None = None,
    mask: AttentionMask | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ring attention over ``group``, its arguments checked (:func:`~.spec.attn_spec`).

    Args:
        q: ``(B, H, S_local, D)`` local queries (zigzag layout when ``causal``).
        k, v: ``(B, Hkv, S_local, D)``, ``H % Hkv == 0``.
        group: the CP process group; ``None`` runs on this rank alone (plain blockwise attention).
        causal: causal mask over the global (zigzag-dispatched) sequence.
        scale: softmax scale (usually ``D ** -0.5``).
        layout: documents of the local sequence (thd); default one document (bshd).
        attn_kernel: force a block kernel by name (:func:`~.kernels.select_kernel`); default automatic.
        mask: a sliding window, chunks and/or a soft-cap (:class:`~cp_handler.core.masks.AttentionMask`, its
            ``causal`` equal to ``causal``); default the plain causal / full mask. A window or chunk
            that a halo exchange covers runs the halo exchange (:mod:`.halo`) instead of the ring.
        sinks: ``(H,)`` learnable sink logits, one per query head (:mod:`.sinks`), or ``None``.

    Returns:
        ``out (B, H, S_local, D)`` in q's dtype and ``lse (B, H, S_local)`` float32 (float64 for
        float64 inputs; with sinks, the log-sum-exp including them); ``lse`` is not differentiable.

    Raises:
        TypeError / ValueError: a mask that disagrees with ``causal``; sinks of the wrong type or shape; a
            forced kernel that cannot run.
    """
    spec = attn_spec(q, causal=causal, scale=scale, layout=layout or default_layout(q, group),
                     attn_kernel=attn_kernel, mask=mask, sinks=sinks, group=group, v_head_dim=v.shape[-1])
    return ring_attention(q, k, v, spec)
