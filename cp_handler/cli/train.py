"""``cp-train``: train the reference GPT (or a Hugging Face causal LM) context-parallel on real text.

The command only parses and checks its flags (:mod:`.args`: every rule before any rank starts, into a
frozen :class:`~cp_handler.training.TrainConfig`), starts the run (:func:`~cp_handler.training.run.run_training`:
the ranks are spawned, or this process is one rank under torchrun) and reports: the loss, tokens/s,
the checks' verdicts and ``--metrics-out``.
"""

from __future__ import annotations

import os
import sys

from ..runtime.forking import fresh_process
from ..training.run import run_training
from .args import parse
from .common import write_output


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as the command: nothing computed in this process yet (runtime/launch.py)
        fresh_process()
    config, metrics_out = parse(argv)
    metrics = run_training(config)
    if metrics is None:  # a non-zero rank under torchrun
        return 0
    first, last = metrics["steps"][0]["loss"], metrics["steps"][-1]["loss"]
    print(f"cp-train: loss {first:.4f} -> {last:.4f} over {len(metrics['steps'])} steps, "
          f"{metrics['tokens_per_s_mean']:.0f} tokens/s", file=sys.stderr)
    if metrics_out:
        if not write_output("cp-train", "--metrics-out", metrics_out, metrics):
            return 1
        print(f"cp-train: metrics written to {os.path.abspath(metrics_out)}", file=sys.stderr)
    checks = [metrics.get(name, {"passed": True})["passed"] for name in ("parity", "eval_cp_check")]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
