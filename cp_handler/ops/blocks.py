"""Run a plan of attention blocks on local tensors: the compute shared by every CP algorithm.

A block is ``(q_rows, kv_rows, mask)``: slices of the sequence dim of q and of k/v, and ``False``
(no mask), ``True`` (the square causal diagonal) or a :class:`~cp_handler.core.masks.BlockMask` (a window
or chunk edge, or soft-capped scores: the masked kernel, :mod:`.kernels.masked`). An algorithm (ring
step, all-gather, a2a) decides the plan (masked plans: :func:`cp_handler.core.masks.mask_blocks`); these
functions run it, merging forward results by log-sum-exp and accumulating gradients.
All tensors ``(B, H, S, D)``; accumulators in :func:`~.merge.acc_dtype`.
"""

from __future__ import annotations

import os

import torch

from ..core.masks import BlockMask, block_needs
from .kernels import MASKED_KERNEL_ENV, AttnKernel, masked_kernel, work
from .kernels.base import seq_major
from .kernels.masked import masked_backward, masked_forward
from .kernels.work import block_pairs, record_attn_pairs, record_explicit_blocks
from .merge import acc_dtype, merge_attn_out_
from .packed_blocks import packed_backward_, packed_forward_
from .sinks import fold_sinks
from .spec import AttentionFunction, AttnSpec

Block = tuple[slice, slice, bool | BlockMask]


CPU_CAUSAL_TILE = 64
"""Smallest causal block run on CPU. The CPU flash kernel skips masked work only in whole key blocks
(up to 512 keys), so a long causal diagonal computes many masked scores. :func:`tile_causal` halves
causal blocks recursively down to this size: big full blocks (efficient GEMMs) below the diagonal,
small causal tiles on it. Measured (1 thread, H=8, D=64, fwd+bwd of one causal block, median of 10):
against the previous flat 256-row tiling, 512: -19%, 1024: -6%, 2048: -7%, 4096: -7%; recursive
tiles of 128 and 32 came within ~2% of 64 (the noise of this VM), flat 128 was worse at 2048-4096.
Almost all of the gain is in the backward kernel. CUDA kernels skip masked work finely and get
blocks untiled."""


def tile_causal(blocks: list[Block], tile: int = CPU_CAUSAL_TILE) -> list[Block]:
    """Split every causal (square) block longer than ``tile``: its first ``h`` rows causal (``h``
    about half, a multiple of ``tile``), the remaining rows against those ``h`` keys in full, and
    the remaining rows causal on their own keys; the two causal parts recursively. Same score pairs,
    same result; query starts stay non-decreasing (the forward's copy-first rule relies on it)."""
    tiled: list[Block] = []
    for q_rows, kv_rows, causal in blocks:
        n = q_rows.stop - q_rows.start
        if causal is not True or n <= tile:
            tiled.append((q_rows, kv_rows, causal))
            continue
        h = -(-n // (2 * tile)) * tile  # ceil(n / 2) rounded up to a tile; tile <= h < n
        top, bottom = slice(q_rows.start, q_rows.start + h), slice(q_rows.start + h, q_rows.stop)
        keys_top, keys_bottom = slice(kv_rows.start, kv_rows.start + h), slice(kv_rows.start + h, kv_rows.stop)
        tiled += tile_causal([(top, keys_top, True)], tile)
        tiled.append((bottom, keys_top, False))
        tiled += tile_causal([(bottom, keys_bottom, True)], tile)
    return tiled


_plans: dict[tuple[int, str], tuple[list[Block], list[Block], list[Block]]] = {}
PLAN_CACHE_SIZE = 1024
"""Plans :func:`_plan` keeps (the plan functions are cached themselves, so the same plan object comes back)."""


def _plan(blocks: list[Block], kernel: AttnKernel) -> tuple[list[Block], list[Block]]:
    """``(blocks for the kernel, masked blocks)``: the first tiled on CPU (:func:`tile_causal`). Memoised per plan
    object and device type (the entry holds the plan, so its id is not reused while it is cached)."""
    key = (id(blocks), kernel.device_type)
    entry = _plans.get(key)
    if entry is not None and entry[0] is blocks:
        return entry[1], entry[2]
    plain = [b for b in blocks if not isinstance(b[2], BlockMask)]
    masked = [b for b in blocks if isinstance(b[2], BlockMask)]
    plain = tile_causal(plain) if kernel.device_type == "cpu" else plain
    if len(_plans) >= PLAN_CACHE_SIZE:
        _plans.clear()
    _plans[key] = (blocks, plain, masked)
    return plain, masked


_routes: dict[tuple, tuple[list[Block], list]] = {}


def route_masked(masked: list[Block], kernel: AttnKernel, q: torch.Tensor, v_head_dim: int) -> list:
    """The masked blocks of a plan as ``(q_rows, kv_rows, block, kernel or None)``: each to
    :func:`~.kernels.masked_kernel` of what it needs (``None``: explicit scores), ``CP_HANDLER_MASKED_KERNEL`` read
    now. Memoised per plan object, kernel, q's dtype and head dims and that variable (masked plans only: a plan
    without masked blocks never comes here)."""
    forced = os.environ.get(MASKED_KERNEL_ENV) or None
    key = (id(masked), kernel.name, q.device.type, q.dtype, q.shape[-1], v_head_dim, forced)
    entry = _routes.get(key)
    if entry is not None and entry[0] is masked:
        return entry[1]
    routed, chosen = [], {}
    for q_rows, kv_rows, block in masked:
        needs = block_needs(block, q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start)
        if needs not in chosen:
            chosen[needs] = masked_kernel(needs, q, kernel, None if v_head_dim == q.shape[-1] else v_head_dim, forced)
        routed.append((q_rows, kv_rows, block, chosen[needs]))
    if len(_routes) >= PLAN_CACHE_SIZE:
        _routes.clear()
    _routes[key] = (masked, routed)
    return routed


def _masked_work(q: torch.Tensor, routed: list) -> None:
    """Record the masked blocks' score pairs (every pair of a block, masked or not) and the explicit ones."""
    record_attn_pairs(q.shape[0] * q.shape[1] * sum((qr.stop - qr.start) * (kr.stop - kr.start)
                                                    for qr, kr, _, _ in routed), len(routed))
    record_explicit_blocks(sum(mk is None for _, _, _, mk in routed))


def rows(t: torch.Tensor, index: slice) -> torch.Tensor:
    """Sequence rows of a ``(B, H, S, ...)`` tensor (a view)."""
    return t[:, :, index]


def new_accumulators(q: torch.Tensor, v_head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(out (B, H, S, Dv), lse (B, H, S))`` for ``q (B, H, S, D)`` (``Dv``: ``v_head_dim``, default
    ``D``): zeros and -inf, which the first merge replaces exactly. ``out`` is sequence-major (a view of
    ``(B, S, H, Dv)`` memory, :func:`~.kernels.base.seq_major`): the layout the CUDA backward kernels take
    without copies."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # acc_dtype, inline (the hot path)
    b, h, s, d = q.shape
    d = v_head_dim or d
    out = torch.zeros((b, s, h, d), dtype=dtype, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    return out, lse


def blocks_forward_(out, lse, q, k, v, blocks: list[Block], spec: AttnSpec, fresh: bool = False) -> None:
    """Merge the attention of every block into ``out``/``lse`` (in place), with ``spec``'s kernel and scale.

    ``fresh``: the accumulators are still empty (zeros / -inf), so a block starting at or past the
    furthest row written so far is copied in instead of merged (saves the merge's passes; exact, as
    merging into an empty accumulator is a copy). Plans list query rows in non-decreasing order; a
    block out of order is merged, which is always correct. A packed kernel runs the plan in few
    calls (:mod:`.packed_blocks`). The work counters (:func:`~.kernels.work.count_attn_work`) are read
    once per plan, never per kernel call.
    """
    kernel, scale = spec.kernel, spec.scale
    plain, masked = _plan(blocks, kernel)
    if kernel.packed:
        packed_forward_(out, lse, q, k, v, plain, scale, fresh, kernel, spec.packed_calls)
    else:
        if work.counters:
            record_attn_pairs(q.shape[0] * q.shape[1] * sum(block_pairs(qr.stop - qr.start, kr.stop - kr.start, c)
                                                            for qr, kr, c in plain), len(plain))
        frontier = 0 if fresh else None
        forward = kernel.forward
        for q_rows, kv_rows, causal in plain:  # rows as views: t[:, :, rows] inline (the hot loop)
            block_out, block_lse = forward(q[:, :, q_rows], k[:, :, kv_rows], v[:, :, kv_rows], causal=causal,
                                           scale=scale)
            if frontier is not None and q_rows.start >= frontier:
                out[:, :, q_rows].copy_(block_out)
                lse[:, :, q_rows].copy_(block_lse)
            else:
                merge_attn_out_(out[:, :, q_rows], lse[:, :, q_rows], block_out, block_lse)
            if frontier is not None:
                frontier = max(frontier, q_rows.stop)
    if masked:
        routed = route_masked(masked, kernel, q, v.shape[-1])
        if work.counters:
            _masked_work(q, routed)
        for q_rows, kv_rows, block, mk in routed:  # after the plain blocks: always merged, never copied
            qb, kb, vb = rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows)
            block_out, block_lse = masked_forward(qb, kb, vb, block, scale) if mk is None else \
                mk.masked_forward(qb, kb, vb, block, scale=scale)
            merge_attn_out_(rows(out, q_rows), rows(lse, q_rows), block_out, block_lse)


class LseRows:
    """Row ranges of one merged ``lse (B, H, S)``, each made contiguous once. The backward kernels
    take their rows' lse contiguous, and the blocks of a backward pass (every step of a ring) ask
    for few distinct ranges: one copy per range instead of one per block."""

    def __init__(self, lse: torch.Tensor):
        self.lse, self._rows = lse, {}

    def __call__(self, index: slice) -> torch.Tensor:
        key = (index.start, index.stop)
        if key not in self._rows:
            self._rows[key] = rows(self.lse, index).contiguous()
        return self._rows[key]


def blocks_backward_(dq, dk, dv, dout, q, k, v, out, lse: torch.Tensor | LseRows, blocks: list[Block],
                     spec: AttnSpec) -> None:
    """Add every block's gradients to ``dq``/``dk``/``dv`` (in place), given the merged out/lse
    (pass one :class:`LseRows` to every call of a backward pass to share its row copies)."""
    kernel, scale = spec.kernel, spec.scale
    lse_rows = lse if isinstance(lse, LseRows) else LseRows(lse)
    plain, masked = _plan(blocks, kernel)
    if kernel.packed:
        packed_backward_(dq, dk, dv, dout, q, k, v, out, lse_rows, plain, scale, kernel, spec.packed_calls)
    else:
        backward = kernel.backward
        for q_rows, kv_rows, causal in plain:  # rows as views inline (the hot loop)
            grads = backward(dout[:, :, q_rows], q[:, :, q_rows], k[:, :, kv_rows], v[:, :, kv_rows],
                             out[:, :, q_rows], lse_rows(q_rows), causal=causal, scale=scale)
            dq[:, :, q_rows].add_(grads[0])
            dk[:, :, kv_rows].add_(grads[1])
            dv[:, :, kv_rows].add_(grads[2])
    for q_rows, kv_rows, block, mk in route_masked(masked, kernel, q, v.shape[-1]) if masked else ():
        args = (rows(dout, q_rows), rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows), rows(out, q_rows),
                lse_rows(q_rows), block)
        grads = masked_backward(*args, scale) if mk is None else mk.masked_backward(*args, scale=scale)
        _add_grads_(dq, dk, dv, q_rows, kv_rows, grads)


def _add_grads_(dq, dk, dv, q_rows: slice, kv_rows: slice, grads) -> None:
    rows(dq, q_rows).add_(grads[0])
    rows(dk, kv_rows).add_(grads[1])
    rows(dv, kv_rows).add_(grads[2])


def plan_forward(q, k, v, spec: AttnSpec, blocks, sinks=None):
    """Forward of one fixed plan on local tensors: ``(out (B,H,Sq,D) in q's dtype, lse (B,H,Sq))``, sinks folded in."""
    out, lse = new_accumulators(q, v.shape[-1])
    blocks_forward_(out, lse, q, k, v, list(blocks), spec, fresh=True)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def plan_backward(dout, q, k, v, out, lse, spec: AttnSpec, blocks):
    """Backward of :func:`plan_forward`: ``(dq, dk, dv)`` in the inputs' dtypes."""
    dtype = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    blocks_backward_(dq, dk, dv, seq_major(dout), q, k, v, out, lse, list(blocks), spec)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def plan_attn(q, k, v, blocks, spec: AttnSpec):
    """Differentiable attention of local ``q (B,H,Sq,D)`` over local ``k, v (B,Hkv,Sk,D)`` by one fixed
    block plan (a tuple of blocks: keys of K/V rows already on this rank, e.g. after a halo exchange),
    with ``spec.sinks (H,)`` folded in after the merge: ``(out (B,H,Sq,D) in q's dtype, lse (B,H,Sq))``."""
    return AttentionFunction.apply(q, k, v, spec.sinks, plan_forward, plan_backward, spec, tuple(blocks))
