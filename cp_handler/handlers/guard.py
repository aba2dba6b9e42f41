"""What keeps a handler's ranks in step after a failure: the call guard (a handler whose call failed on this rank
refuses further calls) and the handler serial (how many handlers each rank built on a group, compared by the
agreement check). docs/architecture.md, "After an exception inside a handler call"."""

from __future__ import annotations

import torch.distributed as dist

from .agreement import RanksRefused

_serials: dict[str, int] = {}


def next_serial(group: dist.ProcessGroup | None) -> int:
    """How many handlers this process built on ``group`` before (compared across ranks by the
    agreement check: ranks that build their handlers in different orders would pair collectives of
    different batches)."""
    if group is None:
        return 0
    name = getattr(group, "group_name", None) or str(dist.get_process_group_ranks(group))
    _serials[name] = _serials.get(name, -1) + 1
    return _serials[name]


class Guard:
    """The guard of a handler call (``with Guard(handler, name):``): it refuses to run on a handler whose earlier
    call failed on this rank, and marks the handler failed when the call raises at cp > 1 (except a
    :class:`~.agreement.RanksRefused`, which every rank raised at the same point). After such a failure the ranks'
    collectives may no longer be paired (another rank may be inside one): reusing the handler could pair them
    with the wrong ones. A context manager, not a wrapper: the call's own frame runs the work."""

    __slots__ = ("handler", "name")

    def __init__(self, handler, name: str):
        self.handler, self.name = handler, name

    def __enter__(self) -> None:
        if self.handler.failure is not None:
            refuse(self.handler, self.name)

    def __exit__(self, kind, err, tb) -> None:
        if err is not None:
            failed(self.handler, self.name, err)


def refuse(handler, name: str):
    """Raise the RuntimeError of a call ``name`` on a handler whose earlier call failed (:class:`Guard`)."""
    raise RuntimeError(f"{type(handler).__name__}.{name}: an earlier call of this handler failed on this rank "
                       f"({handler.failure}); its ranks' collectives may be out of step, so it refuses every further "
                       "call: build a new handler on every rank (docs/architecture.md)")


def failed(handler, name: str, err: BaseException) -> None:
    """Mark ``handler`` failed by ``err`` raised in its call ``name`` (:class:`Guard`; the hot path of ``core_attn``
    calls it inline, only when a call raised)."""
    if not isinstance(err, RanksRefused) and handler.failure is None and handler.cp_size > 1:
        handler.failure = f"{name}: {type(err).__name__}: {err}"

