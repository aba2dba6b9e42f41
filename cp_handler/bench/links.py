"""Emulated links (``cp-bench --modes links``): how much of each pattern's communication stays exposed when a link
is slow, measured on CPU ranks against the cost model.

:class:`EmulatedLinks` is a timing shim around the collectives cp_handler posts (``cp_handler.ops.collectives``
looks ``torch.distributed``'s functions up at each call, so the shim wraps them there, in the ranks' process
only; gloo itself is untouched): each collective still runs, and its completion (``wait()``, or the return of a
blocking call) is held back until ``latency + bytes / bandwidth`` after it was posted, the rank's link carrying one
transfer at a time (a transfer posted while another is in flight starts when that one ends). Bytes are those
:func:`~cp_handler.ops.collectives.count_comms` counts (what leaves the rank with a bandwidth-optimal collective).
The waiting is a sleep: an emulated transfer takes no core, as a GPU's copy engines or NCCL's own SMs take none
of the attention kernel's; what the ranks' compute does meanwhile is what the pattern overlaps.

The measurement: per pattern and pass (forward, backward), the slowest rank's time with the links emulated and
without (the same code, gloo's own speed), interleaved; the exposed communication is the difference. The link's
bandwidth is set per case so that a ring step's compute over its K/V transfer is a chosen ratio: 7.7 (an H100
NVLink ring at 4k tokens per rank, Llama-3-8B attention: 0.34 ms of FA3 forward against 44 us for the step's
16.8 MB at 380 GB/s), 123 (the same at 64k) and 0.5 (a link slower than the compute, where the model says the
exposure is transfer - compute). The model (:func:`predicted_exposed_ms`, :func:`cp_handler.auto.predict`'s rule):
the pass's transfers at that link, each overlapped one (the ring's K/V and dK/dV partials, all_gather's later
chunks) under its slot of the pattern's schedule (:class:`~cp_handler.auto.pattern_work.Slot`), every other
collective exposed in full.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from ..auto.pattern_work import FORWARD_SHARE, AttnCase, pattern_work
from ..core.masks import CAUSAL
from ..runtime.config import ContextParallelConfig
from ..runtime.groups import build_dp_cp_groups
from ..runtime.launch import launch, rank_session
from .auto import slowest_rank_seconds
from .calibrate import levels_of
from .case_progress import case_progress

RATIOS = (0.5, 7.7, 123.0)
"""Ring-step compute over its K/V transfer (module doc)."""
LATENCY_S = 20e-6
"""The emulated link's latency (NVLink's order, assumed)."""


class _Held:
    """A posted collective whose completion is held until ``done_at`` (``time.perf_counter`` seconds); the time its
    ``wait()`` blocks (gloo's own wait, then the emulated link's) is added to ``links.stalled_s``."""

    def __init__(self, works, done_at: float, links: EmulatedLinks):
        self.works, self.done_at, self.links = works, done_at, links

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        for work in self.works:
            work.wait(*args, **kwargs)
        _sleep_until(self.done_at)
        self.links.stalled_s += time.perf_counter() - start
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at and all(w.is_completed() for w in self.works)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class EmulatedLinks:
    """A context manager: within it, this process's collectives complete no sooner than ``latency_s + bytes /
    (gbps * 1e9)`` after they are posted, one transfer at a time per rank (module doc). ``transfers`` keeps each
    one's ``(kind, bytes, seconds)``; ``stalled_s`` adds up the seconds the rank is blocked on its collectives (a
    blocking call from its start, a posted one's ``wait()``: gloo's own transfer, then the emulated link's): its
    exposed communication, measured directly rather than as a difference of two pass times."""

    def __init__(self, latency_s: float, gbps: float):
        self.latency_s, self.gbps = latency_s, gbps
        self.busy_until = 0.0
        self.stalled_s = 0.0
        self.transfers: list[tuple[str, int, float]] = []
        self._saved: dict[str, object] = {}

    def _done_at(self, kind: str, nbytes: float) -> float:
        seconds = self.latency_s + nbytes / (self.gbps * 1e9)
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds
        self.transfers.append((kind, int(nbytes), seconds))
        return self.busy_until

    def _wrap(self, name: str, kind: str, sent):
        original = getattr(dist, name)
        self._saved[name] = original

        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            done_at = self._done_at(kind, sent(*args, **kwargs))
            result = original(*args, **kwargs)
            if isinstance(result, list):  # batch_isend_irecv: a work per op
                return [_Held([w], done_at, self) for w in result]
            if result is None:  # a blocking collective: it returns when its transfer would have
                _sleep_until(done_at)
                self.stalled_s += time.perf_counter() - start
                return None
            return _Held([result], done_at, self)
        setattr(dist, name, wrapped)

    def __enter__(self) -> EmulatedLinks:
        def size(kwargs, args, at):
            group = kwargs.get("group", args[at] if len(args) > at else None)
            return dist.get_world_size(group)

        def gathered(out, inp, *args, **kwargs):  # (n - 1) x input
            return inp.nbytes * (size(kwargs, args, 0) - 1)

        def scattered(out, inp, *args, **kwargs):  # (n - 1) / n x input
            n = size(kwargs, args, 0)
            return inp.nbytes * (n - 1) / n

        def all_to_all(out, inp, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
            n = size(kwargs, args, 0)
            if input_split_sizes is None:
                return inp.nbytes * (n - 1) / n
            row = inp[0].nbytes if inp.shape[0] else 0
            return row * (sum(input_split_sizes) - input_split_sizes[dist.get_rank(kwargs.get("group"))])

        def p2p(ops):
            return sum(op.tensor.nbytes for op in ops if op.op in (dist.isend, dist.send))

        for name, kind, sent in (("all_gather_single", "all_gather", gathered),
                                 ("all_gather_into_tensor", "all_gather", gathered),
                                 ("reduce_scatter_single", "reduce_scatter", scattered),
                                 ("reduce_scatter_tensor", "reduce_scatter", scattered),
                                 ("all_to_all_single", "all_to_all", all_to_all),
                                 ("batch_isend_irecv", "p2p", p2p)):
            if hasattr(dist, name):
                self._wrap(name, kind, sent)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()


@dataclasses.dataclass(frozen=True)
class LinkCase:
    """One pattern's attention layer on ``cp`` ranks: ``tokens`` (bshd, batch 1), heads, head dim, float32."""

    pattern: str
    cp: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int

    def attn_case(self, backward: bool = True) -> AttnCase:
        levels = levels_of(self.cp) if self.pattern == "a2a+p2p" else None
        return AttnCase((self.tokens,), 1, self.heads, self.kv_heads, self.head_dim, self.head_dim, 4, CAUSAL,
                        self.cp, levels, backward)


def _passes(case: LinkCase, groups):
    """``(forward, backward)`` callables of one layer through the local handler (the backward uses the last
    forward's output)."""
    from ..handlers import build_cp_handler

    hierarchical = case.pattern == "a2a+p2p"
    config = ContextParallelConfig(context_parallel_size=case.cp, cp_comm_type=case.pattern,
                                   hierarchical_context_parallel_sizes=list(levels_of(case.cp)) if hierarchical
                                   else None)
    handler = build_cp_handler(config, groups.cp_group, groups.hierarchical_cp_groups if hierarchical else None)
    g = torch.Generator().manual_seed(case.tokens)
    q, k, v, dout = (handler.dispatch(torch.randn(1, case.tokens, h, case.head_dim, generator=g), 1).contiguous()
                     for h in (case.heads, case.kv_heads, case.kv_heads, case.heads))
    for t in (q, k, v):
        t.requires_grad_(True)
    layer = torch.nn.Module()
    layer.layer_number = 1
    state = {}

    def forward():
        state["out"] = handler.core_attn(layer, q, k, v)

    def backward():
        state.pop("out").backward(dout)
        for t in (q, k, v):
            t.grad = None
    return forward, backward


def _ring_step_bytes(case: LinkCase) -> int:
    """Bytes of one ring step's K/V (the link is set against the p2p ring's step)."""
    ring = next(t for t in pattern_work("p2p", dataclasses.replace(case, pattern="p2p").attn_case()).transfers
                if t.kind == "p2p")
    return ring.nbytes


def links_worker(cases: list[LinkCase], ratios, reps: int) -> list[dict] | None:
    with rank_session("cp-bench", device_type="cpu"):
        world, rank0 = dist.get_world_size(), dist.get_rank() == 0
        groups = build_dp_cp_groups(world, "cpu", list(levels_of(world) or []) or None)
        bar = case_progress(len(cases), f"links cp={world}", enabled=rank0)
        rows = []
        for case in cases:
            describe = f"{case.pattern} S={case.tokens} cp={case.cp}"
            bar.begin(case=describe)
            forward, backward = _passes(case, groups)
            for _ in range(2):  # warm-up: plans, kernels, the ranks' agreement
                forward()
                backward()
            forward_s = []
            for _ in range(reps):
                forward_s.append(slowest_rank_seconds(forward))
                backward()
            step_s = statistics.median(forward_s) / case.cp
            for ratio in ratios:
                # the link: one ring step's compute (the forward's over cp) over the step's K/V transfer = ratio
                gbps = _ring_step_bytes(case) / max(step_s / ratio - LATENCY_S, 1e-9) / 1e9
                times = {(kind, name): [] for kind in ("plain", "emulated") for name in ("forward", "backward")}
                stalled = {key: [] for key in times}
                # gloo's own speed, its blocked time measured the same way (a link of no latency, no bandwidth limit)
                shims = {"plain": EmulatedLinks(0.0, float("inf")), "emulated": EmulatedLinks(LATENCY_S, gbps)}
                links = shims["emulated"]
                for _ in range(reps):  # interleaved: plain forward and backward, then emulated
                    links.transfers.clear()
                    for kind, shim in shims.items():
                        with shim:
                            for name, fn in (("forward", forward), ("backward", backward)):
                                shim.stalled_s = 0.0
                                times[kind, name].append(slowest_rank_seconds(fn))
                                stalled[kind, name].append(_max_over_ranks(shim.stalled_s))
                                if shim is links and name == "forward":
                                    forward_transfers = list(links.transfers)
                    backward_transfers = links.transfers[len(forward_transfers):]
                for name, transfers in (("forward", forward_transfers), ("backward", backward_transfers)):
                    compute, total = (statistics.median(times[kind, name]) for kind in ("plain", "emulated"))
                    rows.append({**dataclasses.asdict(case), "ratio": ratio, "gbps": gbps, "pass": name,
                                 "compute_ms": 1e3 * compute, "emulated_ms": 1e3 * total,
                                 "exposed_ms": 1e3 * (total - compute),
                                 "stalled_ms": 1e3 * statistics.median(stalled["emulated", name]),
                                 "plain_stalled_ms": 1e3 * statistics.median(stalled["plain", name]),
                                 "transfer_ms": 1e3 * sum(seconds for _, _, seconds in transfers),
                                 "transfers": len(transfers)})
            bar.update(case=describe)
        bar.close()
        return rows if rank0 else None


def _max_over_ranks(seconds: float) -> float:
    """The largest of the ranks' ``seconds`` (every rank calls it)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def predicted_exposed_ms(row: dict) -> tuple[float, float]:
    """The model's ``(transfer, exposed)`` milliseconds of a measured row, priced as
    :func:`~cp_handler.auto.choice.predict` prices them with overlap 1: the pass's transfers
    (:func:`~cp_handler.auto.pattern_work.pattern_work`) on the row's link, each overlapped one under its slot of
    the schedule, a slot's compute its share of the measured pass (a pass's slots share it as the plan's score
    pairs do), the others exposed in full."""
    case = LinkCase(*(row[f.name] for f in dataclasses.fields(LinkCase)))
    backward = row["pass"] == "backward"
    work = pattern_work(case.pattern, case.attn_case())
    load = [0.0] * len(work.slots)
    other = 0.0
    for t in work.transfers:
        if t.backward != backward:
            continue
        seconds = LATENCY_S + t.bytes_sent / (row["gbps"] * 1e9)
        if t.slot is None:
            other += seconds
        else:
            load[t.slot] += seconds
    pass_share = 1 - FORWARD_SHARE if backward else FORWARD_SHARE
    compute = row["compute_ms"] / 1e3
    hidden = sum(min(s, slot.share / pass_share * compute) for s, slot in zip(load, work.slots, strict=True))
    return 1e3 * (sum(load) + other), 1e3 * (other + sum(load) - hidden)


def run(args) -> dict:
    """``--modes links``: every pattern at cp 2 and 4 on emulated links (module doc), scored against the model."""
    rows = []
    for cp in args.links_cp_sizes:
        patterns = [p for p in ("p2p", "all_gather", "a2a", "a2a+p2p") if p != "a2a+p2p" or levels_of(cp)]
        cases = [LinkCase(p, cp, args.links_seq_len, 8, 8, 64) for p in patterns]
        rows += launch(links_worker, cp, cases, RATIOS, args.reps, program="cp-bench")[0]
    for row in rows:
        row["model_transfer_ms"], row["model_exposed_ms"] = predicted_exposed_ms(row)
        row["agrees"] = agrees(row)
    return {"latency_s": LATENCY_S, "ratios": list(RATIOS), "rows": rows,
            "agreeing": sum(r["agrees"] for r in rows) / len(rows)}


NOISE = 0.03
"""A measured exposure is the difference of two medians of a pass; this machine's run-to-run spread is about 3% of
a pass (docs/performance.md), so an agreement is judged within that, or 5% of the transfer if larger."""


def agrees(row: dict) -> bool:
    """The measured exposure within ``max(5% of the transfer, NOISE x the pass)`` of the model's."""
    tolerance = max(0.05 * row["transfer_ms"], NOISE * row["compute_ms"])
    return abs(row["exposed_ms"] - row["model_exposed_ms"]) <= tolerance
