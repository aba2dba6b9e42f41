"""The pending GPU checks, in stages that each fit one command on a lent GPU machine.

FlashAttention-4 first (it needs the two-call bundle of ../shared/gpu/fa4_bundle.sh installed into /tmp/site and
``PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:.``; its compile cache in
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, default /tmp/$USER/...):

    python3 scripts/gpu_check.py fa4_kernels   # fa4 / fa4_varlen vs float64 (blocks, merged-lse backward, packed
                                               # calls: length 1, Sq != Sk, > 256 segments), no recompile across
                                               # 20 changing block shapes; the kernel contract tests
    python3 scripts/gpu_check.py fa4_patterns  # every pattern in bf16 and fp16 forced to fa4 (bshd) / fa4_varlen (thd)
    python3 scripts/gpu_check.py fa4_plan      # cp-bench --modes plan per kernel (fa4, fa4_varlen, automatic) beside
                                               # whole-sequence SDPA, FlexAttention and FA4: the efficiency table
    python3 scripts/gpu_check.py cudnn_ragged  # TORCH_CUDNN_SDPA_AVOID_RECOMPILE: two lengths of one bucket exact

Then the earlier stages:

    python3 scripts/gpu_check.py kernels    # every CUDA kernel vs float64 (every dtype it claims, H > 1, the
                                            # out layouts the plans pass), the packed varlen kernel
    python3 scripts/gpu_check.py opt_in     # every pattern (bshd, thd; cudnn: bshd) in bf16 through each
                                            # kernel that is not flash (forced)
    python3 scripts/gpu_check.py plan       # cp-bench --modes plan: 16k, 4k, 1k tokens per rank (cp 4), per kernel
    python3 scripts/gpu_check.py patterns   # pytest -m gpu: patterns, thd, layout ops, automatic kernel, 3 dtypes
    python3 scripts/gpu_check.py gpt        # pytest -m gpu: the GPT step and the TE / MagiAttention handlers
    python3 scripts/gpu_check.py masks      # pytest -m gpu: windows, chunks, soft-caps, sinks, 3 dtypes

And the stages written since, never run yet (docs/testing.md, pending items 5 and 6):

    python3 scripts/gpu_check.py mixers     # pytest -m gpu: the hybrid mixer methods on CUDA vs the CPU reference
    python3 scripts/gpu_check.py memory     # pytest -m gpu: --offload-activations exact; then cp-train on one GPU,
                                            # a 2-layer slice of Llama-3-8B (its 128256 vocabulary), bf16, FSDP2,
                                            # recompute, loss and MLP chunks of 4096, at growing lengths: the
                                            # largest that fits is the measured row beside the memory projection

Run in this order (by value). Measured on an H100 (2026-11-24, torch 2.11.0+cu130): kernels 21 s, opt_in
51 + 48 s (flash_gqa, flash_varlen) + cudnn (bshd: its graph per block shape makes it minutes), plan 138 s,
patterns 162 s, gpt 51 s, masks 63 s. The machine: one GPU, torch 2.11+cu130,
``python3``, nothing installed (run from source: ``PYTHONPATH=.``), 10 minutes per command, at most 8 files
back. So each stage stops starting parts once ``--budget`` seconds (default 420) are spent, gives each part
the time left as its timeout, prints the elapsed time of every part, and writes two files to ``$OUT`` (else
``runs/gpu_check``): ``gpu_check_<stage>.json`` (per part: status, seconds, the last lines; plan rows) and
``gpu_check_<stage>.log``.
A kernel's ``verified_on`` is set only after its parts pass here (docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu"]
BENCH = [sys.executable, "-m", "cp_handler.bench.cli", "--modes", "plan", "--device", "cuda", "--plan-cp-sizes", "4",
         "--plan-seq-lens", "65536", "16384", "4096", "--reps", "5", "--warmup", "2"]
FORCED_KERNELS = ("flash_gqa", "flash_varlen", "cudnn")  # the stage keeps its first name, opt_in
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
             "max_position_embeddings": 1048576, "tie_word_embeddings": False}
"""Llama-3-8B's shape (docs/performance.md's projection); ``max_position_embeddings`` raised for long sequences."""
ROW_SEQ_LENS = (65536, 131072, 262144, 393216, 524288)


def memory_rows(scratch: Path) -> list[tuple[str, list[str], dict]]:
    """cp-train on one GPU over a 2-layer slice of Llama-3-8B at each of ``ROW_SEQ_LENS`` (the run that
    fails for memory ends the row); the config is written into ``scratch``."""
    config = scratch / "llama3_8b_2_layers"
    config.mkdir(exist_ok=True)
    (config / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": 2}))
    train = [sys.executable, "-m", "cp_handler.cli.train", "--hf-config", str(config), "--dtype", "bfloat16",
             "--fsdp", "--recompute", "--loss-chunk-tokens", "4096", "--mlp-chunk-tokens", "4096", "--batch-size", "1",
             "--steps", "2", "--nproc", "1"]
    return [(f"row_{n}", [*train, "--seq-len", str(n), "--metrics-out", str(scratch / f"row_{n}" / "metrics.json")],
             {}) for n in ROW_SEQ_LENS]


def stages(scratch: Path) -> dict[str, list[tuple[str, list[str], dict]]]:
    """Each stage's parts: ``(name, command, extra environment)``."""
    patterns = ["tests/test_attn_patterns.py", "tests/test_thd.py"]
    plan_fa4 = [*BENCH, "--whole-kernels", "sdpa", "flex", "fa4"]
    return {
        "fa4_kernels": [("fa4_vs_float64", [*PYTEST, "tests/test_fa4.py", "tests/test_kernels.py", "-k",
                                            "fa4 or gpu"], {})],
        "fa4_patterns": [(f"patterns_{k}_{d}", [*PYTEST, "-k", d, test], {"CP_HANDLER_ATTN_KERNEL": k})
                         for d in ("bf16", "fp16") for k, test in (("fa4", patterns[0]), ("fa4_varlen", patterns[1]))],
        "fa4_plan": [(f"plan_{k}_{fmt}", [*plan_fa4, *(["--attn-kernel", k] if k != "auto" else []), "--formats",
                                          fmt, "--out-dir", str(scratch / f"{k}_{fmt}")], {})
                     for k, fmt in (("fa4", "bshd"), ("fa4_varlen", "thd"), ("auto", "bshd"), ("auto", "thd"))],
        "cudnn_ragged": [("cudnn_ragged", [*PYTEST, "tests/test_cudnn_ragged.py"], {})],
        "kernels": [("kernels_vs_float64", [*PYTEST, "tests/test_kernels.py", "tests/test_varlen.py"], {})],
        "opt_in": [(f"patterns_{k}", [*PYTEST, "-k", "bf16", *(patterns[:1] if k == "cudnn" else patterns)],
                    {"CP_HANDLER_ATTN_KERNEL": k}) for k in FORCED_KERNELS],  # cudnn: not for thd (a graph per shape)
        "plan": [(f"plan_{k}", [*BENCH, "--attn-kernel", k, "--formats", fmt, "--out-dir", str(scratch / k)], {})
                 for k, fmt in (("flash", "bshd"), ("flash_gqa", "bshd"), ("flash_varlen", "thd"), ("cudnn", "bshd"))],
        "patterns": [("patterns", [*PYTEST, *patterns, "tests/test_handler_layout.py"], {})],
        "gpt": [("gpt", [*PYTEST, "tests/test_gpt_parity.py", "tests/test_gpu_backends.py"], {})],
        "masks": [("masks", [*PYTEST, "tests/test_masks.py"], {})],
        "mixers": [("mixers", [*PYTEST, "tests/test_hybrid.py"], {})],
        "memory": [("offload", [*PYTEST, "tests/test_chunked_loss.py"], {}), *memory_rows(scratch)],
    }


def fa4_release() -> str | None:
    """The flash-attn-4 release importable here (``None``: not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_part(name: str, command: list[str], env: dict, timeout: float, log) -> dict:
    started = time.monotonic()
    log.write(f"\n===== {name}: {' '.join(command)} (timeout {timeout:.0f} s)\n")
    log.flush()
    try:
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        status = "PASS" if done.returncode == 0 else f"FAIL (exit {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"FAIL (stopped after {timeout:.0f} s)"
    seconds = time.monotonic() - started
    print(f"gpu_check: {name}: {status} in {seconds:.0f} s", flush=True)
    return {"part": name, "status": status, "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("fa4_kernels", "fa4_patterns", "fa4_plan", "cudnn_ragged", "kernels",
                                          "opt_in", "plan", "patterns", "gpt", "masks", "mixers", "memory"))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds the stage may spend (default 420)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    device = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "fa4": fa4_release()}
    started, results = time.monotonic(), []
    with tempfile.TemporaryDirectory() as scratch, open(out / f"gpu_check_{args.stage}.log", "w") as log:
        for name, command, env in stages(Path(scratch))[args.stage]:
            left = args.budget - (time.monotonic() - started)
            if left < 30:
                results.append({"part": name, "status": "NOT RUN (stage budget spent)", "seconds": 0})
                continue
            results.append(run_part(name, command, env, left, log))
            bench = Path(scratch) / name.removeprefix("plan_") / "results.json"
            if bench.exists():
                results[-1]["plan"] = json.loads(bench.read_text())["plan"]
            metrics = Path(scratch) / name / "metrics.json"
            if metrics.exists():  # a memory row: cp-train's peak memory and throughput
                run = json.loads(metrics.read_text())
                results[-1].update({key: run[key] for key in ("memory_kind", "peak_memory_bytes_per_rank",
                                                               "state_bytes_per_rank", "tokens_per_s_mean")
                                    if key in run})
            if name.startswith("row_") and results[-1]["status"] != "PASS":
                break  # a longer sequence will not fit either
    summary = {"stage": args.stage, **device, "seconds": round(time.monotonic() - started, 1), "parts": results}
    (out / f"gpu_check_{args.stage}.json").write_text(json.dumps(summary, indent=2))
    print(f"gpu_check {args.stage}: " + ", ".join(f"{r['part']}={r['status']}" for r in results)
          + f" ({device['device']}, torch {device['torch']}, {summary['seconds']:.0f} s)")
    return 0 if all(r["status"] == "PASS" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
