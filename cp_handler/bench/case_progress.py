"""Progress of every cp-bench mode, one helper for all: a tqdm bar when stderr is a terminal, else one line per case
(:class:`~cp_handler.core.progress.Progress` with ``every=1``) when it starts and when it ends:
``cp-bench: launches 3/36 started case p2p thd S=16384 cp=4``, then
``cp-bench: launches 3/36 case p2p thd S=16384 cp=4``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ..core.progress import Progress

T = TypeVar("T")


def case_progress(total: int, what: str, enabled: bool = True) -> Progress:
    """Progress over ``total`` cases of ``what`` (``"launches"``, ``"attn cp=2"``), a line for each case done;
    ``enabled=False`` prints nothing (ranks other than 0)."""
    progress = Progress(total, f"cp-bench: {what}", enabled=enabled, every=1)
    progress.bar.set_description(f"cp-bench {what}", refresh=False)  # the bar names the mode too
    return progress


def each_case(items: Iterable[T], what: str, describe: Callable[[T], str] = str) -> Iterator[T]:
    """Yield each of ``items``; once the caller is done with one (it asks for the next, or stops), one
    :func:`case_progress` update showing ``describe(item)``."""
    items = list(items)
    bar = case_progress(len(items), what)
    try:
        for item in items:
            bar.begin(case=describe(item))
            yield item
            bar.update(case=describe(item))
    finally:
        bar.close()
