"""The GPU checks, in stages, and ``pass``: the pending stages in order of value within one lent GPU's budget.

A session that draws a GPU runs one command (``PYTHONPATH=.``, nothing installed):

    scripts/gpu_check.sh pass [--budget 480] [--only STAGE ...]   # on the GPU machine
    python3 scripts/gpu_check.py pass --dry-run                    # here: the plan, no GPU needed
    python3 scripts/gpu_check.py record FILE                       # here: write the pass's results into the ledger

``pass`` runs the stages of :data:`PASS_ORDER` that the ledger (``docs/gpu_ledger.json``, :mod:`gpu_ledger`) does
not show as passed on the code they cover, in that order, until ``--budget`` seconds are spent: each part gets the
time left as its timeout, a stage that cannot start with 30 s left is ``NOT RUN``. It writes at most three files to
``$OUT`` (else ``runs/gpu_check``): ``gpu_pass.json`` (per stage: result, seconds, source hash, parts with their
last lines and plan rows or memory figures), ``gpu_pass.log`` (every part's output), and ``gpu_pass_trace.json.gz``
(the ``profile_thd`` stage's Chrome trace). The order (value to users first):

1. ``default`` (about 3 min): what every user runs, in bf16 through the automatic kernel: every pattern and the
   layout ops; the GPT step; the masks suite (windows, chunks, soft-caps, sinks, MLA widths through
   ``efficient``); the hybrid mixer methods on CUDA against the CPU reference; thd last (it stalled once).
2. FlashAttention-4, only when ``flash_attn.cute`` imports (the two-call bundle of ``../shared/gpu/fa4_bundle.sh``,
   then ``PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:.``): ``fa4_kernels`` (blocks and packed
   calls against float64, no recompile across block shapes), ``fa4_patterns`` (every pattern in bf16 / fp16 forced
   to ``fa4`` / ``fa4_varlen``), ``fa4_plan`` (the efficiency table at cp 4, 16k and 4k tokens per rank, bshd and
   thd, beside whole-sequence SDPA / cuDNN, FlexAttention and FA4).
3. ``memory``: the offload step exact on CUDA, then ``cp-train`` on one GPU over a 2-layer slice of Llama-3-8B at
   growing lengths; the first length that runs out of memory ends the row (that row is the result, not a failure).
4. ``cudnn_ragged`` (two lengths of one bucket exact), ``varlen_fp16`` (every pattern in fp16 through
   ``flash_varlen``), ``profile_thd`` (a :mod:`torch.profiler` trace of rank 0's thd ring step, cp 4, 64k tokens).
5. The full earlier stages, in every dtype: ``kernels``, ``patterns``, ``gpt``, ``masks``, ``opt_in``, ``plan``.

``gpu_check.py STAGE`` runs one stage whatever the ledger says (also ``mixers``, the mixers part of ``default``)
and writes ``gpu_check_<stage>.json`` / ``.log``. Measured on an H100 (2026-11-24, torch 2.11.0+cu130): kernels
21 s, opt_in 51 + 48 s (flash_gqa, flash_varlen) + cudnn (bshd: a graph per block shape makes it minutes), plan
138 s, patterns 162 s, gpt 51 s, masks 63 s. A kernel's ``verified_on`` is set only after its parts pass here
(docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_ledger  # noqa: E402  (beside this script)

ROOT = gpu_ledger.ROOT
PYTHON = sys.executable
# addopts="": pyproject's --timeout (pytest-timeout) is a CPU-suite hang guard; the part's timeout guards here.
# -s: the spawned ranks' stderr (their stacks every 60 s, a crash's Python stack) reaches the log as it is written;
# captured, it was lost with a stopped part (the thd stall of 2026-11-27 left no stack)
PYTEST = [PYTHON, "-m", "pytest", "-v", "-s", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu"]
BENCH = [PYTHON, "-m", "cp_handler.bench.cli", "--modes", "plan", "--device", "cuda", "--plan-cp-sizes", "4",
         "--reps", "5", "--warmup", "2", "--no-plots"]
PATTERNS = ["tests/test_attn_patterns.py", "tests/test_thd.py"]
FORCED_KERNELS = ("flash_gqa", "flash_varlen", "cudnn")  # the stage keeps its first name, opt_in
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
             "max_position_embeddings": 1048576, "tie_word_embeddings": False}
"""Llama-3-8B's shape (docs/performance.md's projection); ``max_position_embeddings`` raised for long sequences."""
ROW_SEQ_LENS = (65536, 131072, 262144, 393216, 524288)
PROFILE = ("import os; from cp_handler.bench.plan import PlanCase, PlanShape, profile_case; "
           "print(profile_case(PlanCase('p2p', 'thd', 4, 65536), PlanShape(), os.environ['GPU_CHECK_TRACE']))")
PASS_ORDER = ("default", "fa4_kernels", "fa4_patterns", "fa4_plan", "memory", "compile", "cudnn_ragged",
              "varlen_fp16", "profile_thd", "kernels", "patterns", "gpt", "masks", "opt_in", "deterministic", "plan")
NEEDS_FA4 = ("fa4_kernels", "fa4_patterns", "fa4_plan")
MIN_START_S = 30
"""A part does not start with less time left than this."""
PART_CAP_S = {"patterns_bf16": 120, "gpt_bf16": 90, "masks_bf16": 120, "mixers": 120, "thd_bf16": 120}
"""Seconds a part of ``default`` may take (about 3x its expected time: the H100 run of 2026-11-24 took 159 s for
patterns + thd + layout in three dtypes, 51 s for gpt, 63 s for masks): one stalled part cannot starve the rest.
A part over its cap fails; a part stopped by the pass's budget is ``STOPPED`` (its stage ``INCOMPLETE``)."""
STACKS_ENV, STACKS_AFTER_S = "CP_HANDLER_TEST_STACKS_S", 60
"""Every spawned test rank prints its Python stacks every 60 s (tests/dist_utils.py): a stall shows where."""
OOM = ("OutOfMemoryError", "CUDA out of memory")


def memory_rows(scratch: Path) -> list[tuple[str, list[str], dict]]:
    """cp-train on one GPU over a 2-layer slice of Llama-3-8B at each of ``ROW_SEQ_LENS`` (the run that
    runs out of memory ends the row); the config is written into ``scratch``."""
    config = scratch / "llama3_8b_2_layers"
    train = [PYTHON, "-m", "cp_handler.cli.train", "--hf-config", str(config), "--dtype", "bfloat16",
             "--fsdp", "--recompute", "--loss-chunk-tokens", "4096", "--mlp-chunk-tokens", "4096", "--batch-size", "1",
             "--steps", "2", "--nproc", "1"]
    return [(f"row_{n}", [*train, "--seq-len", str(n), "--metrics-out", str(scratch / f"row_{n}" / "metrics.json")],
             {}) for n in ROW_SEQ_LENS]


def stages(scratch: Path) -> dict[str, list[tuple[str, list[str], dict]]]:
    """Each stage's parts: ``(name, command, extra environment)``."""
    plan_fa4 = [*BENCH, "--plan-seq-lens", "65536", "16384", "--whole-kernels", "sdpa", "flex", "fa4"]
    bench = [*BENCH, "--plan-seq-lens", "65536", "16384", "4096"]
    return {
        "default": [("patterns_bf16", [*PYTEST, PATTERNS[0], "tests/test_handler_layout.py", "-k",
                                       "bf16 or layout_ops"], {}),
                    ("gpt_bf16", [*PYTEST, "tests/test_gpt_parity.py", "-k", "bf16"], {}),
                    ("masks_bf16", [*PYTEST, "tests/test_masks.py", "-k", "bf16"], {}),
                    ("mixers", [*PYTEST, "tests/test_hybrid.py"], {}),
                    ("thd_bf16", [*PYTEST, PATTERNS[1], "-k", "bf16"], {})],  # last: it stalled on 2026-11-27
        "fa4_kernels": [("fa4_vs_float64", [*PYTEST, "tests/test_fa4.py", "tests/test_kernels.py", "-k",
                                            "fa4 or gpu"], {})],
        "fa4_patterns": [*((f"patterns_{k}_{d}", [*PYTEST, "-k", d, test], {"CP_HANDLER_ATTN_KERNEL": k})
                           for d in ("bf16", "fp16")
                           for k, test in (("fa4", PATTERNS[0]), ("fa4_varlen", PATTERNS[1]))),
                         ("masked_fa4", [*PYTEST, "tests/test_masks.py", "-k", "fa4_masked"], {})],
        "fa4_plan": [(f"plan_{k}_{fmt}", [*plan_fa4, *(["--attn-kernel", k] if k != "auto" else []), "--formats",
                                          fmt, "--out-dir", str(scratch / f"plan_{k}_{fmt}")], {})
                     for k, fmt in (("fa4", "bshd"), ("fa4_varlen", "thd"), ("auto", "bshd"), ("auto", "thd"))],
        "memory": [("offload", [*PYTEST, "tests/test_chunked_loss.py"], {}), *memory_rows(scratch)],
        "compile": [("compile", [*PYTEST, "tests/test_compile.py"], {})],  # the compiled step on CUDA (Inductor)
        "cudnn_ragged": [("cudnn_ragged", [*PYTEST, "tests/test_cudnn_ragged.py"], {})],
        "varlen_fp16": [("patterns_flash_varlen_fp16", [*PYTEST, "-k", "fp16", *PATTERNS],
                         {"CP_HANDLER_ATTN_KERNEL": "flash_varlen"})],
        "profile_thd": [("profile_thd", [PYTHON, "-c", PROFILE], {})],
        "kernels": [("kernels_vs_float64", [*PYTEST, "tests/test_kernels.py", "tests/test_varlen.py"], {})],
        "opt_in": [(f"patterns_{k}", [*PYTEST, "-k", "bf16", *(PATTERNS[:1] if k == "cudnn" else PATTERNS)],
                    {"CP_HANDLER_ATTN_KERNEL": k}) for k in FORCED_KERNELS],  # cudnn: not for thd (a graph per shape)
        "plan": [(f"plan_{k}", [*bench, "--attn-kernel", k, "--formats", fmt, "--out-dir", str(scratch / f"plan_{k}")],
                  {}) for k, fmt in (("flash", "bshd"), ("flash_gqa", "bshd"), ("flash_varlen", "thd"),
                                     ("cudnn", "bshd"))],
        "patterns": [("patterns", [*PYTEST, *PATTERNS, "tests/test_handler_layout.py"], {})],
        "gpt": [("gpt", [*PYTEST, "tests/test_gpt_parity.py", "tests/test_gpu_backends.py"], {})],
        "masks": [("masks", [*PYTEST, "tests/test_masks.py"], {})],
        "mixers": [("mixers", [*PYTEST, "tests/test_hybrid.py"], {})],
        "deterministic": [("deterministic_cuda", [*PYTEST, "tests/test_deterministic_gpu.py"], {})],  # opt-in path
    }


def stage_hash(stage: str, root: Path = ROOT) -> str:
    """:func:`gpu_ledger.source_hash` of ``stage`` with its commands as on any machine (the interpreter and the
    scratch folder named, not their paths here)."""
    parts = stages(Path("SCRATCH"))[stage]
    commands = [[name, ["python" if c == PYTHON else c for c in command], env] for name, command, env in parts]
    return gpu_ledger.source_hash(stage, commands, root)


def fa4_release() -> str | None:
    """The flash-attn-4 release importable here (``None``: not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_part(name: str, command: list[str], env: dict, deadline: float, log) -> dict:
    """Runs one part until ``deadline`` (``time.monotonic()``) or its :data:`PART_CAP_S`, in a session of its own
    (on a stop the whole process group goes: no spawned rank is left holding the GPU). Every output line goes to
    ``log`` prefixed with the seconds since the part started. Returns ``{part, status, seconds, tail}``; status
    ``PASS``, ``OOM`` (ran out of GPU memory), ``FAIL (exit N)``, ``FAIL (over its N s cap)`` or ``STOPPED (budget
    spent)``."""
    started = time.monotonic()
    limit = min(deadline - started, PART_CAP_S.get(name, float("inf")))
    log.write(f"\n===== {name}: {' '.join(command)} (limit {limit:.0f} s)\n")
    log.flush()
    lines: list[str] = []
    path = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
                                                    STACKS_ENV: str(STACKS_AFTER_S), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            log.write(f"[{time.monotonic() - started:6.1f}s] {line}")
            log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit)
        status = "PASS" if code == 0 else f"FAIL (exit {code})"
    except subprocess.TimeoutExpired:
        _stop(proc)
        status = "STOPPED (budget spent)" if limit < PART_CAP_S.get(name, float("inf")) else \
            f"FAIL (over its {limit:.0f} s cap)"
    reader.join(timeout=10)
    if status.startswith("FAIL (exit") and any(s in line for line in lines for s in OOM):
        status = "OOM"
    seconds = time.monotonic() - started
    print(f"gpu_check: {name}: {status} in {seconds:.0f} s", flush=True)
    tail = lines[-(40 if name == "profile_thd" else 6):]  # the profile's table whole
    return {"part": name, "status": status, "seconds": round(seconds, 1), "tail": tail}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group, SIGKILL 10 s later if it is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_stage(stage: str, scratch: Path, deadline: float, log, trace: Path) -> dict:
    """Runs ``stage``'s parts until ``deadline`` (``time.monotonic()``): ``{stage, result, seconds, parts}``; result
    ``PASS`` (every part passed; memory: the first length that runs out of memory ends the row, 64k must fit),
    ``FAIL``, or ``INCOMPLETE`` (a part not run for the budget). ``profile_thd`` writes its trace to ``trace``."""
    started, parts = time.monotonic(), []
    if stage == "memory":
        (scratch / "llama3_8b_2_layers").mkdir()
        (scratch / "llama3_8b_2_layers" / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": 2}))
    for name, command, env in stages(scratch)[stage]:
        left = deadline - time.monotonic()
        if left < MIN_START_S:
            parts.append({"part": name, "status": "NOT RUN (budget spent)", "seconds": 0})
            continue
        parts.append(run_part(name, command, {**env, "GPU_CHECK_TRACE": str(trace)}, deadline, log))
        bench = scratch / name / "results.json"
        if bench.exists():
            parts[-1]["plan"] = json.loads(bench.read_text())["plan"]
        metrics = scratch / name / "metrics.json"
        if metrics.exists():  # a memory row: cp-train's peak memory and throughput
            run = json.loads(metrics.read_text())
            parts[-1].update({key: run[key] for key in ("memory_kind", "peak_memory_bytes_per_rank",
                                                         "state_bytes_per_rank", "tokens_per_s_mean") if key in run})
        if name.startswith("row_") and parts[-1]["status"] != "PASS":
            break  # a longer sequence will not fit either
    statuses = [p["status"] for p in parts]
    first_row_oom = stage == "memory" and statuses[1:2] == ["OOM"]
    if first_row_oom or any(s.startswith("FAIL") or (s == "OOM" and stage != "memory") for s in statuses):
        result = "FAIL"
    elif any(s.startswith(("NOT RUN", "STOPPED")) for s in statuses):
        result = "INCOMPLETE"
    else:
        result = "PASS"
    return {"stage": stage, "result": result, "seconds": round(time.monotonic() - started, 1), "parts": parts}


def device_info() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "fa4": fa4_release()}


def fa4_importable() -> bool:
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError:
        return False
    return True


def plan_pass(only: list[str] | None, ledger: dict) -> list[tuple[str, str, bool]]:
    """``(stage, source hash, pending)`` for every stage of :data:`PASS_ORDER` (only those in ``only``, if given)."""
    chosen = [s for s in PASS_ORDER if not only or s in only]
    return [(s, h, gpu_ledger.is_pending(s, h, ledger)) for s in chosen for h in [stage_hash(s)]]


def _out_dir() -> Path | None:
    """``$OUT`` (else runs/gpu_check), created; ``None`` (with a message) where no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (pass --dry-run prints the plan)", file=sys.stderr)
        return None
    out = Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    return out


def cmd_pass(args) -> int:
    ledger = gpu_ledger.load(args.ledger)
    plan = plan_pass(args.only, ledger)
    if args.dry_run:
        for stage, _, pending in plan:
            entry = ledger.get(stage)
            last = f"last {entry['result']} on {entry['commit'][:10]} ({entry['date']}, {entry['device']})" \
                if entry else "never run"
            need = " [needs FA4 installed]" if stage in NEEDS_FA4 else ""
            print(f"{stage:14s} {'PENDING' if pending else 'passed on this code':20s} {last}{need}")
        return 0
    out = _out_dir()
    if out is None:
        return 2
    started = time.monotonic()
    deadline, has_fa4, results = started + args.budget, fa4_importable(), []
    with tempfile.TemporaryDirectory() as scratch, open(out / "gpu_pass.log", "w") as log:
        for stage, source_hash, pending in plan:
            if not pending:
                continue
            why = "flash_attn.cute not importable" if stage in NEEDS_FA4 and not has_fa4 else \
                "budget spent" if deadline - time.monotonic() < MIN_START_S else None
            if why:
                results.append({"stage": stage, "result": "NOT RUN", "why": why, "source_hash": source_hash,
                                "seconds": 0, "parts": []})
                continue
            stage_dir = Path(scratch) / stage
            stage_dir.mkdir()
            results.append({**run_stage(stage, stage_dir, deadline, log, out / "gpu_pass_trace.json.gz"),
                            "source_hash": source_hash})
    summary = {**device_info(), "budget_s": args.budget, "seconds": round(time.monotonic() - started, 1),
               "stages": results}
    (out / "gpu_pass.json").write_text(json.dumps(summary, indent=2))
    print("gpu_check pass: " + (", ".join(f"{r['stage']}={r['result']}" for r in results) or "nothing pending")
          + f" ({summary['device']}, torch {summary['torch']}, {summary['seconds']:.0f} s)")
    return 1 if any(r["result"] == "FAIL" for r in results) else 0


def cmd_record(args) -> int:
    summary = json.loads(Path(args.file).read_text())
    ran = [s["stage"] for s in summary["stages"] if s["result"] != "NOT RUN"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    ledger = gpu_ledger.record(gpu_ledger.load(args.ledger), summary, {s: stage_hash(s) for s in ran}, commit,
                               {s: gpu_ledger.uncommitted(gpu_ledger.COVERS[s]) for s in ran})
    args.ledger.write_text(json.dumps(ledger, indent=2) + "\n")
    written = ", ".join(f"{s}={ledger[s]['result']}" for s in ran) or "nothing ran"
    print(f"gpu_check record: {written} on {commit[:10]} -> {args.ledger}")
    return 0


def cmd_stage(args) -> int:
    out = _out_dir()
    if out is None:
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch, open(out / f"gpu_check_{args.stage}.log", "w") as log:
        result = run_stage(args.stage, Path(scratch), started + args.budget, log,
                           out / f"gpu_check_{args.stage}_trace.json.gz")
    summary = {**device_info(), **result}
    (out / f"gpu_check_{args.stage}.json").write_text(json.dumps(summary, indent=2))
    print(f"gpu_check {args.stage}: " + ", ".join(f"{r['part']}={r['status']}" for r in result["parts"])
          + f" ({summary['device']}, torch {summary['torch']}, {result['seconds']:.0f} s)")
    return 0 if result["result"] == "PASS" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pass", help="the pending stages in order within --budget seconds")
    p.add_argument("--budget", type=float, default=480.0, help="seconds the pass may spend (default 480)")
    p.add_argument("--only", nargs="+", choices=PASS_ORDER, help="consider only these stages (still in order)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (no GPU needed)")
    p.add_argument("--ledger", type=Path, default=gpu_ledger.LEDGER)
    r = sub.add_parser("record", help="write a pass's gpu_pass.json into the ledger")
    r.add_argument("file")
    r.add_argument("--ledger", type=Path, default=gpu_ledger.LEDGER)
    for stage in stages(Path("SCRATCH")):
        s = sub.add_parser(stage, help=f"run the {stage} stage whatever the ledger says")
        s.add_argument("--budget", type=float, default=420.0, help="seconds the stage may spend (default 420)")
    args = parser.parse_args(argv)
    if args.command == "pass":
        return cmd_pass(args)
    if args.command == "record":
        return cmd_record(args)
    args.stage = args.command
    return cmd_stage(args)


if __name__ == "__main__":
    raise SystemExit(main())
