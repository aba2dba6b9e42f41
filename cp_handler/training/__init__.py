"""Training under context parallelism as library code: the loss over a CP group (:mod:`cp_handler.models.loss`,
re-exported here), the step (:mod:`.steps`), the optimizer loop (:mod:`.loop`), the parity reference (:mod:`.reference`,
:mod:`.parity`), evaluation, expert groups, data, and one rank of a run (:mod:`.run`).
``cp-train`` parses its flags into a :class:`TrainConfig` and calls :func:`.run.run_training`.

Layer 7 (training as library code, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from ..models.loss import all_reduce_grads, global_token_count, masked_token_loss_sum, next_token_batch
from .config import DynamicCP, TrainConfig

__all__ = ["DynamicCP", "TrainConfig", "all_reduce_grads", "global_token_count", "masked_token_loss_sum",
           "next_token_batch"]
