"""The agreement of the ranks of a CP group: one small all-gather per handler and kind of call, after which
every rank raises the same error when a rank failed its local checks or the ranks' values differ.

A compared value is an int (a length, a head count: compared and printed as is) or a text (a layout, a dtype,
an attention variant: compared by its crc32, printed as the text). On success the cost is one all-gather of
int64; only a disagreement gathers the differing fields' texts (one object all-gather that every rank enters,
as every rank finds the disagreement in the same gathered tensor).
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

from ..ops.collectives import all_gather_single

CHECK_RANKS_ENV = "CP_HANDLER_CHECK_RANKS"
"""Set to ``0`` to skip the cross-rank agreement checks (default on); the handler argument
``check_ranks`` takes precedence."""

SHOWN_CHARS = 200
"""The longest value text a disagreement quotes; a longer one is quoted from shortly before where the ranks'
texts start to differ."""


def ranks_check_enabled(check_ranks: bool | None) -> bool:
    """The handler's ``check_ranks`` argument, else ``CP_HANDLER_CHECK_RANKS`` (default on)."""
    if check_ranks is not None:
        return bool(check_ranks)
    return os.environ.get(CHECK_RANKS_ENV, "1") not in ("0", "false", "False")


class RanksRefused(ValueError):
    """Raised by :func:`check_ranks_agree` on every rank of the group at the same point, before any
    collective of the call: the ranks stay in step (the handler is not poisoned)."""


class RanksRefusedType(RanksRefused, TypeError):
    """:class:`RanksRefused` where every failing rank's own error was a TypeError (a wrong type)."""


def _as_int(field: str, value: int | str) -> int:
    """The int compared for ``value``: an int as is, a text by its crc32 (TypeError otherwise: a caller's bug)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    raise TypeError(f"agreement field {field}={value!r} must be an int or a str")


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks [0, 2]``, ``ranks [0-5, 7]`` (runs of consecutive ranks as ranges)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None], strict=True):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}{', ' if prev == start + 1 else '-'}{prev}")
            start = cur
    return f"ranks [{', '.join(runs)}]"


def _shorten(texts: list[str]) -> list[str]:
    """The distinct ``texts`` of one field, each cut to :data:`SHOWN_CHARS` from shortly before the first
    character where they differ (a long layout's lists differ deep inside)."""
    if max(map(len, texts)) <= SHOWN_CHARS:
        return texts
    start = max(0, len(os.path.commonprefix(texts)) - 40)
    return [("..." if start else "") + t[start:start + SHOWN_CHARS] + ("..." if len(t) > start + SHOWN_CHARS else "")
            for t in texts]


def describe_disagreement(fields: list[str], texts: list[list[str]]) -> str:
    """``fields`` with each rank's text (``texts[rank][i]`` of ``fields[i]``): per field, each distinct value
    once with the ranks that hold it, e.g. ``variant (ranks [0, 2]: ...window_size=(3, 0)...; ranks [1, 3]:
    ...window_size=(4, 0)...)``."""
    parts = []
    for i, field in enumerate(fields):
        holders: dict[str, list[int]] = {}
        for rank, row in enumerate(texts):
            holders.setdefault(row[i], []).append(rank)
        shown = _shorten(list(holders))
        parts.append(f"{field} (" + "; ".join(f"{_ranks(r)}: {s}" for r, s in zip(holders.values(), shown,
                                                                                    strict=True)) + ")")
    return ", ".join(parts)


def check_ranks_agree(group: dist.ProcessGroup, what: str, values: dict[str, int | str], device,
                      error: Exception | None = None) -> None:
    """All-gather ``values`` and this rank's pass/fail over ``group``: when any rank failed its local checks
    (``error``), every rank raises the same :class:`RanksRefused` quoting each failing rank's message; when the
    values differ, every rank raises the same :class:`RanksRefused` naming each differing field and each rank's
    value (ints as ints, texts as texts), e.g. ``core_attn (layer_number 1): the ranks of the CP group disagree
    on variant (rank 0: cp_comm_type='p2p', ..., attn_mod.window_size=(3, 0), ...; rank 1: ...)``.

    Args:
        values: field -> an int (compared as is) or a str (compared by crc32), the same fields on every rank.

    Cost: one all-gather of ``len(values) + 1`` int64 per call (docs/architecture.md has the measured
    time), plus one object all-gather when a rank failed or the ranks disagree.

    Raises:
        RanksRefused (RanksRefusedType where every failing rank's error was a TypeError): on every rank.
        TypeError: a value neither an int nor a str (on this rank, before the all-gather).
    """
    fields = list(values)
    local = torch.tensor([int(error is not None), *(_as_int(f, values[f]) for f in fields)], dtype=torch.int64,
                         device=device)
    size = dist.get_world_size(group)
    gathered = torch.empty(size * len(local), dtype=torch.int64, device=device)
    all_gather_single(gathered, local, group)
    rows = gathered.view(size, len(local)).tolist()
    if any(row[0] for row in rows):
        messages = [None] * size
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
        failed = "; ".join(f"rank {i}: {m}" for i, m in enumerate(messages) if m is not None)
        kind = RanksRefusedType if all(m.startswith("TypeError") for m in messages if m) else RanksRefused
        raise kind(f"{what}: the inputs of some ranks of the CP group were refused ({failed}); every rank "
                   "stops here, before any collective of this call") from error  # this rank's own (None: another's)
    differing = [i for i in range(len(fields)) if any(row[i + 1] != rows[0][i + 1] for row in rows)]
    if differing:  # every rank found the same fields in the same rows: all enter the gather below together
        texts = [None] * size
        dist.all_gather_object(texts, [str(values[fields[i]]) for i in differing], group=group)
        listing = describe_disagreement([fields[i] for i in differing], texts)
        raise RanksRefused(f"{what}: the ranks of the CP group disagree on {listing}; every rank must pass the same "
                           "batch layout (sequence length, cu_seqlens, dtype, heads), attention variant and comm type, "
                           "and build its handlers in the same order (serial)")


class RankAgreement:
    """A handler's agreement component: once per kind of call (``what``), every rank of the CP group compares
    its pass/fail and its values (:func:`check_ranks_agree`), with the handler's serial.

    Args:
        group: the CP group (``None``, or one rank: no agreement, a local error is raised as is).
        serial: how many handlers this process built on ``group`` before this one (:func:`~.guard.next_serial`).
        enabled: the handler's ``check_ranks`` (:func:`ranks_check_enabled`).
    """

    __slots__ = ("group", "serial", "enabled", "done")

    def __init__(self, group: dist.ProcessGroup | None, serial: int, enabled: bool):
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.serial, self.enabled = serial, enabled
        self.done: set[str] = set()
        """The kinds of call already agreed (each is agreed once per handler)."""

    def agree(self, what: str, values: dict[str, int | str], device, error: Exception | None = None,
              every_call: bool = False) -> None:
        """Once per ``what`` (``every_call``: at every call): every rank passed its local checks (``error`` is this
        rank's failure) with the same ``values`` and handler serial, else the same :class:`RanksRefused` on every
        rank; skipped at cp=1, when disabled, or after the first call of this kind (then a local ``error`` is raised
        on this rank alone: the calls whose inputs can differ by rank at a later call, a handler reused for another
        batch, agree at every call)."""
        if self.group is None or not self.enabled or (what in self.done and not every_call):
            if error is not None:
                raise error
            return
        check_ranks_agree(self.group, what, {"handler serial": self.serial, **values}, device, error)
        self.done.add(what)

    def checked(self, what: str, device, fields: tuple[str, ...], local_checks,
                every_call: bool = False) -> dict[str, int | str]:
        """Run ``local_checks() -> {field: int or str}`` (this rank's checks, no collective) and fold its pass/fail
        into :meth:`agree` (``every_call``: agreed at every call): a rank whose checks fail still joins the
        agreement, so every rank raises the same error instead of the others entering a collective alone. Returns
        the values (missing fields 0)."""
        try:
            values, error = local_checks(), None
        except (ValueError, TypeError, NotImplementedError) as err:
            values, error = dict.fromkeys(fields, 0), err
        values = {field: values.get(field, 0) for field in fields}  # the same fields on every rank
        self.agree(what, values, device, error, every_call)
        return values
