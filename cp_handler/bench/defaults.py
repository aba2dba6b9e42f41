"""cp-bench's defaults per mode, device and ``--quick``: one table, read by the flags' help and by each mode's run.

A flag left unset takes its mode's value from :data:`DEFAULTS` for the device the mode's sizes are for: ``--device``
for attn, plan, masks and launches, CPU for the others (they run on CPU only). ``launches`` runs no kernel at all
(it counts CUDA kernels' operators on ``meta`` tensors, on any machine): ``--device`` only picks its grid, a small
one by default (about 20 s on 2 CPU cores), the CUDA grid of ``--modes plan`` with ``--device cuda`` (tens of
minutes on the same CPU; no GPU needed either). Each mode reads its own copy of the flags (:func:`resolve`), so
plan's CPU shape and launches' CUDA shape coexist in one run. The CPU defaults of every mode finish in a few
minutes on 2 cores (attn's full grid: tens of minutes; docs/benchmarks.md has the times measured).
"""

from __future__ import annotations

import argparse
import copy
import textwrap

from ..runtime.config import CP_COMM_TYPES

COMMON = {"comm_types": list(CP_COMM_TYPES), "cp_sizes": [1, 2, 4]}
"""Defaults shared by every mode that reads these flags (attn and e2e: ``--cp-sizes``; attn, plan and launches:
``--comm-types``)."""

_LLAMA_ATTN = {"plan_heads": 32, "plan_kv_heads": 8, "plan_head_dim": 128, "plan_dtype": "bfloat16"}
"""One Llama-3-8B attention layer: the shape of the CUDA plans and of every launch count (CUDA kernels)."""
_SMALL_ATTN = {"plan_heads": 8, "plan_kv_heads": 2, "plan_head_dim": 64, "plan_dtype": "float32"}
"""The CPU emulation's shape (timed with the CPU kernel)."""
_CUDA_GRID = {"plan_seq_lens": [4096, 8192, 16384, 32768, 65536, 131072], "plan_cp_sizes": [1, 2, 4, 8, 16, 32]}


def _same(settings: dict) -> dict:
    """One setting for ``--quick`` and the full run."""
    return {"quick": settings, "full": settings}


def _reps(quick: dict, full: dict) -> dict:
    """``quick`` / ``full`` with ``--reps`` 3 / 5 (every timed mode)."""
    return {"quick": {**quick, "reps": 3}, "full": {**full, "reps": 5}}


_ATTN = _reps({"seq_lens": [2048, 4096], "num_heads": 4, "num_kv_heads": 4},
              {"seq_lens": [4096, 8192, 16384], "num_heads": 8, "num_kv_heads": 8})
_PLAN_CPU = {"plan_seq_lens": [1024, 4096], "plan_cp_sizes": [1, 2, 4, 8], **_SMALL_ATTN}
_PLAN_CUDA = {**_CUDA_GRID, **_LLAMA_ATTN}
_LAUNCHES_CPU = {"plan_cp_sizes": [2, 4, 8], **_LLAMA_ATTN}
DEFAULTS: dict[str, dict[str, dict[str, dict]]] = {
    "attn": {"cpu": _ATTN, "cuda": _ATTN},
    "e2e": {"cpu": _reps({"e2e_seq_len": 2048, "e2e_steps": 6}, {"e2e_seq_len": 8192, "e2e_steps": 10})},
    "plan": {"cpu": _reps(_PLAN_CPU, _PLAN_CPU), "cuda": _reps(_PLAN_CUDA, _PLAN_CUDA)},
    "launches": {"cpu": {"quick": {"plan_seq_lens": [4096, 16384], **_LAUNCHES_CPU},
                         "full": {"plan_seq_lens": [4096, 16384, 65536], **_LAUNCHES_CPU}},
                 "cuda": {"quick": {**_PLAN_CUDA, "plan_seq_lens": [8192, 131072]}, "full": _PLAN_CUDA}},
    "masks": {"cpu": _reps(_SMALL_ATTN, _SMALL_ATTN), "cuda": _reps(_LLAMA_ATTN, _LLAMA_ATTN)},
    "generate": {"cpu": {"quick": {"gen_prompt_lens": [4096, 8192]},
                         "full": {"gen_prompt_lens": [4096, 8192, 16384, 32768, 65536]}}},
    "hybrid": {"cpu": _reps({"hybrid_seq_lens": [2048, 8192]}, {"hybrid_seq_lens": [4096, 16384]})},
    "memory": {"cpu": _same({"mem_seq_len": 2048, "mem_layer_tokens": 64})},
    "compile": {"cpu": _reps({"compile_seq_len": 1024}, {"compile_seq_len": 4096})},
    # a profile's picks near a tie follow its noise: 9 repetitions (issue 72 part 3's regret: worst 1.02 with a
    # profile of 9, 1.16 with one of 5; docs/performance.md)
    "calibrate": {"cpu": {"quick": {"reps": 3}, "full": {"reps": 9}}},
    "auto": {"cpu": _reps({"auto_grid": "quick"}, {"auto_grid": "full"})},
    "backtest": {"cpu": _same({})},
    "links": {"cpu": _reps({"links_seq_len": 4096}, {"links_seq_len": 8192})},
    "tp": {"cpu": {"quick": {"tp_seq_len": 2048, "tp_steps": 4}, "full": {"tp_seq_len": 4096, "tp_steps": 6}}},
}
"""mode -> device (``"cpu"``, ``"cuda"``; a mode without ``"cuda"`` runs on CPU only) -> ``"quick"`` / ``"full"``
-> flag dest -> value. Only flags whose default is ``None`` in the parser appear here (and in :data:`COMMON`)."""

ON_DEVICE = ("attn", "plan", "masks", "launches")
"""Modes whose defaults follow ``--device`` (the others run on CPU)."""


def device_of(mode: str, device: str) -> str:
    """The column of :data:`DEFAULTS` that ``mode`` takes under ``--device device``."""
    return device if mode in ON_DEVICE else "cpu"


def defaults(mode: str, device: str = "cpu", quick: bool = False) -> dict:
    """The defaults of ``mode`` (flag dest -> value) under ``--device device`` (and ``--quick``)."""
    table = DEFAULTS[mode][device_of(mode, device)]["quick" if quick else "full"]
    return copy.deepcopy({**{k: v for k, v in COMMON.items() if k in _READS[mode]}, **table})


_READS = {"attn": {"comm_types", "cp_sizes"}, "e2e": {"cp_sizes"}, "plan": {"comm_types"},
          "launches": {"comm_types"}, "masks": set(), "generate": set(), "hybrid": set(), "memory": set(),
          "compile": set(), "calibrate": set(), "auto": set(), "backtest": set(), "links": set(), "tp": set()}
"""The :data:`COMMON` flags each mode reads."""


def resolve(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    """A copy of ``args`` with ``mode``'s defaults (:func:`defaults`) in the flags left unset (``None``)."""
    out = argparse.Namespace(**vars(args))
    for key, value in defaults(mode, args.device, args.quick).items():
        if getattr(out, key) is None:
            setattr(out, key, value)
    return out


def show(value) -> str:
    """A default as typed on the command line: ``[1, 2]`` -> ``1 2``."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def flags(settings: dict) -> str:
    """``--flag value ...`` of ``settings`` (flag dest -> value)."""
    return " ".join(f"--{key.replace('_', '-')} {show(value)}" for key, value in settings.items())


def summary(args: argparse.Namespace, mode: str) -> str:
    """The sizes ``mode`` runs with (``args``: :func:`resolve`'s), as flags, and whose defaults filled the ones not
    given: the line cp-bench prints as the mode starts."""
    device = device_of(mode, args.device)
    given = flags({key: getattr(args, key) for key in defaults(mode, device, args.quick)})
    note = "; the CUDA grid with --device cuda" if mode == "launches" and device == "cpu" else ""
    return f"{given} (unset flags: the {'CPU' if device == 'cpu' else 'CUDA'}{' --quick' if args.quick else ''} " \
           f"defaults{note})"


def _per_device(mode: str, key: str) -> str | None:
    """``key``'s default in ``mode`` on each device (``--quick``'s in brackets where it differs); ``None`` where
    ``mode`` does not read ``key``."""
    texts = {}
    for device in DEFAULTS[mode]:
        full, quick = defaults(mode, device).get(key), defaults(mode, device, quick=True).get(key)
        if full is not None:
            texts[device] = show(full) + ("" if quick == full else f" (--quick: {show(quick)})")
    if not texts:
        return None
    if len(set(texts.values())) == 1:
        return next(iter(texts.values())) + (" (either --device)" if len(texts) == 2 else "")
    return ", ".join(f"{text} {'on CPU' if device == 'cpu' else 'with --device cuda'}"
                     for device, text in texts.items())


def default_help(key: str) -> str:
    """``default: <modes>: <values>; ...`` of flag dest ``key``, every mode that reads it, from :data:`DEFAULTS`."""
    by_text: dict[str, list[str]] = {}
    for mode in DEFAULTS:
        text = _per_device(mode, key)
        if text is not None:
            by_text.setdefault(text, []).append(mode)
    return "default: " + "; ".join(f"{_listed(modes)}: {text}" for text, modes in by_text.items())


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def epilog(width: int = 100) -> str:
    """Every mode's defaults on CPU and with ``--device cuda``, as flags (the help's closing section), lines
    wrapped at ``width`` characters."""
    lines = ["defaults that depend on the mode, --device and --quick (flags left unset; each mode's on CPU, and with "
             "--device cuda where it has CUDA sizes; times measured on 2 CPU cores: docs/benchmarks.md):"]
    for mode, by_device in DEFAULTS.items():
        same = by_device.get("cuda") == by_device["cpu"]
        for device in ("cpu",) if same else by_device:
            full, quick = defaults(mode, device), defaults(mode, device, quick=True)
            changed = {k: v for k, v in quick.items() if full[k] != v}
            where = "CPU and --device cuda" if same else "CPU" if device == "cpu" else "--device cuda"
            text = f"{mode} ({where}): {flags(full) or 'nothing to size'}"
            lines += textwrap.wrap(text + (f"; --quick: {flags(changed)}" if changed else ""), width,
                                   initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)
