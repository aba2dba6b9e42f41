"""The cost model against published GPU results (``cp-bench --modes backtest``): no GPU, no ranks.

Each row of :data:`~.published.GROUPS` is priced by :func:`~cp_handler.auto.choice.predict` on its group's named
profile (:data:`~cp_handler.auto.catalog.GPUS`: modelled, never fitted to these rows), forward only or forward +
backward as published, the mean over the packs a benchmark cycles through. Every pair of rows in a group is then a
comparison: the published time ratio against the predicted one.

* **winner**: the model names the faster row of the pair. Pairs whose published times are within
  :data:`TIE` of each other are ties: they count in the ratio check, not here.
* **ratio**: the predicted ratio within :data:`RATIO_TOLERANCE` of the published one
  (``|predicted / published - 1| <= 0.25``).

Targets (issue 72): the winner in >= 90% of the pairs, the ratio in >= 80%. Absolute times are listed too
(predicted / published): the profiles model this library's kernels, not each benchmark's.
"""

from __future__ import annotations

import itertools
import statistics

from ..auto import load_profile
from ..auto.choice import predict
from ..auto.pattern_work import AttnCase
from ..core.masks import CAUSAL, AttentionMask
from .case_progress import each_case
from .published import GROUPS, PublishedGroup, PublishedRow

TIE = 0.03
"""Published times this close (relative) are a tie: no winner to predict."""
RATIO_TOLERANCE = 0.25
TARGETS = {"winner": 0.90, "ratio": 0.80}


def published_ms(group: PublishedGroup, row: PublishedRow) -> float:
    """The row's time in milliseconds (``iter/s`` inverted)."""
    return 1e3 / row.value if group.metric == "iter/s" else row.value


def contiguous_imbalance(pack: tuple[int, ...], cp: int, causal: bool) -> float:
    """The busiest rank's visible score pairs over the mean when ``cp`` ranks hold contiguous, equal slices of the
    pack (documents one after another; causal: a query sees its document's keys up to itself): the factor by
    which the slowest rank's compute exceeds a balanced (zigzag) split's."""
    total, starts = sum(pack), []
    start = 0
    for n in pack:
        starts.append((start, n))
        start += n
    per_rank = total / cp
    loads = []
    for r in range(cp):
        lo, hi = r * per_rank, (r + 1) * per_rank
        pairs = 0.0
        for s, n in starts:
            a, b = max(lo, s), min(hi, s + n)
            if a < b:  # queries a..b of the document at s: (a - s + 1) + ... + (b - s) keys each when causal
                pairs += ((b - s) * (b - s + 1) - (a - s) * (a - s + 1)) / 2 if causal else (b - a) * n
        loads.append(pairs)
    return max(loads) / statistics.fmean(loads)


def predicted_ms(group: PublishedGroup, row: PublishedRow) -> float:
    """The model's time of the row: mean over its packs of one attention call (forward, or forward + backward); a
    ``contiguous`` row's compute x :func:`contiguous_imbalance` (the model's layouts are zigzag-balanced)."""
    profile = load_profile(group.profile)
    mask = CAUSAL if group.causal else AttentionMask(causal=False)
    times = []
    for pack in row.packs:
        case = AttnCase(pack, group.batch, group.heads, group.kv_heads, group.head_dim, group.head_dim, 2, mask, row.cp,
                        row.levels, group.backward)
        p = predict(row.pattern, case, profile, "bfloat16")
        extra = p.compute_ms * (contiguous_imbalance(pack, row.cp, group.causal) - 1) if row.contiguous else 0.0
        times.append(p.total_ms + extra)
    return statistics.fmean(times)


def describe(group: PublishedGroup, row: PublishedRow) -> str:
    levels = f" {row.levels[0]}x{row.levels[1]}" if row.levels else ""
    return f"{row.pattern}{levels}{' contiguous' if row.contiguous else ''} cp {row.cp}"


def compare(group: PublishedGroup) -> tuple[list[dict], list[dict]]:
    """The group's rows (published and predicted ms) and every pair's comparison."""
    rows = [{"group": group.key, "row": describe(group, r), "published_ms": published_ms(group, r),
             "predicted_ms": predicted_ms(group, r)} for r in group.rows]
    pairs = []
    for a, b in itertools.combinations(rows, 2):
        published, predicted = a["published_ms"] / b["published_ms"], a["predicted_ms"] / b["predicted_ms"]
        tie = abs(published - 1) < TIE
        pairs.append({"group": group.key, "pair": f"{a['row']} / {b['row']}", "published_ratio": published,
                      "predicted_ratio": predicted, "tie": tie,
                      "winner_right": None if tie else (published < 1) == (predicted < 1),
                      "ratio_right": abs(predicted / published - 1) <= RATIO_TOLERANCE})
    return rows, pairs


def run(args) -> dict:
    """``--modes backtest``: every published group, a progress line each; the rows, the pairs and the summary."""
    rows, pairs = [], []
    for group in each_case(list(GROUPS), "backtest", lambda g: g.key):
        r, p = compare(group)
        rows += r
        pairs += p
    judged = [p for p in pairs if p["winner_right"] is not None]
    summary = {"groups": len(GROUPS), "rows": len(rows), "pairs": len(pairs), "ties": len(pairs) - len(judged),
               "winner_right": sum(p["winner_right"] for p in judged) / len(judged),
               "ratio_right": sum(p["ratio_right"] for p in pairs) / len(pairs),
               "targets": TARGETS, "tie": TIE, "ratio_tolerance": RATIO_TOLERANCE}
    sources = [{"group": g.key, "source": g.source, "where": g.where, "tag": g.tag, "profile": g.profile,
                "note": g.note} for g in GROUPS]
    return {"rows": rows, "pairs": pairs, "summary": summary, "sources": sources}
