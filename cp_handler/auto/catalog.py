"""Named cost profiles, and finding a profile by name or file (``cp_comm_profile``).

Named profiles are **modelled**, and say so in their ``source``:

* compute: the p2p ring plans of one H100 (FlashAttention-2 blocks, bf16, Llama-3-8B attention: 32 / 8 heads of
  128), measured 2026-11-24 (``docs/benchmarks/results/h100_ring_rank_times.csv``, its 34 rows with cp 2-32),
  fitted to the plan features (:func:`~.calibrate.fit_compute`: median relative error 7%, max 40%); the H200 uses
  the same fit (same SMs; its faster memory is not modelled);
* links: public specifications, not measurements: NVLink 4 inside a node of 8 GPUs, 450 GB/s per direction per
  GPU (H100 / H200 SXM datasheets: 900 GB/s bidirectional), and one 400 Gb/s InfiniBand NDR port per GPU across
  nodes (50 GB/s); a latency of 10 us inside a node and 20 us across (typical NCCL small-message figures,
  assumed); the ring's transfers fully overlapped (``overlap`` 1: NCCL runs on its own SMs).

Groups of up to 8 ranks use the NVLink links, larger ones the InfiniBand links (the ring crosses nodes). A profile
measured on the user's own machines (``cp-bench --calibrate``) replaces all of this.
"""

from __future__ import annotations

import json
import os

from .profile import ComputeFit, CostProfile, GroupProfile, LinkFit

H100_FA2_BF16 = ComputeFit((0.02390082152638741, 0.02353565953091095, 0.0, 0.2092794215386642, 0.20927942153866422),
                           {"rows": 34, "median_rel": 0.0707, "max_rel": 0.4033})
"""The H100 ring plans' fit (module doc); bf16 and fp16 run the same tensor cores."""


def _gpu_profile(name: str, device_name: str) -> CostProfile:
    nvlink = {k: LinkFit(0.01, 450.0) for k in ("p2p", "all_gather", "reduce_scatter", "all_to_all")}
    infiniband = {k: LinkFit(0.02, 50.0) for k in ("p2p", "all_gather", "reduce_scatter", "all_to_all")}
    compute = {"bfloat16": H100_FA2_BF16, "float16": H100_FA2_BF16}
    groups = {size: GroupProfile(compute, nvlink if size <= 8 else infiniband) for size in (2, 4, 8, 16, 32, 64)}
    source = (f"modelled: {device_name} compute fitted to one H100's measured ring plans (2026-11-24, FA2, bf16); "
              "links from public specifications (NVLink 4 450 GB/s per direction inside 8 GPUs, InfiniBand NDR "
              "50 GB/s per GPU across nodes), latencies and full overlap assumed")
    return CostProfile(name, source, "cuda", 1.0, groups)


_DIR = os.path.join(os.path.dirname(__file__), "profiles")


def _measured(file: str) -> CostProfile:
    with open(os.path.join(_DIR, file)) as f:
        return CostProfile.from_json(json.load(f))


NAMED_PROFILES: dict[str, CostProfile] = {
    "h100-nvlink": _gpu_profile("h100-nvlink", "H100 SXM"),
    "h200-nvlink": _gpu_profile("h200-nvlink", "H200 SXM"),
}
"""Profiles by name (module doc); ``cpu-2core-gloo`` (measured on this project's 2-core CI machine) is added below
when its file is installed."""

if os.path.isfile(os.path.join(_DIR, "cpu-2core-gloo.json")):
    NAMED_PROFILES["cpu-2core-gloo"] = _measured("cpu-2core-gloo.json")


def default_profile(device: str) -> CostProfile:
    """The profile "auto" uses when none is named: ``h100-nvlink`` on CUDA (modelled), ``cpu-2core-gloo`` on CPU
    (measured on a 2-core machine: calibrate your own with ``cp-bench --calibrate`` for another CPU).

    Raises:
        ValueError: the CPU profile's file is not installed."""
    name = "h100-nvlink" if device == "cuda" else "cpu-2core-gloo"
    if name not in NAMED_PROFILES:
        raise ValueError(f"cp_comm_type='auto': the default profile {name!r} of {device} is not installed "
                         f"({_DIR}); name one with cp_comm_profile, or calibrate: cp-bench --calibrate")
    return NAMED_PROFILES[name]


def load_profile(name_or_path: str | CostProfile) -> CostProfile:
    """A profile by name (:data:`NAMED_PROFILES`) or from a JSON file written by ``cp-bench --calibrate``.

    Raises:
        ValueError: neither a named profile nor an existing file (listing the names), or a malformed file.
    """
    if isinstance(name_or_path, CostProfile):
        return name_or_path
    if name_or_path in NAMED_PROFILES:
        return NAMED_PROFILES[name_or_path]
    if not isinstance(name_or_path, str) or not os.path.isfile(name_or_path):
        raise ValueError(f"cp_comm_profile={name_or_path!r} is neither a named profile ({sorted(NAMED_PROFILES)}) "
                         "nor a file (cp-bench --calibrate writes one)")
    with open(name_or_path) as f:
        return CostProfile.from_json(json.load(f))
