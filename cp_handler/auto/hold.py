"""``"auto"`` per layer with hysteresis: a layer keeps the pattern it runs on until another is predicted faster by a
margin, so batches whose predictions sit close together do not flip the layer from one pattern to another (each
flip builds other plans and, under ``torch.compile``, other graphs).

A :class:`PatternHold` lives as long as a run (``cp-train`` makes one and gives it to every batch's handler;
``LocalContextParallelHandler(cp_comm_hold=...)``): per layer and CP size, the pattern held. ParaDySe
(arXiv 2511.13198) keeps the previous sequence's plan when it is within 5% of the new best; the default margin is
that. The inputs of a decision (the call's predictions, the held pattern) are the same on every rank of a CP
group, and so is the decision; the handler's agreement compares it.
"""

from __future__ import annotations

from .choice import AutoChoice

MARGIN = 0.05
"""Switch only when the best pattern is predicted this much faster (relative) than the held one."""


class PatternHold:
    """Each layer's pattern, held across calls (module doc).

    Args:
        margin: the relative gain that makes a layer switch (default :data:`MARGIN`; 0: always the best).

    Raises:
        ValueError: a margin below 0.
    """

    def __init__(self, margin: float = MARGIN):
        if not margin >= 0:
            raise ValueError(f"PatternHold: margin={margin!r} must be >= 0 (a relative gain, e.g. 0.05)")
        self.margin = float(margin)
        self.held: dict[tuple[int | None, int], str] = {}
        """``(layer number, CP size)`` -> the pattern the layer runs."""
        self.switches = 0
        """How many times a layer left its pattern for another."""

    def pick(self, layer: int | None, cp: int, choice: AutoChoice) -> str:
        """The pattern ``layer`` runs for ``choice`` (the call's predictions): the held one unless the best is
        predicted faster by more than :attr:`margin`, or the held one is not a candidate of this call."""
        key = (layer, cp)
        held = self.held.get(key)
        times = {p.comm_type: p.total_ms for p in choice.predictions}
        if held is None or held not in times or times[choice.comm_type] * (1 + self.margin) < times[held]:
            self.switches += held is not None and held != choice.comm_type
            self.held[key] = choice.comm_type
        return self.held[key]


def hold_for(config) -> dict:
    """``{"cp_comm_hold": PatternHold()}`` for a run whose ``config`` (a
    :class:`~cp_handler.runtime.config.ContextParallelConfig`) has ``"auto"`` among its comm types, else ``{}``: the
    keyword a run passes to every batch's ``build_cp_handler`` (one hold for the run)."""
    return {"cp_comm_hold": PatternHold()} if "auto" in config.comm_types else {}
