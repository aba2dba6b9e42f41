"""The GPU ledger: which stage of ``scripts/gpu_check.py`` passed on which code (``docs/gpu_ledger.json``).

A lent GPU is rare and short (15 minutes per session that draws one), so a GPU pass runs only the stages whose
code changed since they last passed. Each stage covers a set of source files (:data:`COVERS`: the library code it
runs and the tests it calls); a stage's *source hash* is the SHA-256 of those files' paths and bytes plus the
stage's own commands (so a stage whose tests or flags change is stale too). A stage is pending unless the ledger
holds a ``PASS`` for it with the hash the working tree has now.

``gpu_check.py pass`` computes the hashes on the GPU machine (the working tree travels there, without ``.git``)
and writes them into its JSON; ``gpu_check.py record FILE`` (here, after the pass) writes each stage that ran into
the ledger with the commit checked out here, and refuses a stage whose hash differs from this tree's (the JSON came
from other code) or whose covered files are not committed (the commit would not name the code that ran).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "docs" / "gpu_ledger.json"

_ATTN = ("cp_handler/ops", "cp_handler/handlers", "cp_handler/core/layout.py", "cp_handler/core/masks.py",
         "cp_handler/core/comm_types.py", "cp_handler/runtime/rope.py", "cp_handler/runtime/config.py",
         "cp_handler/runtime/groups.py")
"""The attention path every pattern stage runs: ops (plans, kernels, merge), handlers, layout, masks, RoPE."""
_HARNESS = ("tests/conftest.py", "tests/dist_utils.py", "tests/device_cases.py", "tests/host_staging.py",
            "tests/attn_reference.py")
"""The GPU test harness: spawned ranks, host-staged collectives, the float64 references and tolerances."""
_PATTERN_TESTS = ("tests/test_attn_patterns.py", "tests/test_thd.py", "tests/test_handler_layout.py")
_BENCH = ("cp_handler/bench/plan.py", "cp_handler/bench/whole.py", "cp_handler/bench/cli.py",
          "cp_handler/bench/flag_rules.py", "cp_handler/bench/report.py", "cp_handler/bench/defaults.py",
          "cp_handler/bench/case_progress.py", "cp_handler/core/progress.py")
_PATTERN_STAGE = (*_ATTN, *_HARNESS, *_PATTERN_TESTS)
"""What a stage running every pattern (in some dtype, through some kernel) covers."""
_PLAN_STAGE = (*_ATTN, *_BENCH)
"""What a stage timing or profiling rank plans (cp-bench's plan mode) covers."""

COVERS: dict[str, tuple[str, ...]] = {
    "default": (*_PATTERN_STAGE, "cp_handler/models", "tests/gpt_reference.py",
                "tests/test_gpt_parity.py", "tests/test_masks.py", "tests/test_hybrid.py", "tests/mixer_reference.py"),
    "fa4_kernels": ("cp_handler/ops/kernels", "cp_handler/ops/blocks.py", "cp_handler/ops/packed_blocks.py",
                    "tests/test_fa4.py", "tests/test_kernels.py", *_HARNESS),
    "fa4_patterns": (*_PATTERN_STAGE, "tests/test_masks.py"),
    "fa4_plan": _PLAN_STAGE,
    "memory": ("cp_handler", "tests/test_chunked_loss.py", *_HARNESS),
    "compile": (*_ATTN, *_HARNESS, "cp_handler/handlers/opaque.py", "cp_handler/training/compile.py",
                "cp_handler/models", "tests/gpt_reference.py", "tests/test_compile.py"),
    "cudnn_ragged": ("cp_handler/ops/kernels", "tests/test_cudnn_ragged.py", *_HARNESS),
    "varlen_fp16": _PATTERN_STAGE,
    "profile_thd": _PLAN_STAGE,
    "kernels": ("cp_handler/ops/kernels", "cp_handler/ops/blocks.py", "cp_handler/ops/packed_blocks.py",
                "tests/test_kernels.py", "tests/test_varlen.py", *_HARNESS),
    "patterns": _PATTERN_STAGE,
    "gpt": (*_ATTN, *_HARNESS, "cp_handler/models", "tests/gpt_reference.py", "tests/test_gpt_parity.py",
            "tests/test_gpu_backends.py"),
    "masks": (*_ATTN, *_HARNESS, "tests/test_masks.py"),
    "mixers": (*_ATTN, *_HARNESS, "tests/test_hybrid.py", "tests/mixer_reference.py"),
    "opt_in": _PATTERN_STAGE,
    "deterministic": (*_ATTN, *_HARNESS, "cp_handler/models", "tests/deterministic_cases.py",
                      "tests/test_deterministic_gpu.py"),
    "plan": _PLAN_STAGE,
}
"""Per stage, the files and folders (relative to the repository root) whose change makes it pending again."""


def _files(paths: tuple[str, ...], root: Path) -> list[Path]:
    out = set()
    for p in paths:
        path = root / p
        if path.is_dir():
            out.update(f for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        elif path.is_file():
            out.add(path)
        else:
            raise FileNotFoundError(f"gpu_ledger: a covered path does not exist: {p}")
    return sorted(out)


def source_hash(stage: str, commands: list, root: Path = ROOT) -> str:
    """SHA-256 (hex) of ``stage``'s covered files (relative paths and bytes, in sorted order) and its ``commands``
    (JSON). Raises ``KeyError`` for a stage without a :data:`COVERS` entry, ``FileNotFoundError`` for a covered
    path missing from ``root``."""
    h = hashlib.sha256(json.dumps(commands).encode())
    for f in _files(COVERS[stage], root):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def load(path: Path = LEDGER) -> dict:
    """The ledger: ``{stage: {commit, source_hash, date, device, torch, cuda, cudnn, fa4, result, seconds, parts}}``
    (empty when the file does not exist yet)."""
    return json.loads(path.read_text()) if path.exists() else {}


def is_pending(stage: str, hash_now: str, ledger: dict) -> bool:
    """True unless the ledger holds a ``PASS`` of ``stage`` on code with ``hash_now``."""
    entry = ledger.get(stage)
    return not (entry and entry["result"] == "PASS" and entry["source_hash"] == hash_now)


def uncommitted(paths: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """The files under ``paths`` that ``git status`` shows as changed or untracked (not ignored)."""
    done = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=root, capture_output=True, text=True,
                          check=True)
    return [line[3:] for line in done.stdout.splitlines()]


def record(ledger: dict, summary: dict, hashes_now: dict[str, str], commit: str,
           dirty: dict[str, list[str]]) -> dict:
    """A new ledger: ``ledger`` with each stage of ``summary["stages"]`` that ran (result ``PASS``, ``FAIL`` or
    ``INCOMPLETE``; ``NOT RUN`` stages leave their entry as it was) written with ``commit``.

    Raises:
        ValueError: a stage's ``source_hash`` in ``summary`` differs from ``hashes_now[stage]`` (the pass ran other
            code than this tree holds), or ``dirty[stage]`` lists uncommitted covered files — before any entry is
            written.
    """
    ran = [s for s in summary["stages"] if s["result"] != "NOT RUN"]
    for s in ran:
        if s["source_hash"] != hashes_now[s["stage"]]:
            raise ValueError(f"gpu_ledger: stage {s['stage']!r} ran on other code (source_hash {s['source_hash'][:12]}"
                             f" in the pass, {hashes_now[s['stage']][:12]} here): record it from the commit that ran")
        if dirty.get(s["stage"]):
            raise ValueError(f"gpu_ledger: stage {s['stage']!r} covers uncommitted files {dirty[s['stage']]}: commit "
                             "them first, so that the ledger's commit names the code that ran")
    new = dict(ledger)
    device = {k: summary[k] for k in ("date", "device", "torch", "cuda", "cudnn", "fa4")}
    for s in ran:
        new[s["stage"]] = {"commit": commit, "source_hash": s["source_hash"], **device, "result": s["result"],
                           "seconds": s["seconds"], "parts": {p["part"]: p["status"] for p in s["parts"]}}
    return dict(sorted(new.items()))
