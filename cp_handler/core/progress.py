"""Progress of cp-train and cp-bench: a tqdm bar on a terminal, plain lines in a log.

A redrawn bar writes ``\r`` into a file; when stderr is not a terminal each update every ``every``
items (and the last) prints one line instead: ``<program>: <what> k/N key value ...``.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """Progress over ``total`` items.

    Args:
        total: number of items.
        label: the line prefix (``"cp-train: step"``); the bar shows its last word.
        enabled: ``False`` prints nothing (ranks other than 0).
        every: plain lines every this many items (default: a tenth of ``total``).
        initial: items already done (a resumed run counts on from its checkpoint's step).
    """

    def __init__(self, total: int, label: str, enabled: bool = True, every: int | None = None, stream=None,
                 initial: int = 0):
        self.stream = stream or sys.stderr
        self.total, self.label, self.enabled = total, label, enabled
        self.every = every or max(1, (total - initial) // 10)
        self.terminal = enabled and self.stream.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=label.split(": ")[0], disable=not self.terminal,
                        file=self.stream)
        self.done = initial

    def begin(self, **shown) -> None:
        """The next item starts (``shown``: what it is): on a terminal the bar shows it, in a log one line
        ``<label> k/N started key value`` (with ``every=1`` only: per-item progress of long items)."""
        if self.terminal:
            self.bar.set_postfix(**shown, refresh=True)
        elif self.enabled and self.every == 1:
            fields = "".join(f" {k} {v}" for k, v in shown.items())
            print(f"{self.label} {self.done + 1}/{self.total} started{fields}", file=self.stream, flush=True)

    def update(self, **shown) -> None:
        """One more item done; ``shown`` (name -> text) goes after the bar or on the line."""
        self.done += 1
        if self.terminal:
            self.bar.set_postfix(**shown, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.done % self.every == 0 or self.done == self.total):
            fields = "".join(f" {k} {v}" for k, v in shown.items())
            print(f"{self.label} {self.done}/{self.total}{fields}", file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()
