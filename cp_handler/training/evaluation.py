"""Evaluation during training: held-out loss at the evaluation CP degree and the eval-CP check."""

from __future__ import annotations

import sys

from .config import TrainConfig
from .eval_cp import EvalContextParallel

EVAL_CP_RTOL = {"float32": 1e-5, "bfloat16": 5e-3}
"""Max relative difference of one batch's loss evaluated at training's and at the evaluation CP
degree. Only the attention sums are reordered (float32: ~1e-7 relative per op, a few hundred ops
deep; bfloat16 keeps 8 mantissa bits)."""


def build_evaluators(config: TrainConfig, groups, device_type: str):
    """``(at training's degree, at the evaluation degree)``; new groups only if the degrees differ."""
    at_train = EvalContextParallel(groups, config.cp, config.attn_shape)
    if config.eval_cp.context_parallel_size == config.cp.context_parallel_size:
        return at_train, at_train
    return at_train, EvalContextParallel.build(config.eval_cp, device_type, config.attn_shape)


def check_eval_cp(config: TrainConfig, at_train, at_eval, model, batch, inputs, loss_chunks=None) -> dict:
    """Evaluate ``batch`` at both degrees; ``passed`` if the losses agree within :data:`EVAL_CP_RTOL`."""
    train_loss = at_train.evaluate(model, [batch], inputs, loss_chunks)
    eval_loss = at_eval.evaluate(model, [batch], inputs, loss_chunks)
    rel = abs(train_loss - eval_loss) / abs(train_loss)
    rtol = EVAL_CP_RTOL[config.dtype]
    result = {"train_cp_size": at_train.config.context_parallel_size,
              "eval_cp_size": at_eval.config.context_parallel_size,
              "train_cp_loss": train_loss, "eval_cp_loss": eval_loss, "rel_diff": rel, "rtol": rtol,
              "passed": rel <= rtol}
    return result


def report_eval_check(result: dict) -> None:
    verdict = "passed" if result["passed"] else "FAILED"
    print(f"cp-train: eval-cp check {verdict}: loss {result['train_cp_loss']:.6f} at cp={result['train_cp_size']} vs "
          f"{result['eval_cp_loss']:.6f} at cp={result['eval_cp_size']} (relative difference {result['rel_diff']:.1e}, "
          f"tolerance {result['rtol']:.0e})", file=sys.stderr)
