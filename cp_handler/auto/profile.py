"""A cost profile: what compute and links cost on one kind of machine, measured (``cp-bench --calibrate``) or modelled.

A :class:`CostProfile` holds, per CP group size it covers, a compute fit (milliseconds of one rank's attention
plan, forward + backward, from the plan's features: :class:`~.pattern_work.PlanWork`) and a fit per link kind
(``p2p``, ``all_gather``, ``reduce_scatter``, ``all_to_all``: ``latency + bytes / bandwidth``), plus how far a
ring step's transfer hides behind its compute (``overlap``: 0 = not at all, 1 = fully). Measured profiles
come from :func:`~.calibrate.calibrate` on the machine they describe, at each group size, with every rank of the
group busy at once (ranks sharing cores slow each other: that is part of what is measured). Named profiles
(:data:`~.catalog.NAMED_PROFILES`) are labelled by their ``source``: a modelled profile says which numbers are
public specifications and which were measured.

A profile is JSON (:meth:`CostProfile.save`, :func:`~.catalog.load_profile`). It must fit the run:
:meth:`CostProfile.check` refuses, by the profile's name, a device type or dtype it has no compute fit for and a
group larger than it covers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .pattern_work import FEATURES, PlanWork

LINK_KINDS = ("p2p", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class ComputeFit:
    """``ms = sum(weights[f] * feature f)`` over :data:`~.pattern_work.FEATURES` (weights >= 0)."""

    weights: tuple[float, ...]
    fit_error: dict | None = None

    def __post_init__(self):
        if len(self.weights) != len(FEATURES) or any(w < 0 for w in self.weights):
            raise ValueError(f"ComputeFit: weights={self.weights} must be {len(FEATURES)} values >= 0, one per feature "
                             f"{list(FEATURES)}")

    def ms(self, work: PlanWork) -> float:
        return sum(w * f for w, f in zip(self.weights, work.features(), strict=True))


@dataclass(frozen=True)
class LinkFit:
    """``ms = latency_ms + nbytes / (gbps * 1e9) * 1e3`` for one collective of one rank."""

    latency_ms: float
    gbps: float

    def ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / (self.gbps * 1e9) * 1e3


@dataclass(frozen=True)
class PatternFit:
    """One pattern as this machine runs it, fitted to the pattern's own measured calls: ``scale * modelled +
    fixed_ms + ms_per_melement * elements / 1e6 + ms_per_packed_melement * packed_elements / 1e6``, ``modelled`` the
    compute and link fits' prediction, ``elements`` the q, k and v elements the pattern copies on the rank
    (:attr:`~.pattern_work.PatternWork.elements`) and ``packed_elements`` the query side's with packed documents
    (:attr:`~.pattern_work.PatternWork.packed_elements`, 0 in bshd). ``scale`` takes in what the shared fits miss for
    this pattern in proportion to its work, ``ms_per_melement`` its copies and reorders (they grow with the tensors,
    not with the work), ``fixed_ms`` what a call costs at any size (the handler's Python, the collectives' setup)."""

    scale: float
    fixed_ms: float
    ms_per_melement: float = 0.0
    ms_per_packed_melement: float = 0.0
    """Packed documents (thd): per million query-side elements (:attr:`~.pattern_work.PatternWork.packed_elements`),
    the per-document reorders and merges the features do not count."""

    def ms(self, modelled_ms: float, elements: int, packed_elements: int = 0) -> float:
        return (self.scale * modelled_ms + self.fixed_ms + self.ms_per_melement * elements / 1e6
                + self.ms_per_packed_melement * packed_elements / 1e6)


@dataclass(frozen=True)
class GroupProfile:
    """Compute fits by dtype name, link fits by kind, and each pattern's fit to its own calls (measured profiles;
    none in a modelled one: ``scale`` 1, no fixed cost), for groups of one size."""

    compute: dict[str, ComputeFit]
    links: dict[str, LinkFit]
    patterns: dict[str, PatternFit] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class CostProfile:
    """Compute and link costs of one machine kind (module doc).

    Attributes:
        name: how the profile is named in errors and logs.
        source: where its numbers come from (the measuring command and machine, or the specifications).
        device: the device type the compute fits describe (``"cpu"``, ``"cuda"``).
        overlap: the share of a ring step's transfer that runs under the step's compute (0..1).
        groups: the :class:`GroupProfile` of each group size covered; a group of another size uses the smallest
            covered size above it.
    """

    name: str
    source: str
    device: str
    overlap: float
    groups: dict[int, GroupProfile] = field(default_factory=dict)
    # eq=False: compared and hashed by identity (a workload caches its predictions per profile)

    def group(self, size: int) -> GroupProfile:
        """The fits for a group of ``size`` ranks (the smallest covered size >= ``size``).

        Raises:
            ValueError: the profile covers no group that large (naming the profile and its sizes).
        """
        covered = sorted(self.groups)
        for s in covered:
            if s >= size:
                return self.groups[s]
        raise ValueError(f"cost profile {self.name!r} covers CP groups of {covered} ranks, not {size}: calibrate "
                         f"on this group (cp-bench --calibrate --cp-sizes {size}) or name a profile that covers it")

    def check(self, cp: int, device: str, dtype: str) -> None:
        """Refuse a run this profile does not describe.

        Raises:
            ValueError: another device type, a dtype without a compute fit, or a group larger than covered.
        """
        if device != self.device:
            raise ValueError(f"cost profile {self.name!r} describes {self.device} devices, the inputs are on {device}: "
                             "name a profile of this device (cp_comm_profile) or calibrate one here")
        group = self.group(cp)
        if dtype not in group.compute:
            raise ValueError(f"cost profile {self.name!r} has compute fits for {sorted(group.compute)}, not {dtype}: "
                             f"calibrate with --calibrate-dtype {dtype}")

    def to_json(self) -> dict:
        return {"name": self.name, "source": self.source, "device": self.device, "overlap": self.overlap,
                "groups": {str(size): {"compute": {d: asdict(c) for d, c in g.compute.items()},
                                       "links": {k: asdict(link) for k, link in g.links.items()},
                                       "patterns": {k: asdict(o) for k, o in g.patterns.items()}}
                           for size, g in sorted(self.groups.items())}}

    @classmethod
    def from_json(cls, data: dict) -> CostProfile:
        """Raises ValueError naming what is missing or malformed."""
        try:
            groups = {int(size): GroupProfile(
                {d: ComputeFit(tuple(c["weights"]), c.get("fit_error")) for d, c in g["compute"].items()},
                {k: LinkFit(**link) for k, link in g["links"].items()},
                {k: PatternFit(**o) for k, o in g.get("patterns", {}).items()})
                for size, g in data["groups"].items()}
            profile = cls(data["name"], data["source"], data["device"], float(data["overlap"]), groups)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"cost profile {data.get('name', '?') if isinstance(data, dict) else '?'!r}: malformed "
                             f"({type(err).__name__}: {err})") from err
        for size, group in groups.items():
            missing = [k for k in LINK_KINDS if k not in group.links]
            if missing or any(len(c.weights) != len(FEATURES) for c in group.compute.values()):
                raise ValueError(f"cost profile {profile.name!r}, group size {size}: needs links {list(LINK_KINDS)} "
                                 f"(missing {missing}) and {len(FEATURES)} compute weights ({list(FEATURES)})")
        return profile

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

