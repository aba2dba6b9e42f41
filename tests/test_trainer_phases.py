"""cp-train's Trainer driven phase by phase, as a loop of one's own would (docs/cp-train.md "The Trainer and its
phases"): ``build()``, then ``step()`` / ``after_step()`` per step, then ``finish()``, at cp 2 with the parity
reference on. Each step's loss, gradient and gradient norm are compared with one process's from the same
parameters inside ``step()`` (``--check-parity``'s reference, tolerance ``PARITY_RTOL["float32"]``: the order of float32
sums differs); the loss must fall, and ``after_step`` must add the held-out loss on the steps ``--eval-every`` asks."""

import torch
from dist_utils import run_distributed

from cp_handler.cli.args import parse
from cp_handler.training import Trainer
from cp_handler.training.parity import PARITY_RTOL

FLAGS = ["--nproc", "2", "--cp-size", "2", "--steps", "3", "--seq-len", "64", "--hidden-size", "32",
         "--ffn-hidden-size", "64", "--max-corpus-bytes", "200000", "--check-parity", "--eval-every", "2"]


def _phases(rank, world):
    config, _ = parse(FLAGS)
    trainer = Trainer(config, torch.device("cpu")).build()
    records = []
    for step in trainer.steps():
        record = trainer.step(step)
        assert rank != 0 or {"reference_loss", "grad_rel_diff"} <= set(record), sorted(record)  # rank 0's reference
        trainer.after_step(step, record)
        records.append(record)
    metrics = trainer.finish()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [("eval_loss" in r) for r in records] == [False, True, False]
    assert records[-1]["loss"] < records[0]["loss"]
    if rank == 0:
        for r in records:
            assert abs(r["loss"] - r["reference_loss"]) <= PARITY_RTOL["float32"] * abs(r["reference_loss"]), r
        assert metrics["parity"]["passed"], metrics["parity"]
        assert [r["loss"] for r in metrics["steps"]] == [r["loss"] for r in records]
    else:
        assert metrics is None


def test_trainer_phases_one_by_one_equal_one_process():
    run_distributed(_phases, 2)
