"""Named cost profiles, and finding a profile by name or file (``cp_comm_profile``).

Named profiles are **modelled**, and say so in their ``source``:

* compute: the p2p ring plans of one H100 (FlashAttention-2 blocks, bf16, Llama-3-8B attention: 32 / 8 heads of
  128), measured 2026-11-24 (``cp_handler/dynamic/rank_times/h100_ring_rank_times.csv``, its 34 rows with cp 2-32),
  fitted to the plan features (:func:`~.calibrate.fit_compute`: median relative error 7%, max 40%); other GPUs
  scale that fit's milliseconds by a published kernel rate (:data:`GPUS`: H200 and H800 the same SMs, A100 the
  FlashAttention-2 paper's rates, B200 / GB200 FlashAttention-4's);
* links: public specifications, not measurements: NVLink per direction per GPU inside the NVLink domain (8 GPUs,
  72 for GB200 NVL72), one 400 Gb/s InfiniBand NDR port per GPU across (50 GB/s); a latency of 10 us inside and
  20 us across (typical NCCL small-message figures, assumed); the ring's transfers **not** hidden behind its
  compute (``overlap`` 0): vllm-omni measured the ring's overlap net-negative on NVLink, the ring slower than an
  all-gather of the same bytes (issue #5092, 2026-07), and the backtest agrees (docs/performance.md: the winner
  in 91% of the published pairs at overlap 0, 83% at overlap 1).

Groups up to the NVLink domain use the NVLink links, larger ones the InfiniBand links (the ring crosses nodes). A
profile measured on the user's own machines (``cp-bench --calibrate``) replaces all of this; ``cp-bench --modes
backtest`` compares these profiles' predictions with published GPU results (docs/performance.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .profile import LINK_KINDS, ComputeFit, CostProfile, GroupProfile, LinkFit

H100_FA2_BF16 = ComputeFit((0.02390082152638741, 0.02353565953091095, 0.0, 0.0, 0.0, 0.2092794215386642,
                            0.20927942153866422, 0.0), {"rows": 34, "median_rel": 0.0707, "max_rel": 0.4033})
"""The H100 ring plans' fit (module doc), one weight per :data:`~.pattern_work.FEATURES`: causal and full pairs and
about 0.42 ms per ring step (a block and a step; no weight on the softmax, masked area, rows or the key-value
heads' pairs: the fit's rows were all Llama-3-8B's 32 / 8 heads, so the GQA ratio did not vary); bf16 and fp16 run
the same tensor cores. (Its five weights of 2026-11-28 had not followed the features' growth to seven: every
prediction with a named GPU profile raised until 2026-12-05; :class:`~.profile.ComputeFit` now checks.)"""


@dataclass(frozen=True)
class GpuSpec:
    """A modelled GPU: ``compute_scale`` x the H100 fit's milliseconds, NVLink GB/s per direction inside a domain
    of ``nvlink_domain`` GPUs, and where each number comes from."""

    device_name: str
    compute_scale: float
    nvlink_gbps: float
    nvlink_domain: int
    source: str


GPUS = {
    "h100-nvlink": GpuSpec("H100 SXM", 1.0, 450.0, 8, "NVLink 4 900 GB/s bidirectional (datasheet)"),
    "h200-nvlink": GpuSpec("H200 SXM", 1.0, 450.0, 8, "the H100's SMs (its faster memory not modelled); NVLink 4 "
                           "900 GB/s bidirectional (datasheet)"),
    "h800-nvlink": GpuSpec("H800 SXM", 1.0, 200.0, 8, "the H100's SMs; NVLink 400 GB/s bidirectional (datasheet; "
                           "DeepSeek-V3 measured 160 GB/s per direction)"),
    "a100-nvlink": GpuSpec("A100 SXM", 1.65, 300.0, 8, "FlashAttention-2 reaches up to 335 TFLOP/s forward + "
                           "backward on an H100 and about 200 on an A100 (50-73% of 312: arXiv 2307.08691), so "
                           "x 335 / 203; NVLink 3 600 GB/s bidirectional (datasheet)"),
    "b200-nvlink": GpuSpec("B200 (HGX)", 0.236, 900.0, 8, "FlashAttention-4 causal, head dim 128: forward 1,418, "
                           "backward 1,209 TFLOP/s (flash-attention #2280), i.e. 1,262 forward + backward against the "
                           "H100 fit's ~298 (7 (D + Dv) FLOPs per visible pair and head at 0.0235 ms per 1e9); "
                           "NVLink 5 1.8 TB/s bidirectional (datasheet)"),
    "gb200-nvl72": GpuSpec("GB200 NVL72", 0.236, 900.0, 72, "the B200's kernel rates; NVLink 5 1.8 TB/s "
                           "bidirectional across the 72-GPU NVLink domain (datasheet)"),
}
"""The modelled GPUs by profile name (module doc)."""


def payload_links(size: int, latency_ms: float, gbps: float) -> dict[str, LinkFit]:
    """Link fits of a group of ``size`` from a per-direction bandwidth per GPU: a fit prices one rank's payload
    (:class:`~.pattern_work.Transfer`'s ``nbytes``), and a bandwidth-optimal collective sends ``(size - 1)``
    payloads (all-gather, reduce-scatter) or ``(size - 1) / size`` of one (all-to-all) through that bandwidth."""
    sent = {"p2p": 1.0, "all_gather": size - 1.0, "reduce_scatter": size - 1.0, "all_to_all": (size - 1.0) / size}
    return {kind: LinkFit(latency_ms, gbps / sent[kind]) for kind in LINK_KINDS}


def _gpu_profile(name: str, gpu: GpuSpec) -> CostProfile:
    fit = H100_FA2_BF16 if gpu.compute_scale == 1.0 else \
        ComputeFit(tuple(w * gpu.compute_scale for w in H100_FA2_BF16.weights), H100_FA2_BF16.fit_error)
    compute = {"bfloat16": fit, "float16": fit}
    sizes = sorted({2, 4, 8, 16, 32, 64, gpu.nvlink_domain})
    groups = {size: GroupProfile(compute, payload_links(size, 0.01, gpu.nvlink_gbps) if size <= gpu.nvlink_domain
                                 else payload_links(size, 0.02, 50.0)) for size in sizes}
    source = (f"modelled: {gpu.device_name} compute from one H100's measured ring plans (2026-11-24, FA2, bf16) x "
              f"{gpu.compute_scale:g} ({gpu.source}); links {gpu.nvlink_gbps:g} GB/s per direction inside "
              f"{gpu.nvlink_domain} GPUs, InfiniBand NDR 50 GB/s per GPU across; latencies assumed; the ring's "
              "transfers not overlapped (vllm-omni #5092)")
    return CostProfile(name, source, "cuda", 0.0, groups)


_DIR = os.path.join(os.path.dirname(__file__), "profiles")


def _measured(file: str) -> CostProfile:
    with open(os.path.join(_DIR, file)) as f:
        return CostProfile.from_json(json.load(f))


NAMED_PROFILES: dict[str, CostProfile] = {name: _gpu_profile(name, gpu) for name, gpu in GPUS.items()}
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
