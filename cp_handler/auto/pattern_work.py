"""What one attention layer costs each rank under each communication pattern: its block work and its transfers.

A pattern's cost on one rank (forward + backward of one attention layer) is counted, not guessed: the block plans
are the ones the pattern runs (:func:`~cp_handler.ops.ring.step_plans` per ring step, the halo exchange's plan
when a window or chunks let it replace the ring, :func:`~cp_handler.ops.all_gather.all_gather_blocks`, the a2a's
ring over the inner layout), so windows, chunks and thd padding enter exactly as the code runs them. Each plan is
reduced to a few features (:class:`PlanWork`: visible score pairs of causal diagonal blocks and of full or masked
blocks, rows touched, blocks, steps, all times the heads and head widths a rank holds); a profile's compute fit
(:class:`~.profile.ComputeFit`) turns them into milliseconds. The transfers are the collectives the pattern posts
(:class:`Transfer`: kind, group size, bytes of one rank's payload, whether it overlaps compute), derived from the
ops' code and checked against :func:`~cp_handler.ops.collectives.count_comms` in ``tests/test_auto_plan.py``:

* ``p2p``: ``cp - 1`` ring steps forward, each passing one K/V shard (``B L Hkv (D + Dv) e`` bytes for ``L`` local
  rows, ``e`` the element size); backward the same K/V ring and ``cp - 1`` sends of an fp32 dK/dV shard; overlapped
  with the step's blocks. A window or chunks short enough: one uneven all-to-all of the halo rows instead, and its
  reverse for their gradients.
* ``all_gather``: K/V all-gathered forward and again backward, per chunk of KV heads; dK/dV reduce-scattered in
  fp32; every chunk's gather but the first, and every reduce-scatter but the last, overlap a chunk's compute.
* ``a2a`` / ``a2a+p2p``: q, k, v in one all-to-all and the output back in another, the same two backward; heads
  padded or KV heads replicated as :func:`~cp_handler.ops.ulysses.a2a_head_plan` does; then the ring (or the halo
  exchange) over the outer level on the inner layout, ``H' / A`` heads per rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..core.layout import ZigzagDocs
from ..core.masks import CAUSAL, AttentionMask
from ..ops.all_gather import all_gather_blocks, kv_head_chunks
from ..ops.halo import halo_applies, halo_plan
from ..ops.patterns import PATTERNS
from ..ops.ring import local_blocks_split, step_plans
from ..ops.ulysses import a2a_head_plan

FP32_BYTES = 4
"""Gradients travel in the accumulation dtype (:func:`~cp_handler.ops.merge.acc_dtype`): fp32 (fp64 stays fp64)."""


@dataclass(frozen=True)
class AttnCase:
    """One attention layer's call as the planner sees it (the same on every rank of the group).

    Attributes:
        lengths: real tokens of each document (bshd: one sequence of ``S`` tokens; thd: the pack's documents).
        batch: sequences of the batch (bshd; 1 for thd).
        heads, kv_heads: query and key/value heads (``heads % kv_heads == 0``).
        head_dim, v_head_dim: widths of q/k and of v (multi-head latent attention: they differ).
        element_bytes: bytes per element of q, k, v (bf16: 2).
        mask: the layer's :class:`~cp_handler.core.masks.AttentionMask`.
        cp: the CP group's size.
        hierarchical: ``(a2a, p2p)`` level sizes when the group has two levels (``a2a+p2p`` is a candidate then).
        backward: forward + backward (training, the default); ``False``: the forward alone (prefill, inference):
            the forward's transfers, and :data:`FORWARD_SHARE` of the compute a fit of forward + backward prices.
    """

    lengths: tuple[int, ...]
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    v_head_dim: int = 64
    element_bytes: int = 4
    mask: AttentionMask = CAUSAL
    cp: int = 2
    hierarchical: tuple[int, int] | None = None
    backward: bool = True

    def __post_init__(self):
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"AttnCase: heads={self.heads}, kv_heads={self.kv_heads}: need heads % kv_heads == 0")
        if self.hierarchical is not None and math.prod(self.hierarchical) != self.cp:
            raise ValueError(f"AttnCase: hierarchical={self.hierarchical} must multiply to cp={self.cp}")

    @property
    def tokens(self) -> int:
        return self.batch * sum(self.lengths)

    @property
    def local_elements(self) -> int:
        """Elements of one rank's q, k and v (its padded rows)."""
        rows = self.batch * self.layout(self.cp).local_len
        return rows * (self.heads * self.head_dim + self.kv_heads * (self.head_dim + self.v_head_dim))

    def layout(self, size: int) -> ZigzagDocs:
        """The documents over ``size`` ranks (bshd: one unpadded sequence, as the handler's layout)."""
        if len(self.lengths) == 1 and self.lengths[0] % (2 * size) == 0:
            return ZigzagDocs.uniform(self.lengths[0], size)
        return ZigzagDocs.from_lengths(self.lengths, size)


@dataclass(frozen=True)
class PlanWork:
    """One rank's attention compute, forward + backward, as features a compute fit prices. Units: 1e9 for the
    score terms, 1e6 for rows. ``causal_pairs`` / ``full_pairs``: visible score pairs of causal diagonal blocks /
    of full and masked blocks (their whole area), times query heads (x batch) and ``D + Dv`` (the matmuls);
    ``scores``: the same pairs times heads only (the softmax: exponentials do not grow with the head dim);
    ``masked_area``: score pairs of masked blocks, once (a mask is built per block, not per head); ``rows``: query
    plus key rows of every block, times heads and ``D + Dv`` (copies, merges); ``blocks``: block calls;
    ``steps``: plans run one after another (ring steps); ``kv_pairs``: the visible score pairs times the **key-value**
    heads (x batch) and ``D + Dv``: the K/V side of the matmuls, which a kernel running several query heads per
    key-value head (GQA) reads once per group (measured on CPU: 8 query heads over 1 key-value head ran the ring
    ~20% faster than over 8, docs/performance.md)."""

    causal_pairs: float = 0.0
    full_pairs: float = 0.0
    scores: float = 0.0
    masked_area: float = 0.0
    rows: float = 0.0
    blocks: int = 0
    steps: int = 0
    kv_pairs: float = 0.0

    def features(self) -> tuple[float, ...]:
        return (self.causal_pairs, self.full_pairs, self.scores, self.masked_area, self.rows, float(self.blocks),
                float(self.steps), self.kv_pairs)

    def __add__(self, other: PlanWork) -> PlanWork:
        return PlanWork(*(a + b for a, b in zip(self.features(), other.features(), strict=True)))


    def scaled(self, factor: float) -> PlanWork:
        return PlanWork(*(f * factor for f in self.features()))


FORWARD_SHARE = 0.26
"""The forward's share of a FlashAttention forward + backward (time): the backward does 2.5x the forward's matmul
FLOPs (5 matmuls to 2) at a lower rate. FA3 on an H100, head dim 128, 16k tokens: forward 648, backward 561
TFLOP/s (the FA3 paper's figures), so the backward takes 2.5 x 648 / 561 = 2.89 forwards: 1 / 3.89 = 0.26."""

FEATURES = ("causal_pairs", "full_pairs", "scores", "masked_area", "rows", "blocks", "steps", "kv_pairs")


@dataclass(frozen=True)
class Transfer:
    """One collective of one rank: ``kind`` (``p2p``: a ring step's send + receive; ``all_gather``,
    ``reduce_scatter``, ``all_to_all``), the group's size, ``nbytes`` (this rank's payload: what it sends on a ring
    step, its input to an all-gather or all-to-all, its output of a reduce-scatter), and whether it overlaps the
    compute of the same step (the ring posts each step's transfer before the step's blocks)."""

    kind: str
    group_size: int
    nbytes: int
    slot: int | None = None
    """The :class:`Slot` of :attr:`PatternWork.slots` whose compute this transfer runs under (``None``: nothing
    overlaps it)."""
    inner: bool = False
    """The all-to-all level of a hierarchical pattern (priced with the links of a group of its size)."""
    backward: bool = False
    """Posted by the backward (a forward-only case leaves it out)."""

    @property
    def bytes_sent(self) -> int:
        """What leaves the rank with a bandwidth-optimal collective (as :func:`~cp_handler.ops.collectives.count_comms`
        counts it): the payload of a ring step, ``(n - 1)`` payloads of an all-gather or reduce-scatter,
        ``(n - 1) / n`` of an even all-to-all (the halo exchange's uneven one: its payload)."""
        n = self.group_size
        if self.kind == "p2p":
            return self.nbytes
        if self.kind in ("all_gather", "reduce_scatter"):
            return (n - 1) * self.nbytes
        return self.nbytes * (n - 1) // n


@dataclass(frozen=True)
class Slot:
    """A stretch of compute that transfers in flight run under: ``share`` of the pattern's compute (forward +
    backward, or the forward alone in a forward-only case), in the ``backward`` or the forward."""

    share: float
    backward: bool


@dataclass(frozen=True)
class PatternWork:
    """One rank's cost of one pattern: the compute of the slowest rank's plan (per ring step), the transfers, and
    the slots of compute the overlapped transfers run under (the schedule of the pattern's code; module doc)."""

    steps: tuple[PlanWork, ...]
    transfers: tuple[Transfer, ...]
    slots: tuple[Slot, ...] = ()
    elements: int = 0
    """The q, k and v elements the pattern copies and reorders on the rank (a measured profile prices them,
    :class:`~.profile.PatternFit`): the rank's own (:attr:`AttnCase.local_elements`), or for the all-to-all
    patterns what the all-to-all carries (heads padded, key-value heads replicated: :func:`~cp_handler.ops.ulysses.
    a2a_head_plan`)."""
    packed_elements: int = 0
    """Packed documents (thd) only, else 0: the query-side elements the rank's kernels run over (query rows times
    its query heads, after the all-to-all for ``a2a`` / ``a2a+p2p``, times ``D + Dv``: q and the output). Per
    document the ring patterns reorder and merge these rows (:mod:`cp_handler.ops.halves`, the all-to-all's inner
    order); a measured profile prices them per pattern (:class:`~.profile.PatternFit`): on this project's CPU the
    features alone under-priced the regret grid's thd packs under ``p2p``, ``a2a`` and ``a2a+p2p`` by up to 11-24%
    and under ``all_gather`` by up to 7% (docs/performance.md)."""

    @property
    def compute(self) -> PlanWork:
        total = PlanWork()
        for step in self.steps:
            total = total + step
        return total


def plan_work(blocks, heads: int, kv_heads: int, width: int) -> PlanWork:
    """Features of one plan on ``heads`` query and ``kv_heads`` key-value heads (x batch) of width ``D + Dv``."""
    causal = full = masked = rows = 0
    for q_rows, k_rows, kind in blocks:
        nq, nk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
        if kind is True:
            causal += nq * (nq + 1) // 2
        else:
            full += nq * nk
            if kind is not False:
                masked += nq * nk
        rows += nq + nk
    scale = heads * width
    return PlanWork(causal * scale / 1e9, full * scale / 1e9, (causal + full) * heads / 1e9, masked / 1e9,
                    rows * scale / 1e6, len(blocks), 1, (causal + full) * kv_heads * width / 1e9)


@dataclass(frozen=True)
class RankPlan:
    """One rank's blocks under a pattern: local query and K/V rows, its query and KV heads (per sequence of the
    batch), and the plan of each step (ring steps in order; one step for the others)."""

    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    steps: tuple[tuple, ...]


def _ring_plan(layout: ZigzagDocs, mask: AttentionMask, rank: int, heads: int, kv_heads: int) -> RankPlan:
    """The ring's plan on ``rank`` of ``layout``, or the halo exchange's when it replaces the ring."""
    if layout.size > 1 and halo_applies(layout, mask):
        plan = halo_plan(layout, mask, rank)
        return RankPlan(layout.local_len, layout.local_len + sum(plan.recv_splits), heads, kv_heads, (plan.blocks,))
    steps = tuple(tuple(b for plan in step_plans(layout, mask, False, s, rank) for b in plan)
                  for s in range(layout.size))
    return RankPlan(layout.local_len, layout.local_len, heads, kv_heads, steps)


def _kv_chunks(case: AttnCase) -> tuple[slice, ...]:
    """all_gather's KV-head chunks for ``case`` (the default chunking, by the gathered bytes)."""
    rows = case.batch * case.layout(case.cp).local_len * case.cp
    return kv_head_chunks(case.kv_heads, None, rows * case.kv_heads * (case.head_dim + case.v_head_dim) *
                          case.element_bytes)


def _a2a_levels(comm_type: str, case: AttnCase) -> tuple[int, int]:
    if comm_type == "a2a":
        return case.cp, 1
    if case.hierarchical is None:
        raise ValueError("cp_comm_type='a2a+p2p' needs two levels (AttnCase.hierarchical)")
    return case.hierarchical


@functools.lru_cache(maxsize=4096)
def rank_plan(comm_type: str, case: AttnCase, rank: int) -> RankPlan:
    """What ``rank`` of the group computes under ``comm_type`` (the plans the ops run; no communication).

    Raises:
        ValueError: an unknown comm type, or ``a2a+p2p`` for a case without two levels.
    """
    if comm_type not in PATTERNS:
        raise ValueError(f"cp_comm_type={comm_type!r} is not one of {list(PATTERNS)}")
    layout = case.layout(case.cp)
    if case.cp == 1 or comm_type == "p2p":
        return _ring_plan(layout, case.mask, rank, case.heads, case.kv_heads)
    if comm_type == "all_gather":  # the plan once per chunk of KV heads (and their query heads)
        chunks = len(_kv_chunks(case))
        kv_heads = -(-case.kv_heads // chunks)
        return RankPlan(layout.local_len, int(layout.cu_seqlens_padded[-1]), kv_heads * case.heads // case.kv_heads,
                        kv_heads, (tuple(all_gather_blocks(layout, rank, case.mask)),) * chunks)
    a2a, _ = _a2a_levels(comm_type, case)
    heads = a2a_head_plan(case.heads, case.kv_heads, a2a)
    return _ring_plan(layout.inner(a2a), case.mask, rank // a2a, heads.heads_per_rank, heads.kv_heads_per_rank)


def _slowest(plans: list[RankPlan], case: AttnCase) -> tuple[PlanWork, ...]:
    """Per step, the work of the rank with the most score pairs (a ring step ends when its slowest rank does)."""
    width = case.head_dim + case.v_head_dim
    steps = []
    for s in range(len(plans[0].steps)):
        works = [plan_work(p.steps[s], p.heads * case.batch, p.kv_heads * case.batch, width) for p in plans]
        steps.append(max(works, key=lambda w: w.causal_pairs + w.full_pairs))
    return tuple(steps)


def _shares(steps: tuple[PlanWork, ...]) -> list[float]:
    """Each step's share of the score pairs (the compute a transfer can hide under, step by step)."""
    pairs = [step.causal_pairs + step.full_pairs for step in steps]
    total = sum(pairs) or 1.0
    return [p / total for p in pairs]


def _ring_transfers(plans: list[RankPlan], size: int, kv_row_bytes: int, element_bytes: int,
                    steps: tuple[PlanWork, ...], tail: float) -> tuple[tuple[Transfer, ...], tuple[Slot, ...]]:
    """The ring's K/V shards and dK/dV partials with the slots they run under, or the halo exchange's all-to-all
    and its reverse (exposed). The ring's schedule (:mod:`cp_handler.ops.ring`): forward, step ``s + 1``'s K/V
    under step ``s``'s blocks; backward, step 1's K/V under the head of the local step (its share ``1 - tail``),
    step ``s + 1``'s K/V and step ``s - 1``'s dK/dV partial under step ``s``, the last partial under the tail."""
    if size == 1:
        return (), ()
    local = plans[0].q_len
    if len(plans[0].steps) != size:  # the halo exchange (one step; rank 0 may receive nothing): the rows the
        # busiest rank receives, both ways
        halo = max(p.kv_len - local for p in plans) * kv_row_bytes
        return (Transfer("all_to_all", size, halo), Transfer("all_to_all", size, halo, backward=True)), ()
    shard = local * kv_row_bytes
    partial = shard * FP32_BYTES // element_bytes
    w = _shares(steps)
    forward = [Slot(FORWARD_SHARE * w[s], False) for s in range(size - 1)]  # slots 0 .. size - 2
    back = FORWARD_SHARE
    backward = [Slot((1 - back) * w[0] * (1 - tail), True)] + \
        [Slot((1 - back) * w[s], True) for s in range(1, size)] + [Slot((1 - back) * w[0] * tail, True)]
    first_backward = len(forward)  # backward slot k (0: head, 1 .. size - 1: steps, size: tail) at first + k
    transfers = [Transfer("p2p", size, shard, s) for s in range(size - 1)]
    transfers += [Transfer("p2p", size, shard, first_backward + s, backward=True) for s in range(size - 1)]
    transfers += [Transfer("p2p", size, partial, first_backward + s + 1, backward=True) for s in range(1, size)]
    return tuple(transfers), tuple(forward + backward)


def _tail_share(layout: ZigzagDocs, mask: AttentionMask) -> float:
    """The share of the local step's score pairs the backward runs last (:func:`~cp_handler.ops.ring.
    local_blocks_split`'s tail, rank 0)."""
    head, tail = local_blocks_split(layout, 0, mask)
    pairs = [sum((q.stop - q.start) * ((q.stop - q.start + 1) / 2 if kind is True else k.stop - k.start)
                 for q, k, kind in blocks) for blocks in (head, tail)]
    return pairs[1] / (sum(pairs) or 1.0)


@functools.lru_cache(maxsize=1024)
def pattern_work(comm_type: str, case: AttnCase) -> PatternWork:
    """One rank's :class:`PatternWork` of ``comm_type`` for ``case`` (module doc); with ``case.backward`` False
    the forward's transfers alone (the ring's first ``cp - 1`` K/V steps, each chunk's first gather, the a2a's
    first two all-to-alls, the halo's first exchange) and :data:`FORWARD_SHARE` of each step's compute.

    Raises:
        ValueError: an unknown comm type, or ``a2a+p2p`` for a case without two levels.
    """
    if case.backward:
        return _pattern_work(comm_type, case)
    work = pattern_work(comm_type, dataclasses.replace(case, backward=True))
    slots = tuple(Slot(0.0 if slot.backward else slot.share / FORWARD_SHARE, slot.backward) for slot in work.slots)
    return PatternWork(tuple(step.scaled(FORWARD_SHARE) for step in work.steps),
                       tuple(t for t in work.transfers if not t.backward), slots, work.elements,
                       work.packed_elements)


def _pattern_work(comm_type: str, case: AttnCase) -> PatternWork:
    work = _transfers_and_steps(comm_type, case)
    if len(case.lengths) == 1:
        return work
    plan = rank_plan(comm_type, case, 0)  # all_gather's plan holds a chunk of the heads; it runs them all
    heads = plan.heads if comm_type in ("a2a", "a2a+p2p") else case.heads
    packed = case.batch * plan.q_len * heads * (case.head_dim + case.v_head_dim)
    return dataclasses.replace(work, packed_elements=packed)


def _transfers_and_steps(comm_type: str, case: AttnCase) -> PatternWork:
    plans = [rank_plan(comm_type, case, r) for r in range(case.cp)]
    steps = _slowest(plans, case)
    e, width = case.element_bytes, case.head_dim + case.v_head_dim
    if case.cp == 1:
        return PatternWork(steps, (), (), case.local_elements)
    if comm_type == "p2p":
        layout = case.layout(case.cp)
        return PatternWork(steps, *_ring_transfers(plans, case.cp, case.batch * case.kv_heads * width * e, e, steps,
                                                   _tail_share(layout, case.mask)), case.local_elements)
    if comm_type == "all_gather":  # per chunk of KV heads (the default chunks): gathered forward and backward
        transfers = []
        chunks = _kv_chunks(case)
        n = len(chunks)  # forward slot i: chunk i's blocks; backward slot n + i: chunk i's, which run chunk i + 1's
        # gather and chunk i - 1's reduce-scatter; the first gathers are exposed, and the last reduce-scatter
        slots = tuple(Slot(FORWARD_SHARE / n, False) for _ in range(n)) + \
            tuple(Slot((1 - FORWARD_SHARE) / n, True) for _ in range(n))
        for i, heads in enumerate(chunks):
            shard = plans[0].q_len * case.batch * (heads.stop - heads.start) * width * e
            transfers += [Transfer("all_gather", case.cp, shard, i - 1 if i else None),
                          Transfer("all_gather", case.cp, shard, n + i - 1 if i else None, backward=True),
                          Transfer("reduce_scatter", case.cp, shard * FP32_BYTES // e, n + i + 1 if i + 1 < n else None,
                                   backward=True)]
        return PatternWork(steps, tuple(transfers), slots, case.local_elements)
    a2a, outer = _a2a_levels(comm_type, case)
    heads = a2a_head_plan(case.heads, case.kv_heads, a2a)
    rows = case.layout(case.cp).local_len * case.batch
    qkv = rows * (heads.padded_heads * case.head_dim + heads.padded_kv_heads * heads.replicas * width) * e
    out = rows * heads.padded_heads * case.v_head_dim * e
    a2a_transfers = tuple(Transfer("all_to_all", a2a, n, inner=outer > 1, backward=i > 1)
                          for i, n in enumerate((qkv, out, out, qkv)))
    ring_row = case.batch * plans[0].kv_heads * width * e
    ring, slots = _ring_transfers(plans[::a2a], outer, ring_row, e, steps,
                                  _tail_share(case.layout(case.cp).inner(a2a), case.mask) if outer > 1 else 0.0)
    return PatternWork(steps, a2a_transfers + ring, slots, qkv // e)
