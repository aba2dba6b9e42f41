"""Training under context parallelism as library code: one rank of a run as a :class:`Trainer` with phases
(:mod:`.trainer`), the step's micro-batches (:mod:`.steps`), the loss over a CP group (:mod:`cp_handler.models.loss`
and :mod:`cp_handler.runtime.reductions`, re-exported here), the parity reference (:mod:`.reference`,
:mod:`.parity`), evaluation (at another CP degree: :mod:`.eval_cp`), expert groups, data, checkpoints, and starting
the ranks (:mod:`.run`). ``cp-train`` parses its flags into a :class:`TrainConfig` and calls
:func:`.run.run_training`.

Layer 7 (training as library code, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from ..models.loss import masked_token_loss_sum, next_token_batch
from ..runtime.reductions import all_reduce_grads, global_token_count
from .config import DynamicCP, TrainConfig
from .trainer import Trainer

__all__ = ["DynamicCP", "TrainConfig", "Trainer", "all_reduce_grads", "global_token_count", "masked_token_loss_sum",
           "next_token_batch"]
