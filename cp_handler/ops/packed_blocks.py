"""Run a plan of attention blocks through a packed (varlen) kernel: few calls instead of one per block.

The plan's blocks are grouped into calls: blocks with the same mask flag whose query rows do not
overlap go into one call (a greedy pass in plan order; a call without query rows is dropped: it computes
nothing, and a zero-row launch is outside the CUDA varlen kernels' contract), their rows gathered into
packed tensors with segment offsets ``cu_q`` / ``cu_k`` (FlashAttention-2's varlen layout). A call's output is merged
into the accumulators at its rows by log-sum-exp (:mod:`.merge`) in one batched gather / merge /
scatter, or copied when no earlier call wrote those rows into fresh accumulators. Backward runs the
same calls and adds the packed gradients back with ``index_add_``. A call whose query (or key) rows
are one range, as every bshd block is, reads and writes them through views instead: no gather,
scatter or cast kernels (``cp-bench --modes launches`` counts them). Per batch row: tensors are
``(B, H, S, D)`` as in :mod:`.blocks`; the index tensors of a plan are built once per device.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from .kernels import AttnKernel
from .kernels.base import check_causal_square
from .kernels.work import block_pairs, record_attn_pairs
from .merge import merge_attn_out_

BlockKey = tuple[int, int, int, int, bool]  # q rows [start, stop), kv rows [start, stop), causal


@dataclass(frozen=True)
class PackedCall:
    """One kernel call: segments ``i`` of ``q_index`` rows attend to segments ``i`` of ``kv_index`` rows."""

    causal: bool
    q_index: torch.Tensor  # int64 [Tq]: local query rows, segment after segment
    kv_index: torch.Tensor  # int64 [Tk]
    cu_q: torch.Tensor  # int32 [segments + 1]
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    fresh: bool  # no earlier call of the plan writes any of these query rows
    pairs: int  # score pairs per batch row and head
    blocks: int
    q_span: tuple[int, int] | None  # q_index as one ascending range [start, stop), else None
    kv_span: tuple[int, int] | None


def _overlaps(rows: list[tuple[int, int]], start: int, stop: int) -> bool:
    return any(a < stop and start < b for a, b in rows)


def _call(causal: bool, members: list[BlockKey], fresh: bool, device) -> PackedCall:
    def indices(pairs):
        return torch.cat([torch.arange(a, b) for a, b in pairs]).to(device)

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def span(pairs):  # adjacent ascending segments read and write as one view, no gather or scatter
        adjacent = all(prev[1] == nxt[0] for prev, nxt in zip(pairs, pairs[1:], strict=False))
        return (pairs[0][0], pairs[-1][1]) if adjacent else None

    q_rows, kv_rows = [(m[0], m[1]) for m in members], [(m[2], m[3]) for m in members]
    q_len = [qe - qs for qs, qe in q_rows]
    k_len = [ke - ks for ks, ke in kv_rows]
    if not max(q_len) or not max(k_len):  # a zero-row launch: outside the CUDA varlen kernels' contract
        raise ValueError(f"a packed call without query or key rows ({members}): a bug in the planner")
    for a, b in zip(q_len, k_len, strict=True):
        check_causal_square(a, b, causal)
    return PackedCall(causal, indices(q_rows), indices(kv_rows), offsets(q_len), offsets(k_len), max(q_len),
                      max(k_len), fresh, sum(block_pairs(a, b, causal) for a, b in zip(q_len, k_len, strict=True)),
                      len(members), span(q_rows), span(kv_rows))


class PackedCallCache:
    """The packed calls of the plans seen so far, per device (their index tensors live on it): owned by
    whoever runs the plans (a handler, for the batch it is built for; a benchmark's rank step), so no
    device tensor outlives its owner. Least recently used plans are dropped beyond ``max_plans``."""

    def __init__(self, max_plans: int = 512):
        self.max_plans, self._calls = max_plans, collections.OrderedDict()

    def calls(self, plan: tuple[BlockKey, ...], device: torch.device) -> list[PackedCall]:
        key = (plan, device)
        if key in self._calls:
            self._calls.move_to_end(key)
        else:
            self._calls[key] = packed_calls(plan, device)
            if len(self._calls) > self.max_plans:
                self._calls.popitem(last=False)
        return self._calls[key]


def packed_calls(plan: tuple[BlockKey, ...], device: torch.device) -> list[PackedCall]:
    """The calls of a plan (see module doc), with index tensors on ``device`` (built anew: callers keep
    them in a :class:`PackedCallCache`)."""
    groups: list[tuple[bool, list[BlockKey], list[tuple[int, int]]]] = []
    for block in plan:
        qs, qe, _, _, causal = block
        for flag, members, rows in groups:
            if flag == causal and not _overlaps(rows, qs, qe):
                members.append(block)
                rows.append((qs, qe))
                break
        else:
            groups.append((causal, [block], [(qs, qe)]))
    calls, written = [], []
    for causal, members, rows in groups:
        if all(b <= a for a, b in rows):  # keys without queries (halves' empty segments): nothing to compute
            continue
        fresh = not any(_overlaps(written, a, b) for a, b in rows)
        calls.append(_call(causal, members, fresh, device))
        written += rows
    return calls


def plan_key(blocks) -> tuple[BlockKey, ...]:
    """A hashable form of a plan of ``(q_rows, kv_rows, causal)`` slices."""
    return tuple((q.start, q.stop, kv.start, kv.stop, causal) for q, kv, causal in blocks)


def _rows(t: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    """``t (H, S, ...)`` rows ``index`` as packed ``(T, H, ...)``: a view when they are one range
    ``span`` (last dim contiguous, as the varlen kernels require), else a gathered copy."""
    rows = t.transpose(0, 1)
    return rows[span[0]:span[1]] if span else rows.index_select(0, index)


def _add_rows_(acc: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None, grad: torch.Tensor) -> None:
    """Add packed ``grad (T, H, D)`` into rows ``index`` of ``acc (H, S, D)``."""
    if span:
        acc.transpose(0, 1)[span[0]:span[1]].add_(grad)
    else:
        acc.transpose(0, 1).index_add_(0, index, grad.to(acc.dtype))


def packed_forward_(out, lse, q, k, v, blocks, scale: float, fresh: bool, kernel: AttnKernel,
                    cache: PackedCallCache) -> None:
    """:func:`~.blocks.blocks_forward_` with a packed kernel."""
    for call in cache.calls(plan_key(blocks), q.device):
        record_attn_pairs(q.shape[0] * q.shape[1] * call.pairs, call.blocks)
        qi, ki, qs, ks = call.q_index, call.kv_index, call.q_span, call.kv_span
        for b in range(q.shape[0]):
            block_out, block_lse = kernel.forward(
                _rows(q[b], qi, qs), _rows(k[b], ki, ks), _rows(v[b], ki, ks),
                call.cu_q, call.cu_k, call.max_q, call.max_k, causal=call.causal, scale=scale)
            block_out = block_out.transpose(0, 1)  # (H, Tq, D)
            if qs:  # merge or copy in place, through views of the accumulators
                acc_out, acc_lse = out[b][:, qs[0]:qs[1]], lse[b][:, qs[0]:qs[1]]
                if fresh and call.fresh:
                    acc_out.copy_(block_out)
                    acc_lse.copy_(block_lse)
                else:
                    merge_attn_out_(acc_out, acc_lse, block_out, block_lse)
            elif fresh and call.fresh:
                out[b].index_copy_(1, qi, block_out.to(out.dtype))
                lse[b].index_copy_(1, qi, block_lse.to(lse.dtype))
            else:
                acc_out, acc_lse = out[b].index_select(1, qi), lse[b].index_select(1, qi)
                merge_attn_out_(acc_out, acc_lse, block_out, block_lse)
                out[b].index_copy_(1, qi, acc_out)
                lse[b].index_copy_(1, qi, acc_lse)


def packed_backward_(dq, dk, dv, dout, q, k, v, out, lse_rows, blocks, scale: float, kernel: AttnKernel,
                     cache: PackedCallCache) -> None:
    """:func:`~.blocks.blocks_backward_` with a packed kernel (``lse_rows``: a :class:`~.blocks.LseRows`)."""
    for call in cache.calls(plan_key(blocks), q.device):
        qi, ki, qs, ks = call.q_index, call.kv_index, call.q_span, call.kv_span
        for b in range(q.shape[0]):
            lse_b = lse_rows(slice(*qs))[b] if qs else lse_rows.lse[b].index_select(1, qi)
            grads = kernel.backward(
                _rows(dout[b], qi, qs), _rows(q[b], qi, qs), _rows(k[b], ki, ks), _rows(v[b], ki, ks),
                _rows(out[b], qi, qs), lse_b, call.cu_q, call.cu_k, call.max_q, call.max_k,
                causal=call.causal, scale=scale)
            for acc, index, rows, grad in ((dq, qi, qs, grads[0]), (dk, ki, ks, grads[1]), (dv, ki, ks, grads[2])):
                _add_rows_(acc[b], index, rows, grad)
