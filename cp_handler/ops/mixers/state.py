"""State passing for linear recurrences under CP: every chunk's entry state from the other chunks' summaries.

Every recurrence here (gated delta rule, Kimi delta attention, Mamba2's SSD, Mamba's selective scan) updates
its state affinely, ``S_t = A_t S_{t-1} + B_t`` with ``A_t, B_t`` independent of ``S``, so a chunk maps the
state it starts from to the state it ends with as ``S_end = P S_in + Q`` (``P``: the product of the ``A_t``;
``Q``: its final state from a zero start). That pair, the chunk's *summary*, does not grow with the sequence.
Each rank computes its chunks' summaries, one all-gather gives every rank every chunk's (:func:`entry_states`),
and each rank folds, per document, the summaries of the chunks before each of its own: chunk ``j`` starts from
``fold(0..j-1)``, chunk 0 from zero. No relayout of the zigzag: only the chunks' order in their document
matters, not which rank holds them.

The fold differentiates through autograd; the all-gather's backward sums every rank's gradient of a summary
into its owner (a reduce-scatter). Summaries and the fold stay in float32 (the kernels return float32 states).
The same state passing as FLA's context parallelism (``fla/ops/cp``) and Megatron-LM's proposed Mamba2 state
passing (PR #6808), here on the zigzag chunks of every document instead of contiguous rank shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.layout import ZigzagDocs, zigzag_chunk_owner
from ..collectives import all_gather_summed
from .segments import SegmentGroup, SegmentPlan, assemble, from_segments

Apply = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``apply(summary, state)``: the state after a chunk with ``summary`` entered with ``state`` (``None``: zero)."""


def entry_states(summaries: torch.Tensor, plan: SegmentPlan, layout: ZigzagDocs, rank: int, group,
                 apply: Apply) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """The state every local chunk starts from, in slot order (``None``: zero, a document's first chunk), and the
    gathered summaries ``(size, slots, ...)``.

    Args:
        summaries: ``(slots, ...)`` this rank's chunks' summaries in slot order (float32; any value for a chunk
            without real tokens: only padding-only chunks come after it in its document).
        plan, layout, rank: this rank's segments (:func:`~.segments.segment_plan`).
        group: the CP group (one all-gather of ``summaries``).
        apply: how a summary acts on a state (the recurrence's composition).
    """
    gathered = all_gather_summed(summaries, group)  # (size, slots, ...)
    entries: list[torch.Tensor | None] = [None] * len(plan.segments)
    mine = {(seg.doc, seg.chunk): seg.slot for seg in plan.segments}
    for i in range(layout.num_docs):
        state = None
        for chunk in range(2 * layout.size):
            if (i, chunk) in mine:
                entries[mine[i, chunk]] = state
            owner, half = zigzag_chunk_owner(chunk, layout.size)
            state = apply(gathered[owner, 2 * i + half], state)
    return entries, gathered


Run = Callable[[SegmentGroup], tuple[torch.Tensor, torch.Tensor]]
"""``run(group) -> (out, summary)``: the kernel on a group's chunks stacked along the batch, from a zero state."""
Correct = Callable[[SegmentGroup, torch.Tensor, torch.Tensor], torch.Tensor]
"""``correct(group, out, entry)``: the group's exact output given its chunks' entry states ``(n * B, ...)``."""


def pass_states(plan: SegmentPlan, layout: ZigzagDocs, rank: int, group, *, seq_dim: int, blank: torch.Tensor,
                summary_like: torch.Tensor, state_like: torch.Tensor, inputs: tuple[torch.Tensor, ...], run: Run,
                apply: Apply, correct: Correct) -> torch.Tensor:
    """A recurrence over the whole sequence from this rank's chunks (the module doc), in the local layout.

    Args:
        seq_dim: the sequence dim of the outputs. blank: an output with 0 rows along it (a rank may hold no real
            token). summary_like, state_like: a zero summary and a zero state ``(B, ...)`` (their shapes and
            dtypes, the same on every rank).
        inputs: the local inputs: every rank's summaries and outputs are tied to them and to the gathered summaries,
            so that the all-gather's backward runs on every rank even where no output depends on it.
        run, apply, correct: the recurrence's kernel call, composition and output correction.
    """
    parts = [(grp, *run(grp)) for grp in plan.groups]
    summaries = slot_summaries([(grp, summary) for grp, _, summary in parts], plan, summary_like)
    tie = sum(t.flatten()[0] for t in inputs if t.requires_grad) * 0  # 0, joining every rank's graph alike
    entries, gathered = entry_states(summaries + tie, plan, layout, rank, group, apply)
    outputs = [from_segments(correct(grp, out, stacked_entries(entries, grp.segments, state_like)), seq_dim,
                             len(grp.segments)) for grp, out, _ in parts]
    return assemble([blank, *outputs], seq_dim, plan) + gathered.sum() * 0


def plain_chunks(plan: SegmentPlan, *, seq_dim: int, blank: torch.Tensor,
                 run: Callable[[SegmentGroup], torch.Tensor]) -> torch.Tensor:
    """cp = 1 with documents: the kernel on every document alone from a zero state, in the local layout."""
    outputs = [from_segments(run(grp), seq_dim, len(grp.segments)) for grp in plan.groups]
    return assemble([blank, *outputs], seq_dim, plan)


def stacked_entries(entries: list[torch.Tensor | None], segments, like: torch.Tensor) -> torch.Tensor:
    """The entry states of ``segments`` stacked chunk-major along the batch (zeros for ``None``), as
    :func:`~.segments.to_segments` stacks their rows; ``like``: a state's shape and dtype ``(B, ...)``."""
    return torch.cat([entries[seg.slot] if entries[seg.slot] is not None else torch.zeros_like(like)
                      for seg in segments])


def slot_summaries(per_group: list[tuple[SegmentGroup, torch.Tensor]], plan: SegmentPlan,
                   like: torch.Tensor) -> torch.Tensor:
    """Every slot's summary ``(slots, B, ...)`` from each group's summaries ``(n * B, ...)`` (chunk-major), in
    ``like``'s dtype; ``like`` (zeros) for a chunk without real rows."""
    by_slot = {}
    for grp, summary in per_group:
        by_slot.update(zip((seg.slot for seg in grp.segments), summary.to(like.dtype).unflatten(0, (len(grp.segments),
                                                                                                   -1)), strict=True))
    return torch.stack([by_slot.get(seg.slot, like) for seg in plan.segments])
